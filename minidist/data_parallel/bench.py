"""Data-parallel step times: one process, compute alone, naive, bucketed with overlap.

    minidist bench dp -n 2 --backend mpi [--layers 8 --width 512 --batch 32] [--json]

Every rank trains the same MLP (float32, one thread per rank) on its own batch of --batch rows,
so the per-rank work is the same in every row of the table:

    one process   rank 0 alone, plain torch, the others wait: the ideal
    compute       every rank at once, plain torch, no communication (the machine is shared)
    comm          all-reducing the gradient buckets alone, no compute
    naive         DataParallelNaive: backward, then one all-reduce per parameter
    bucketed      DataParallelBucketed: buckets all-reduced during backward (library and ring)

overlap = (compute + comm - bucketed) / comm: the share of communication hidden behind
backward (1: all of it, 0: none). efficiency = one process / bucketed: weak scaling. A sweep
of bucket sizes shows the trade-off: small buckets start early but pay the latency term per
collective; large ones pay it once but start late. Times are medians over --steps steps after
a barrier, the slowest rank's; measured side by side in one run on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch import nn

from minidist.comm.wrappers import Counter, ObservedComm
from minidist.data_parallel.wrappers import DataParallelBucketed, DataParallelNaive
from minidist.launch.launcher import init, start_ranks

SWEEP = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def mlp(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)  # plausible weights; the wrappers broadcast rank 0's anyway
    body = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())]
    return nn.Sequential(*body)


def timed(comm, step, steps: int) -> float:
    """Median seconds of step() after a warm-up, each started together; the slowest rank's."""
    step()
    times = []
    for _ in range(steps):
        comm.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64)
    return comm.all_reduce(worst, "max").item()


def train_step(model, x, finish=lambda: None):
    def step():
        model(x).square().mean().backward()
        finish()
        for q in model.parameters():
            q.grad = None

    return step


def measure(comm, args) -> dict:
    x = torch.randn(args.batch, args.width)  # (B, D): this rank's batch
    plain = mlp(args.layers, args.width)
    row = {}
    alone = train_step(plain, x)
    row["one_process"] = timed(comm, alone if comm.rank == 0 else lambda: None, args.steps)
    row["compute"] = timed(comm, train_step(plain, x), args.steps)
    flat = torch.cat([q.detach().reshape(-1) for q in plain.parameters()])
    row["comm"] = timed(comm, lambda: comm.all_reduce(flat), args.steps)
    naive = DataParallelNaive(mlp(args.layers, args.width), comm)
    row["naive"] = timed(comm, train_step(naive, x, naive.finish_gradient_sync), args.steps)
    for algorithm in ("library", "ring"):
        dp = DataParallelBucketed(mlp(args.layers, args.width), comm, args.bucket, algorithm)
        row[f"bucketed_{algorithm}"] = timed(
            comm, train_step(dp, x, dp.finish_gradient_sync), args.steps
        )
    hidden = row["compute"] + row["comm"] - row["bucketed_library"]
    row["overlap"] = max(0.0, min(1.0, hidden / row["comm"]))
    row["efficiency"] = row["one_process"] / row["bucketed_library"]
    row["sweep"] = {}
    for nbytes in SWEEP:
        dp = DataParallelBucketed(mlp(args.layers, args.width), comm, nbytes)
        row["sweep"][nbytes] = timed(comm, train_step(dp, x, dp.finish_gradient_sync), args.steps)
        row.setdefault("buckets", {})[nbytes] = len(dp.buckets)
    row["bytes_per_step"], row["bytes_formula"] = ring_bytes(comm, args, x)
    return row


def ring_bytes(comm, args, x) -> tuple[int, float]:
    """Bytes this rank sends in one bucketed ring step, and 2(p-1)/p (N + P) * 4."""
    counter = Counter()
    dp = DataParallelBucketed(
        mlp(args.layers, args.width), ObservedComm(comm, counter), args.bucket, "ring"
    )
    counter.reset()
    train_step(dp, x, dp.finish_gradient_sync)()
    n = sum(q.numel() for q in dp.module.parameters())
    n_params = len(list(dp.module.parameters()))
    p = comm.world_size
    return counter.bytes_sent, 2 * (p - 1) / p * (n + n_params) * 4


def report(row: dict, args, p: int) -> str:
    lines = [
        f"data parallel, world {p} ({args.backend}), MLP {args.layers} x {args.width}, "
        f"batch {args.batch} per rank, bucket {args.bucket >> 10} KiB, float32, 1 thread/rank",
        f"  one process       {_ms(row['one_process'])}",
        f"  compute (all)     {_ms(row['compute'])}",
        f"  comm alone        {_ms(row['comm'])}",
        f"  naive             {_ms(row['naive'])}",
        f"  bucketed library  {_ms(row['bucketed_library'])}",
        f"  bucketed ring     {_ms(row['bucketed_ring'])}",
        f"  overlap {row['overlap']:.2f}   scaling efficiency {row['efficiency']:.2f}",
        f"  ring bytes sent per step {row['bytes_per_step']:,} "
        f"(formula 2(p-1)/p (N+P) * 4 = {row['bytes_formula']:,.0f})",
        "  bucket sweep (library):",
    ]
    for nbytes, t in row["sweep"].items():
        lines.append(f"    {nbytes >> 10:6d} KiB  {row['buckets'][nbytes]:3d} buckets {_ms(t)}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", type=int, default=2, help="ranks")
    p.add_argument("--backend", choices=("mpi", "gloo", "threads"), default="mpi")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="rows per rank")
    p.add_argument("--bucket", type=int, default=1 << 20, help="bucket bytes")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", action="store_true")


def add_parser(sub) -> None:
    p = sub.add_parser("dp", help="data-parallel step times and overlap")
    add_arguments(p)
    p.set_defaults(func=main)


def problems(args: argparse.Namespace) -> list[str]:
    """Why these flags cannot run (the CLI asks every benchmark before starting ranks): every
    size works once it is in its range, which the CLI checks for all flags."""
    return []


def main(args: argparse.Namespace) -> int:
    argv = [f"--{k}={v}" for k, v in vars(args).items() if k in _FORWARDED]
    argv += ["--json"] if args.json else []
    return start_ranks(__name__, argv, args.n, args.backend, "minidist bench dp")


_FORWARDED = ("backend", "layers", "width", "batch", "bucket", "steps")


def rank_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one core per rank: the ranks share the machine
    comm = init()
    row = measure(comm, args)
    if comm.rank == 0:
        print(json.dumps(row) if args.json else report(row, args, comm.world_size))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.2f} ms"


if __name__ == "__main__":
    rank_main(sys.argv[1:])
