"""Data-parallel step times: one process, compute alone, naive, bucketed with overlap.

    minidist bench dp -n 2 --backend mpi [--layers 8 --width 512 --batch 32] [--json]
    minidist bench dp -n 2 --backend gloo --layers 2 --width 512 --rounds 200   # bucketed / DDP

Every rank trains the same MLP (float32, one thread per rank) on its own batch of --batch rows,
so the per-rank work is the same in every row of the table:

    one process   rank 0 alone, plain torch, the others wait: the ideal
    compute       every rank at once, plain torch, no communication (the machine is shared)
    comm          all-reducing the gradient buckets alone, no compute
    naive         DataParallelNaive: backward, then one all-reduce per parameter
    bucketed      DataParallelBucketed: buckets all-reduced during backward (library and ring)
    torch DDP     torch.nn.parallel.DistributedDataParallel on the same process group, with the
                  same bucket size (gloo and nccl; '-' elsewhere): the ratio bucketed / DDP

overlap = (compute + comm - bucketed) / comm: the share of communication hidden behind
backward (1: all of it, 0: none). efficiency = one process / bucketed: weak scaling. The
implementations' columns are timed in --rounds interleaved rounds (one step of each per round,
medians), so a shared machine's drift weighs on them alike; beside the ratio, "rounds" gives the
middle half of the per-round ratios (how far one round strays: a difference inside it is the
noise). Their steps are short (6 ms on a 0.5M-parameter model), and on a shared machine 30
rounds gave ratios from 0.85 to 1.26 in three runs of the same code, 200 rounds 0.997 and
1.015: hence 100 by default.
A sweep of bucket sizes shows the trade-off: small buckets start early but pay the latency term
per collective; large ones pay it once but start late. Times are medians over --steps steps after
a barrier, the slowest rank's; measured side by side in one run on a shared machine.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from minidist.bench import (
    Bench,
    interleaved_rounds,
    medians,
    rank_main,
    ratio_spread,
    spread_words,
    time_columns,
    time_it,
    torch_group,
)
from minidist.comm.wrappers import Counter, ObservedComm
from minidist.data_parallel.wrappers import DataParallelBucketed, DataParallelNaive

SWEEP = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def mlp(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)  # plausible weights; the wrappers broadcast rank 0's anyway
    body = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())]
    return nn.Sequential(*body)


def train_step(model, x, finish=lambda: None):
    def step():
        model(x).square().mean().backward()
        finish()
        for q in model.parameters():
            q.grad = None

    return step


def measure(comm, args) -> dict:
    """Every column of the table (seconds), the overlap, the sweep and the bytes, as --json
    prints them."""
    x = torch.randn(args.batch, args.width)  # (B, D): this rank's batch
    plain = mlp(args.layers, args.width)
    flat = torch.cat([q.detach().reshape(-1) for q in plain.parameters()])
    naive = DataParallelNaive(mlp(args.layers, args.width), comm)
    bucketed = {
        algorithm: DataParallelBucketed(mlp(args.layers, args.width), comm, args.bucket, algorithm)
        for algorithm in ("library", "ring")
    }
    steps = {
        "one_process": train_step(plain, x) if comm.rank == 0 else lambda: None,
        "compute": train_step(plain, x),
        "comm": lambda: comm.all_reduce(flat),
        "naive": train_step(naive, x, naive.finish_gradient_sync),
    }
    for algorithm, dp in bucketed.items():
        steps[f"bucketed_{algorithm}"] = train_step(dp, x, dp.finish_gradient_sync)
    ddp = torch_ddp(bucketed["library"].launcher.comm, args)  # the buckets' own group
    rivals = {  # the two implementations of one algorithm: timed in interleaved rounds
        "bucketed_library": steps.pop("bucketed_library"),
        "torch_ddp": None if ddp is None else train_step(ddp, x),
    }
    row = time_columns(comm, steps, args.steps)
    rounds = interleaved_rounds(comm, rivals, args.rounds)
    row.update(medians(rounds))
    row["ddp_ratio"] = row["ddp_spread"] = None
    if ddp is not None:
        row["ddp_ratio"] = row["bucketed_library"] / row["torch_ddp"]
        row["ddp_spread"] = ratio_spread(rounds["bucketed_library"], rounds["torch_ddp"])
    hidden = row["compute"] + row["comm"] - row["bucketed_library"]
    row["overlap"] = max(0.0, min(1.0, hidden / row["comm"]))
    row["efficiency"] = row["one_process"] / row["bucketed_library"]
    row["sweep"] = {}
    for nbytes in SWEEP:
        dp = DataParallelBucketed(mlp(args.layers, args.width), comm, nbytes)
        row["sweep"][nbytes] = time_it(comm, train_step(dp, x, dp.finish_gradient_sync), args.steps)
        row.setdefault("buckets", {})[nbytes] = len(dp.buckets)
    row["bytes_per_step"], row["bytes_formula"] = ring_bytes(comm, args, x)
    return row


def torch_ddp(comm, args) -> nn.Module | None:
    """PyTorch's DistributedDataParallel over comm's own process group (gloo, nccl), with the
    bucket size of the bucketed rung; None on a backend without one (threads, mpi).

    measure() passes the comm the bucketed rung all-reduces its buckets over (its own, split
    off the world: DataParallelBucketed._bucket_comm), so that both all-reduce over one group.
    Over the world's group DDP would gain what is not its code: the barrier before every timed
    step runs there, and on gloo a group that has just been used all-reduces faster than one
    that has not (0.5M parameters, 2 ranks: DDP over the world's group 4.4-4.5 ms a step,
    over a group of its own 5.2-5.3 ms, measured side by side)."""
    group = torch_group(comm)
    if group is None:
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        mlp(args.layers, args.width), process_group=group, bucket_cap_mb=args.bucket / 2**20
    )


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


def report(row: dict, args) -> str:
    lines = [
        f"data parallel, world {args.n} ({args.backend}), MLP {args.layers} x {args.width}, "
        f"batch {args.batch} per rank, bucket {args.bucket >> 10} KiB, float32, 1 thread/rank",
        f"  one process       {_ms(row['one_process'])}",
        f"  compute (all)     {_ms(row['compute'])}",
        f"  comm alone        {_ms(row['comm'])}",
        f"  naive             {_ms(row['naive'])}",
        f"  bucketed library  {_ms(row['bucketed_library'])}",
        f"  bucketed ring     {_ms(row['bucketed_ring'])}",
        f"  torch DDP         {_ms(row['torch_ddp']) if row['torch_ddp'] else '        -'}"
        + (
            f"   bucketed / DDP {row['ddp_ratio']:.2f}{spread_words(row['ddp_spread'])}"
            if row["ddp_ratio"]
            else ""
        ),
        f"  overlap {row['overlap']:.2f}   scaling efficiency {row['efficiency']:.2f}",
        f"  ring bytes sent per step {row['bytes_per_step']:,} "
        f"(formula 2(p-1)/p (N+P) * 4 = {row['bytes_formula']:,.0f})",
        "  bucket sweep (library):",
    ]
    for nbytes, t in row["sweep"].items():
        lines.append(f"    {nbytes >> 10:6d} KiB  {row['buckets'][nbytes]:3d} buckets {_ms(t)}")
    return "\n".join(lines)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="rows per rank")
    p.add_argument("--bucket", type=int, default=1 << 20, help="bucket bytes")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--rounds", type=int, default=100, help="interleaved rounds of bucketed and torch DDP"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.2f} ms"


DP = Bench("dp", "data-parallel step times and overlap", __name__, flags, measure, report)

if __name__ == "__main__":
    rank_main(sys.argv[1:], DP)
