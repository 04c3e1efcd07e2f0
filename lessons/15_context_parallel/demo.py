"""Lesson 15: causal attention with the sequence split over ranks (ring attention) equals
attention over the whole sequence in one process; what it sends, what it saves, and how the
zigzag layout evens out the causal mask's work.

python lessons/15_context_parallel/demo.py                               # 4 ranks as threads
minidist run -n 4 --backend mpi lessons/15_context_parallel/demo.py      # or --backend gloo
"""

import math

import torch

from minidist.comm import Counter, ObservedComm
from minidist.context_parallel.ring_attention import ring_attention, shard_sequence
from minidist.launch.launcher import demo_init


def worst(comm, diff: torch.Tensor) -> float:
    """The largest |difference| on any rank."""
    return comm.all_reduce(diff.abs().max().reshape(1).double(), "max").item()


def causal_attention(q, k, v):
    """One process: the (T, T) scores, masked, softmax, times v."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    t = s.shape[-1]
    return torch.softmax(s.masked_fill(torch.ones(t, t).bool().triu(1), -math.inf), -1) @ v


def run(comm, layout: str, t: int = 256, b: int = 2, h: int = 4, d: int = 16) -> None:
    p, r = comm.world_size, comm.rank
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(b, h, t, d, generator=gen, dtype=torch.float64) for _ in range(3)]
    ref = [x.clone().requires_grad_() for x in whole]
    causal_attention(*ref).square().sum().backward()
    mine = [shard_sequence(x, comm, layout).requires_grad_() for x in whole]  # (B, H, T/p, d)
    counter = Counter()
    stats = {}
    saved = {}

    def pack(x):  # what autograd keeps for backward, by storage
        saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        y = ring_attention(*mine, ObservedComm(comm, counter), layout, stats)
    forward = counter.bytes_sent
    y.square().sum().backward()  # the same loss: the sum of squares splits over the tokens
    diffs = [worst(comm, y - shard_sequence(causal_attention(*whole), comm, layout))]
    diffs += [
        worst(comm, a.grad - shard_sequence(x.grad, comm, layout))
        for a, x in zip(mine, ref, strict=True)
    ]
    work = torch.tensor([float(stats["pairs"]), stats["seconds"]], dtype=torch.float64)
    every = comm.all_gather(torch.empty(p, 2, dtype=torch.float64), work)  # (cp, 2)
    sent = (forward, counter.bytes_sent - forward, sum(saved.values()))
    if r == 0:
        title = f"{layout} layout, T={t} on cp={p} ranks over {comm.backend} (B={b} H={h} d={d})"
        report(title, b * h * (t // p) * d * 8, d, diffs, sent, every)


def report(title: str, n: int, d: int, diffs: list, sent: tuple, every: torch.Tensor) -> None:
    """Rank 0 prints; n: the bytes of this rank's q (or k, or v)."""
    p = every.shape[0]
    print(title)
    print("  max |difference| to one process, y dq dk dv:", " ".join(f"{x:.0e}" for x in diffs))
    print(
        f"  sent per rank: forward {sent[0]:,} B (2(cp-1)n = {2 * (p - 1) * n:,}), backward "
        f"{sent[1]:,} B (2(2cp-1)n = {2 * (2 * p - 1) * n if p > 1 else 0:,})"
    )
    print(f"  saved for backward {sent[2]:,} B ((4d+1)BHT/cp x 8 = {(4 * d + 1) * n // d:,})")
    pairs, secs = every[:, 0], every[:, 1]
    print(
        f"  query-key pairs per rank {[int(x) for x in pairs.tolist()]}: max/mean "
        f"{(pairs.max() / pairs.mean()).item():.2f}; compute seconds max/mean "
        f"{(secs.max() / secs.mean()).item():.2f}"
    )


if __name__ == "__main__":
    comm = demo_init(__file__)  # plain `python demo.py`: 4 thread-ranks
    for layout in ("plain", "zigzag"):
        run(comm, layout)
