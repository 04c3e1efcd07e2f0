"""Lesson 05: a transformer block split across ranks equals the block in one process; what it
sends, and what sequence parallelism saves.

python lessons/05_tensor_parallel/demo.py                               # 4 ranks as threads
minidist run -n 4 --backend mpi lessons/05_tensor_parallel/demo.py      # or --backend gloo
"""

import torch
import torch.nn.functional as F

from minidist.comm import Counter, ObservedComm
from minidist.launch.launcher import demo_init
from minidist.tensor_parallel.blocks import ParallelTransformerBlock as Parallel
from minidist.tensor_parallel.blocks import saved_activation_nbytes
from minidist.tensor_parallel.layers import vocab_parallel_cross_entropy
from minidist.transformer import TransformerBlock


def worst(comm, diff: torch.Tensor) -> float:
    """The largest |difference| on any rank."""
    return comm.all_reduce(diff.abs().max().reshape(1).double(), "max").item()


def calls(counter: Counter) -> str:
    return ", ".join(f"{op} x{n}" for op, n in counter.calls.items()) or "none"


def block_demo(comm, b: int = 2, t: int = 8, d: int = 16, heads: int = 4) -> None:
    p, r = comm.world_size, comm.rank
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, t, d, generator=gen, dtype=torch.float64)  # (B, T, D), every rank
    twin = TransformerBlock(d, heads, 4 * d, seed=1, dtype=torch.float64)  # one process
    x_twin = x.clone().requires_grad_()
    alone, y_twin = saved_activation_nbytes(twin, lambda: twin(x_twin))
    y_twin.square().sum().backward()
    if r == 0:
        print(f"one block (B={b} T={t} D={d} heads={heads}) on tp={p} ranks over {comm.backend}")
        print(f"one process saves {alone:,} bytes of activations for backward\n")
    for sp in (False, True):
        counter = Counter()
        block = Parallel(
            d,
            heads,
            4 * d,
            ObservedComm(comm, counter),
            seed=1,
            sequence_parallel=sp,
            dtype=torch.float64,
        )
        lo, hi = (r * t // p, (r + 1) * t // p) if sp else (0, t)  # sp: this rank's tokens
        x_in = x[:, lo:hi].clone().requires_grad_()
        nbytes, y = saved_activation_nbytes(block, lambda: block(x_in))  # noqa: B023
        forward = calls(counter)
        counter.reset()
        y.square().sum().backward()  # the same loss: y is the twin's output, sliced if sp
        dy = worst(comm, y - y_twin[:, lo:hi])
        dx = worst(comm, x_in.grad - x_twin.grad[:, lo:hi])
        if r == 0:
            print("sequence parallel" if sp else "tensor parallel", f"(input {tuple(x_in.shape)})")
            print(f"  max |y - y_twin| {dy:.1e}, max |dL/dx - twin's| {dx:.1e}")
            print(f"  forward:  {forward}\n  backward: {calls(counter)}")
            print(f"  activations per rank {nbytes:,} bytes = {nbytes / alone:.3f} of one process")


def loss_demo(comm, n: int = 6, v: int = 40) -> None:
    """The vocabulary-parallel loss on logits x 1000 (exp() would overflow without the max)."""
    p, r = comm.world_size, comm.rank
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(n, v * p, generator=gen, dtype=torch.float64) * 1000  # (N, V)
    target = torch.randint(0, v * p, (n,), generator=gen)
    mine = logits[:, r * v : (r + 1) * v]  # (N, V/p): the only logits this rank ever sees
    loss = vocab_parallel_cross_entropy(mine, target, comm).mean()
    diff = worst(comm, loss - F.cross_entropy(logits, target))
    if r == 0:
        print(f"\nvocab-parallel cross-entropy, V={v * p} over {p} ranks, logits x 1000:")
        print(f"  loss {loss.item():.3f}, max |difference| to F.cross_entropy {diff:.1e}")


if __name__ == "__main__":
    comm = demo_init(__file__)  # plain `python demo.py`: 4 thread-ranks
    block_demo(comm)
    loss_demo(comm)
