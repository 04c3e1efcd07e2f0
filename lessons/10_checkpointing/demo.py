"""Lesson 10: checkpointed blocks keep their inputs only, recompute the rest in backward.

python lessons/10_checkpointing/demo.py                                    # 4 ranks as threads
minidist run -n 4 --backend mpi lessons/10_checkpointing/demo.py           # or --backend gloo
"""

import copy
import time

import torch
from torch import nn

from minidist.checkpointing.recompute import (
    CheckpointedSequential,
    SavedTensorMeter,
    predicted_peak,
)
from minidist.launch.launcher import demo_init

N_BLOCKS = 16
D = 128
ROWS = 32


class Block(nn.Module):
    def __init__(self, g: torch.Generator):
        super().__init__()
        self.l1, self.l2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        for q in self.parameters():  # seeded, the same on every rank
            q.data = torch.randn(q.shape, generator=g) / q.shape[-1] ** 0.5

    def forward(self, x):  # (B, D) -> (B, D); saves x, W1 x, gelu(W1 x) for backward
        return x + self.l2(nn.functional.gelu(self.l1(x)))


def measure(model: nn.Module, x: torch.Tensor, runs=7) -> tuple[int, float, float, list]:
    times = []  # returns: peak saved bytes, median s of runs 2.., (max-min)/median, grads
    for _ in range(runs):  # the gradients add up over the runs, alike for every policy
        start = time.perf_counter()
        with SavedTensorMeter(exclude=model.parameters()) as meter:
            model(x).mean().backward()  # mean(): a head that saves nothing
        times.append(time.perf_counter() - start)
    t, grads = sorted(times[1:]), [q.grad.clone() for q in model.parameters()]  # 1st: warm-up
    return meter.peak, t[len(t) // 2], (t[-1] - t[0]) / t[len(t) // 2], grads


def main(comm):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    blocks = [Block(g) for _ in range(N_BLOCKS)]
    x = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(comm.rank))  # my share
    a, b = ROWS * (D + 4 * D + 4 * D) * 4, ROWS * D * 4  # saved per block (A), its input (b)
    say = print if comm.rank == 0 else lambda *_: None
    say(
        f"{N_BLOCKS} blocks, {ROWS} rows of width {D} per rank, float32, rank 0's numbers\n"
        f"  policy  k saved (KiB) predicted ms (median, spread) x time"
    )
    same = True
    reference = None
    noisy = False
    for policy in ("none", "block", 2, "sqrt", 8):
        model = CheckpointedSequential(copy.deepcopy(blocks), policy)
        comm.barrier()  # every rank measures the same policy at the same time: fair contention
        peak, seconds, spread, grads = measure(model, x)
        reference = reference or (grads, seconds)  # policy "none" comes first
        same &= all(torch.equal(p, q) for p, q in zip(grads, reference[0], strict=True))
        noisy |= spread > 0.25 or (policy == "block" and seconds < reference[1])
        say(
            f"  {policy!s:>6} {model.k:2d} {peak >> 10:11d} "
            f"{predicted_peak(N_BLOCKS, model.k, a, b) >> 10:9d} {seconds * 1e3:6.1f} "
            f"{spread:8.0%} {seconds / reference[1]:9.2f}"
        )
    verdict = "TOO NOISY here to show recomputing's cost (about 4/3 for 'block')"
    say(f"times: medians of 6 runs, spread (max-min)/median; {verdict if noisy else 'steady'}")
    same = comm.all_reduce(torch.tensor([float(same)]), "min").item() == 1.0  # on every rank
    say(f"gradients bitwise equal to no checkpointing on all {comm.world_size} ranks: {same}")
    comm.barrier()  # dropout draws from the default generator, which thread-ranks share:
    if comm.rank == 0:  # rank 0 alone draws while the others wait
        dropping = [nn.Sequential(Block(g), nn.Dropout(0.5)) for _ in range(4)]
        with torch.random.fork_rng():
            state = torch.get_rng_state()
            *_, plain = measure(nn.Sequential(*copy.deepcopy(dropping)), x)
            torch.set_rng_state(state)  # the same draws: both compare their 4th step's masks
            *_, ckpt = measure(CheckpointedSequential(dropping, "block"), x)
        same = all(torch.equal(p, q) for p, q in zip(plain, ckpt, strict=True))
        say(f"with dropout 0.5, recomputed masks match, gradients bitwise equal: {same}")


if __name__ == "__main__":
    comm = demo_init(__file__)  # plain `python demo.py`: 4 thread-ranks
    main(comm)
