"""Tensor-parallel block: step time, bytes and activation memory at tp = 1, 2, 4, ... side by side
with the formulas of minidist/tensor_parallel/blocks.py.

    minidist bench tp -n 4 --backend mpi [--batch 4 --seq 128 --d-model 256 --heads 8] [--json]

One launch of n ranks; for each tp in 1, 2, 4, ... up to n, the first tp ranks form a group
(comm.split) and run a ParallelTransformerBlock (float32, causal, one thread per rank) forward
and backward on the same (B, T, D) batch, with and without sequence parallelism; the other ranks
wait. Per row:

    step ms      median forward + backward, each step started together; the slowest rank's
    speedup      step ms at tp = 1 / this row's, measured in the same run
    fwd / bwd    payload bytes of the collectives on tp_comm (ObservedComm) per step, beside
                 the formula: 2 all-reduces of B*T*D elements per direction per block; with
                 sequence parallelism 2 all-gathers (B*T*D/p) + 2 reduce-scatters (B*T*D)
                 forward, 4 all-gathers + 2 reduce-scatters + 6 all-reduces of D backward
    ring/rank    bytes each rank would send per step with ring algorithms: all-reduce
                 2(p-1)/p * n, all-gather (p-1) * shard, reduce-scatter (p-1)/p * n
    act          bytes saved for backward (saved_activation_nbytes), beside the formula
                 (activation_elements * 4), and as a fraction of tp = 1

Tensor parallelism talks inside every layer, twice per direction, in the critical path: on this
CPU machine the ranks share two cores and memory bandwidth, so expect little or no speedup; the
bytes and the memory are exact, the times are noisy (a shared machine).
"""

from __future__ import annotations

import argparse
import sys

import torch

from minidist.bench import Bench, rank_main, time_it
from minidist.comm.wrappers import Counter, ObservedComm
from minidist.tensor_parallel.blocks import (
    ParallelTransformerBlock,
    activation_elements,
    saved_activation_nbytes,
)

WIRE = {
    "all_reduce": lambda n, p: 2 * (p - 1) / p * n,
    "all_gather": lambda n, p: (p - 1) * n,
    "reduce_scatter": lambda n, p: (p - 1) / p * n,
}


def formula_nbytes(args, p: int, sp: bool) -> tuple[int, int]:
    """Payload bytes per step (forward, backward) from the docstring formulas (float32)."""
    btd = args.batch * args.seq * args.d_model * 4
    if not sp:
        return 2 * btd, 2 * btd
    return 2 * btd // p + 2 * btd, 4 * btd // p + 2 * btd + 6 * args.d_model * 4


def measure(tp_comm, args, sp: bool) -> dict:
    """One row: time, bytes and activation memory of one block on this tp group."""
    p, r = tp_comm.world_size, tp_comm.rank
    counter = Counter()
    c = ObservedComm(tp_comm, counter)
    block = ParallelTransformerBlock(
        args.d_model, args.heads, 4 * args.d_model, c, sequence_parallel=sp
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.d_model, generator=gen)  # (B, T, D), every rank
    n = args.seq // p
    x_in = (x[:, r * n : (r + 1) * n] if sp else x).clone().requires_grad_()  # SP: (B, T/p, D)
    act, y = saved_activation_nbytes(block, lambda: block(x_in))
    counter.reset()
    y.sum().backward()
    backward = dict(counter.nbytes)
    counter.reset()
    block(x_in)
    forward = dict(counter.nbytes)

    def step():
        block(x_in).sum().backward()
        for q in block.parameters():
            q.grad = None

    d_ff = 4 * args.d_model
    ring = sum(WIRE[op](nb, p) for counts in (forward, backward) for op, nb in counts.items())
    return {
        "tp": p,
        "sp": sp,
        "step_ms": time_it(tp_comm, step, args.steps) * 1e3,
        "fwd_bytes": sum(forward.values()),
        "bwd_bytes": sum(backward.values()),
        "formula_bytes": formula_nbytes(args, p, sp),
        "ring_bytes_per_rank": ring,
        "act_bytes": act,
        "act_formula": 4
        * activation_elements(args.batch, args.seq, args.d_model, args.heads, d_ff, p, sp),
    }


def run(comm, args) -> dict:
    """Every tp size that fits the world and divides heads and T: the rows in order, as --json
    prints them (rank 0's has them all: it is in every group)."""
    rows = []
    sizes = [k for k in (1, 2, 4, 8, 16) if k <= comm.world_size]
    sizes = [k for k in sizes if args.heads % k == 0 and args.seq % k == 0]
    for k in sizes:
        sub = comm.split(int(comm.rank < k))  # collective: every rank calls it
        for sp in (False, True) if k > 1 else (False,):
            if comm.rank < k:
                rows.append(measure(sub, args, sp))
            comm.barrier()  # the others wait: a shared machine times best quiet
    return {"bench": "tp", "backend": comm.backend, "rows": rows}


def report(result: dict, args) -> str:
    rows = result["rows"]
    base = rows[0]
    lines = [
        f"tensor-parallel block, {result['backend']}, B={args.batch} T={args.seq} D={args.d_model} "
        f"H={args.heads} d_ff={4 * args.d_model}, float32, 1 thread/rank (MiB per step)",
        f"{'tp':>3} {'sp':>3} {'step ms':>9} {'speedup':>8} {'fwd':>8} {'formula':>8} "
        f"{'bwd':>8} {'formula':>8} {'ring/rank':>9} {'act':>8} {'formula':>8} {'act/tp1':>8}",
    ]
    for row in rows:
        lines.append(
            f"{row['tp']:>3} {'yes' if row['sp'] else 'no':>3} {row['step_ms']:9.2f} "
            f"{base['step_ms'] / row['step_ms']:8.2f} {_mib(row['fwd_bytes'])} "
            f"{_mib(row['formula_bytes'][0])} {_mib(row['bwd_bytes'])} "
            f"{_mib(row['formula_bytes'][1])} {_mib(row['ring_bytes_per_rank']):>9} "
            f"{_mib(row['act_bytes'])} {_mib(row['act_formula'])} "
            f"{row['act_bytes'] / base['act_bytes']:8.3f}"
        )
    lines.append("times: one run on a shared machine (noisy); bytes and memory: exact")
    return "\n".join(lines)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)


def problems(args: argparse.Namespace) -> list[str]:
    """Why these flags cannot run, one line each (the CLI prints them before starting ranks;
    every number is already in its range)."""
    if args.d_model % args.heads:  # rows whose tp divides neither heads nor T are left out
        return [f"--d-model {args.d_model} is not divisible by --heads {args.heads}"]
    return []


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:8.2f}"


TP = Bench(
    "tp",
    "tensor-parallel block: time, bytes, activation memory",
    __name__,
    flags,
    run,
    report,
    problems,
    ranks=4,
    ranks_help="ranks (tp = 1, 2, 4, ... up to n)",
)

if __name__ == "__main__":
    rank_main(sys.argv[1:], TP)
