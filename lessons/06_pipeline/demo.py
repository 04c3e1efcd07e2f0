"""Lesson 06: a model cut into pipeline stages, run with each schedule, checked, measured.

python lessons/06_pipeline/demo.py                                  # 4 stages as threads
minidist run -n 4 --backend mpi lessons/06_pipeline/demo.py         # 4 processes
minidist run -n 2 --backend gloo lessons/06_pipeline/demo.py --png /tmp/pipeline
"""

import argparse
from itertools import pairwise

import torch
from torch import nn

from minidist.comm.wrappers import Tracer
from minidist.launch.launcher import demo_init
from minidist.pipeline import schedules as sch
from minidist.pipeline.draw import draw_timeline
from minidist.pipeline.partition import param_counts, partition, stage_chunks
from minidist.pipeline.stage import PipelineStage, measured_timeline, split_microbatches

WIDTHS = [16, 96, 96, 32, 64, 64, 128, 64, 32, 16, 16, 8, 8]  # Linear + tanh between each pair
loss_fn = nn.functional.mse_loss  # a mean over its microbatch; the stage divides it by m


def make_layers() -> list[nn.Module]:
    """The whole model, the same on every rank: one seed, float64 for an exact comparison."""
    g = torch.Generator().manual_seed(0)  # not nn.Linear's own init: it uses the global RNG
    layers = [nn.Linear(a, b, dtype=torch.float64) for a, b in pairwise(WIDTHS)]
    with torch.no_grad():
        for q in (q for layer in layers for q in layer.parameters()):
            q.copy_(torch.randn(q.shape, generator=g, dtype=q.dtype) / q.shape[-1] ** 0.5)
    return [layer for linear in layers for layer in (linear, nn.Tanh())]


def one_step(comm, name: str, m: int, png: str | None) -> None:
    """One training step of schedule `name`; rank 0 prints what it measured and checked."""
    p, v = comm.world_size, 2 if name == "interleaved" else 1
    layers, ref = make_layers(), nn.Sequential(*make_layers())
    plan = partition(param_counts(layers), p, v)  # balanced by parameter count
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8 * m, WIDTHS[0], generator=g, dtype=torch.float64)  # (B, 16), B = 8m
    y = torch.randn(8 * m, WIDTHS[-1], generator=g, dtype=torch.float64)  # (B, 8)
    loss_fn(ref(x), y).backward()  # the single-process reference on the whole batch
    stage = PipelineStage(stage_chunks(layers, plan, comm.rank, p), comm, loss_fn, Tracer())
    programs = sch.build_schedules(name, p, m, v)
    comm.barrier()
    stage.run(programs[comm.rank], split_microbatches(x, m), split_microbatches(y, m))
    rows = measured_timeline(stage)
    pairs = zip(nn.Sequential(*layers).parameters(), ref.parameters(), strict=True)
    diff = max((q.grad - r.grad).abs().max().item() for q, r in pairs if q.grad is not None)
    mine = torch.tensor([diff, stage.memory.peak, max(stage.memory.bytes_of.values())])
    every = comm.all_gather(torch.empty(p, 3, dtype=mine.dtype), mine)  # (p, 3) for rank 0
    if comm.rank != 0:
        return
    peaks = [sch.peak_activations(ops, until_weight=name == "zb") for ops in programs]
    kib = [f"{every[s, 1] / 1024:4.0f} ({peaks[s] * every[s, 2] / 1024:.0f})" for s in range(p)]
    bubbles = f"{sch.bubble_fraction(rows):.3f} / {sch.bubble_formula(name, p, m, v):.3f}"
    print(f"{name:>11} {v}  {bubbles:>24}  {every[:, 0].max():13.1e}  ", *kib)
    if png:
        draw_timeline(rows, f"{png}_{name}.png", f"measured {name}, p={p}, m={m}, v={v}")


if __name__ == "__main__":
    comm = demo_init(__file__)  # plain `python demo.py`: 4 thread-ranks
    parser = argparse.ArgumentParser()
    parser.add_argument("--png", help="also draw each measured timeline to PNG_<schedule>.png")
    args = parser.parse_args()
    p, m = comm.world_size, 2 * comm.world_size  # interleaved needs m a multiple of p
    if comm.rank == 0:
        print(partition(param_counts(make_layers()), p).table(), "\n\n1F1B, simulated:")
        print(sch.text_grid(sch.simulate(sch.build_schedules("1f1b", p, m))), "\n")
        print("   schedule v  bubble: measured / formula  max|grad diff|  peak KiB per stage")
    for name in sch.NAMES:
        one_step(comm, name, m, args.png)
