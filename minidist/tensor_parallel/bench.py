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

Then, for each tp > 1, the MLP alone beside PyTorch's own tensor parallelism on the same group
(gloo: a torch.distributed process group; '-' on mpi and threads): ParallelMLP against an
nn.Linear pair with the same full weights under torch.distributed.tensor.parallel
(parallelize_module: fc1 ColwiseParallel, fc2 RowwiseParallel, on DeviceMesh.from_group), x
(B, T, D) replicated and requiring its gradient, so each moves one all-reduce of B*T*D forward
and one backward. Outputs, dL/dx and each rank's slice of every gradient are compared first
(refused above 1e-5 relative), then forward + backward of each per round
(bench.interleaved_rounds): the ratio ours / torch of the medians, and under "rounds" the middle
half of the per-round ratios (bench.ratio_spread: how far one round strays). What differs is
the cost around the same two all-reduces: each library collective of minidist's comms first
agrees with the other ranks on its signature (comm/agreement.py: one more small gloo
all-gather, a synchronisation of its own); DTensor instead pays Python dispatch on every
operation of the layer (sharding propagation, redistribute), mostly in backward.

Tensor parallelism talks inside every layer, twice per direction, in the critical path: on this
CPU machine the ranks share two cores and memory bandwidth, so expect little or no speedup; the
bytes and the memory are exact, the times are noisy (a shared machine).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

from minidist.bench import (
    Bench,
    device_of,
    interleaved_rounds,
    max_over_ranks,
    medians,
    rank_main,
    ratio_spread,
    time_it,
    torch_group,
)
from minidist.comm.wrappers import Counter, ObservedComm
from minidist.tensor_parallel.blocks import (
    ParallelMLP,
    ParallelTransformerBlock,
    activation_elements,
    saved_activation_nbytes,
)
from minidist.transformer import master_linear

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


class MLP(nn.Module):
    """fc2(gelu(fc1(x))) with ParallelMLP's full weights (master_linear, seeds 0 and 1): what
    torch's tensor parallelism splits."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        for seed, layer in enumerate((self.fc1, self.fc2)):
            w, b = master_linear(layer.in_features, layer.out_features, seed)
            with torch.no_grad():
                layer.weight.copy_(w)
                layer.bias.copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (B, T, d_ff/p) in between, split


def torch_mlp(tp_comm, d_model: int, d_ff: int) -> nn.Module | None:
    """MLP under torch.distributed.tensor.parallel on tp_comm's process group: fc1
    ColwiseParallel, fc2 RowwiseParallel on a DeviceMesh of the group (x replicated in, y
    replicated out: one all-reduce forward, one backward, as ParallelMLP); None on a backend
    without a torch process group (threads, mpi)."""
    group = torch_group(tp_comm)
    if group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = DeviceMesh.from_group(group, device_of(tp_comm).type)
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    return parallelize_module(MLP(d_model, d_ff), mesh, plan)


def beside_torch(tp_comm, args) -> dict:
    """ParallelMLP and torch's tensor-parallel MLP on tp_comm, the same weights and batch:
    outputs and gradients compared, then forward + backward of each per round
    (interleaved_rounds: the ratio of the medians, and ratio_spread). The torch column and
    the ratio None where there is no torch group."""
    d_ff = 4 * args.d_model
    ours = ParallelMLP(args.d_model, d_ff, tp_comm)
    theirs = torch_mlp(tp_comm, args.d_model, d_ff)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.d_model, generator=gen)  # (B, T, D), every rank
    x_ours = x.clone().requires_grad_()  # dL/dx: f's all-reduce in backward, as in the block
    x_theirs = x.clone().requires_grad_()
    difference = None
    if theirs is not None:
        difference = max_over_ranks(tp_comm, _difference(ours, theirs, x_ours, x_theirs))
        if difference > 1e-5:
            raise RuntimeError(f"ParallelMLP and torch's differ by {difference:.2e} (relative)")
    steps = {
        "ours": _step(ours, x_ours),
        "torch": None if theirs is None else _step(theirs, x_theirs),
    }
    rounds = interleaved_rounds(tp_comm, steps, args.steps)
    seconds = medians(rounds)
    torch_ms = None if theirs is None else seconds["torch"] * 1e3
    return {
        "tp": tp_comm.world_size,
        "ours_ms": seconds["ours"] * 1e3,
        "torch_ms": torch_ms,
        "ratio": None if theirs is None else seconds["ours"] / seconds["torch"],
        "spread": None if theirs is None else ratio_spread(rounds["ours"], rounds["torch"]),
        "difference": difference,
    }


def _step(mlp: nn.Module, x: torch.Tensor):
    def step():
        mlp(x).sum().backward()
        x.grad = None
        for q in mlp.parameters():
            q.grad = None

    return step


def _difference(ours, theirs, x_ours, x_theirs) -> float:
    """The largest relative difference of the outputs, dL/dx and this rank's slice of every
    weight and bias gradient (torch's: its DTensors' local shards), after one backward."""
    pairs = [(ours(x_ours), theirs(x_theirs))]
    pairs[0][0].sum().backward()
    pairs[0][1].sum().backward()
    pairs.append((x_ours.grad, x_theirs.grad))
    for name, q in theirs.named_parameters():
        pairs.append((ours.get_parameter(name).grad, q.grad.to_local()))
    x_ours.grad = x_theirs.grad = None
    for q in [*ours.parameters(), *theirs.parameters()]:
        q.grad = None
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in pairs)


def run(comm, args) -> dict:
    """Every tp size that fits the world and divides heads and T: the rows in order, as --json
    prints them (rank 0's has them all: it is in every group)."""
    rows = []
    mlps = []
    sizes = [k for k in (1, 2, 4, 8, 16) if k <= comm.world_size]
    sizes = [k for k in sizes if args.heads % k == 0 and args.seq % k == 0]
    for k in sizes:
        sub = comm.split(int(comm.rank < k))  # collective: every rank calls it
        for sp in (False, True) if k > 1 else (False,):
            if comm.rank < k:
                rows.append(measure(sub, args, sp))
            comm.barrier()  # the others wait: a shared machine times best quiet
        if k > 1:
            if comm.rank < k:
                mlps.append(beside_torch(sub, args))
            comm.barrier()
    return {"bench": "tp", "backend": comm.backend, "rows": rows, "mlp": mlps}


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
    if result["mlp"]:
        lines += [
            "MLP alone (fc1 column-, fc2 row-parallel), forward + backward in interleaved rounds, "
            "beside torch.distributed.tensor.parallel",
            f"{'tp':>3} {'ours ms':>9} {'torch ms':>9} {'ours/torch':>10} {'rounds':>9} "
            f"{'max diff':>9}",
        ]
    for row in result["mlp"]:
        if row["torch_ms"] is None:
            torch_cells = f"{'-':>9} {'-':>10} {'-':>9} {'-':>9}"
        else:
            low, high = row["spread"]
            torch_cells = (
                f"{row['torch_ms']:9.2f} {row['ratio']:10.2f} {f'{low:.2f}-{high:.2f}':>9} "
                f"{row['difference']:9.1e}"
            )
        lines.append(f"{row['tp']:>3} {row['ours_ms']:9.2f} {torch_cells}")
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
