"""Benchmark of ZeRO stages 0..3: bytes held and sent per rank, and step time, beside the formulas.

    minidist bench zero -n 2 4 --backend mpi [--layers 8] [--width 1024] [--precision fp32 bf16]

The model: `layers` Linear(width, width) without bias, ReLU between, float32, Adam (k = 2
states per element), each rank a batch of its own. Stage 0 is data parallelism
(data_parallel.DataParallelBucketed with a plain torch Adam on every rank: the baseline this
benchmark composes with ZeRO on purpose); stages 1..3 are zero.wrap, and again with
precision=amp.BF16 (rows "bf16": a bfloat16 model, float32 master shards, Adam state and
gradient shards; reduce-scatter in float32, all-gathers in bfloat16). For each world size in
-n, one launch runs every row in turn, and per row reports:

- MB held per rank, counted: parameters, gradients, optimizer state, the largest seen between
  the phases of a step (after forward, backward, gradient sync, optimizer step), next to
  zero_cost.model_state_nbytes (the paper's formula with K = k b bytes of optimizer state; bf16:
  with m = 4 bytes of master, its K = (1 + k) m, the float32 master counted as the paper does);
  the gradients counted right after backward and after the gradient sync, before the step;
- peak RSS growth: the process's resident memory high-water mark during the timed steps minus
  its size before the model was built (Linux /proc; reset before the steps). It holds the model
  state and everything else: activations, collective buffers, allocator slack. Only meaningful
  with one rank per process (mpi, gloo); the ranks run with MALLOC_MMAP_THRESHOLD_ fixed so
  large tensors go back to the system when freed;
- MB sent per step by this rank, counted by an ObservedComm around the ring collectives (every
  byte is a send), next to zero_cost.sent_nbytes plus the used-flags (one float32 per parameter;
  bf16 rows: and one float32 all-reduce of the overflow flag, a library call, not counted);
- step time: the median over --steps timed steps, the slowest rank's.

Then, on gloo (a torch.distributed process group; '-' on mpi and threads), ZeRO-3 beside
PyTorch's FSDP2, the same algorithm on the same group: the same model (one seed on every rank)
and batch, float32, Adam; ZeRO-3 over the library collectives (gloo's, which FSDP2 calls too),
FSDP2 as fully_shard on every Linear and then the root on DeviceMesh.from_group (ZeRO-3's
units), resharded after forward, each layer prefetching the next in forward and the previous
in backward (ZeRO-3's prefetch). Their gradients after one backward are compared first
(refused above 1e-5 relative; equal to the bit at p = 2), then one step of each per round
(bench.interleaved_rounds): the ratio ZeRO-3 / FSDP2 of the medians, with the middle half of the
per-round ratios (bench.ratio_spread). What differs is when the bytes move. On
the CPU FSDP2 issues every all-gather and reduce-scatter blocking (async_op=False: on GPUs its
overlap comes from CUDA streams, which the CPU lacks), so its prefetch starts the next gather
early and then waits for it, and no communication hides behind compute; ZeRO-3's run on
gloo's thread while a layer computes. ZeRO-3 pays instead one agreement (a small all-gather,
comm/agreement.py) before each collective, about 25 a step here, which FSDP2 does not.

The machine is shared and noisy: compare ratios taken within one run, not across runs.
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import sys

import torch
from torch import nn

from minidist.bench import (
    Bench,
    device_of,
    interleaved_rounds,
    max_over_ranks,
    medians,
    rank_main,
    ratio_spread,
    spread_words,
    time_it,
    torch_group,
)
from minidist.comm.wrappers import Counter, ObservedComm
from minidist.data_parallel.wrappers import DataParallelBucketed
from minidist.mixed_precision.amp import PRECISIONS
from minidist.zero import cost as zero_cost
from minidist.zero import stages as zero

STAGES = (0, 1, 2, 3)
MB = 1e6


def make_model(layers: int, width: int) -> nn.Sequential:
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width, bias=False), nn.ReLU()]
    return nn.Sequential(*blocks)


def _rss_kb(field: str) -> int | None:
    """VmRSS or VmHWM of this process in kB, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _dp_memory(model: nn.Module, optimizer) -> dict[str, int]:
    """Stage 0's model state: everything whole on every rank."""
    state = [v for s in optimizer.state.values() for v in s.values()]
    return {
        "params": _nbytes(model.parameters()),
        "grads": _nbytes(q.grad for q in model.parameters()),
        "optimizer": _nbytes(v for v in state if torch.is_tensor(v) and v.dim() > 0),
    }


def _build(comm, stage: int, precision: str, cfg: argparse.Namespace):
    """The model for this row: (call(x), sync(), update(), memory())."""
    model = make_model(cfg.layers, cfg.width)
    if stage == 0:
        dp = DataParallelBucketed(model, comm, 1 << 20, cfg.algorithm)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def update():
            opt.step()
            opt.zero_grad()

        return dp, dp.finish_gradient_sync, update, lambda: _dp_memory(model, opt)
    mixed = {} if precision == "fp32" else {"precision": PRECISIONS[precision]}
    z = zero.wrap(
        model, comm, torch.optim.Adam, stage, {"lr": 1e-4}, algorithm=cfg.algorithm, **mixed
    )

    def update():
        z.step()
        z.zero_grad()

    return z, z.finish_gradient_sync, update, lambda: zero_cost.memory_nbytes(z)


def bench_stage(comm, stage: int, precision: str, cfg: argparse.Namespace) -> dict:
    """One row: counted and measured bytes, bytes sent and the step time, on this rank."""
    counter = Counter()
    gc.collect()  # the last stage's wrapper: its hooks hold it in reference cycles
    before = _rss_kb("VmRSS")
    net, sync, update, memory = _build(ObservedComm(comm, counter), stage, precision, cfg)
    x = torch.randn(cfg.batch, cfg.width, generator=torch.Generator().manual_seed(comm.rank))
    x = x.to(PRECISIONS[precision].compute)  # (B, width)
    held: dict[str, int] = {}

    def one_step():  # x: (B, width), this rank's own batch
        loss = net(x).square().mean()
        for phase in (loss.backward, sync, update):
            sample(held, memory())  # after forward, backward, the gradient sync
            phase()

    one_step()  # warm-up: from here on the optimizer state exists
    comm.barrier()
    gc.collect()
    _reset_peak()
    counter.reset()
    seconds = time_it(comm, one_step, cfg.steps, warmup=0)
    peak = _rss_kb("VmHWM")
    return {
        "stage": stage,
        "precision": precision,
        "held": {k: held[k] for k in ("params", "grads", "optimizer")},
        "peak_rss": None if peak is None or before is None else (peak - before) * 1024,
        "sent": counter.bytes_sent / cfg.steps,
        "step_ms": seconds * 1e3,
    }


def sample(held: dict, now: dict) -> None:
    for kind, n in now.items():
        held[kind] = max(held.get(kind, 0), n)


def formulas(stage: int, numel: int, n_params: int, p: int, precision: str = "fp32") -> dict:
    """What the module docstrings say this row should show (float32: b = 4, Adam: k = 2;
    bf16: b = 2 for the model and the all-gathers, m = 4 for masters and the reduce-scatter)."""
    flags = 2 * (p - 1) / p * n_params * 4 if p > 1 else 0  # ring all-reduce of the used-flags
    b, m = (4, 0) if precision == "fp32" else (2, 4)
    return {
        "held": zero_cost.model_state_nbytes(stage, numel, p, b, 2, m),
        "sent": zero_cost.sent_nbytes(stage, numel, p, b, m) + flags,
    }


def report(results: list[dict], args: argparse.Namespace) -> str:
    """A table per world size."""
    return "\n\n".join(format_table(r) for r in results)


def format_table(result: dict) -> str:
    p = result["world_size"]
    numel = result["numel"]
    cfg = result["config"]
    lines = [
        f"# minidist bench zero: {result['backend']}, {p} ranks, float32, {cfg['layers']} x "
        f"Linear({cfg['width']}, {cfg['width']}): Psi = {numel / 1e6:.2f}M, Adam (k = 2)",
        "# MB per rank, measured (formula); peak = RSS high-water growth in the timed steps;",
        "# bf16: bfloat16 model, float32 masters (counted in optimizer) and gradient shards",
        f"{'stage':>10}{'params':>16}{'grads':>16}{'optimizer':>16}{'total':>16}{'peak':>8}"
        f"{'sent/step':>16}{'step ms':>9}{'total/0':>8}{'sent/0':>7}{'time/0':>7}",
    ]
    base = result["rows"][0]
    for row in result["rows"]:
        want = formulas(row["stage"], numel, cfg["layers"], p, row["precision"])
        cells = [(row["held"][k], want["held"][k]) for k in ("params", "grads", "optimizer")]
        cells.append((sum(row["held"].values()), sum(want["held"].values())))
        text = "".join(f"{a / MB:7.1f} ({b / MB:6.1f})" for a, b in cells)
        peak = "n/a" if row["peak_rss"] is None else f"{row['peak_rss'] / MB:.1f}"
        ratio = sum(row["held"].values()) / sum(base["held"].values())
        sent = row["sent"] / base["sent"] if base["sent"] else float("nan")
        lines.append(
            f"{row['stage']:>5}{row['precision']:>5}{text}{peak:>8}"
            f"{row['sent'] / MB:7.1f} ({want['sent'] / MB:6.1f})"
            f"{row['step_ms']:9.1f}{ratio:8.2f}{sent:7.2f}{row['step_ms'] / base['step_ms']:7.2f}"
        )
    paper = [sum(zero_cost.model_state_nbytes(s, numel, p, 2, 6).values()) / MB for s in STAGES]
    lines.append(
        "# the paper's mixed precision (2 + 2 + 12 bytes per element), MB per rank, stages "
        "0..3: " + " / ".join(f"{m:.1f}" for m in paper)
    )
    lines.append(fsdp2_line(result.get("fsdp2"), result["backend"]))
    lines.append("# a shared, noisy machine: compare ratios within one run, not across runs")
    return "\n".join(lines)


def fsdp2_line(row: dict | None, backend: str) -> str:
    """The FSDP2 comparison, one line: both step times and their ratio, or why there is none."""
    if row is None:
        return f"# FSDP2: - ({backend} has no torch.distributed process group)"
    return (
        f"# step ms, interleaved rounds: ZeRO-3 (library) {row['zero3_ms']:.1f}, FSDP2 "
        f"fully_shard {row['fsdp2_ms']:.1f}: ZeRO-3 / FSDP2 {row['ratio']:.2f}"
        f"{spread_words(row['spread'])} (gradients "
        f"differ by {row['grad_difference']:.1e}, relative)"
    )


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="rows per rank")
    p.add_argument("--steps", type=int, default=5, help="timed steps per stage")
    p.add_argument(
        "--precision",
        nargs="+",
        choices=("fp32", "bf16"),
        default=["fp32", "bf16"],
        help="rows of stages 1..3 (stage 0, float32, always runs)",
    )
    p.add_argument(
        "--algorithm",
        choices=("ring", "library"),
        default="ring",
        help="ring: every byte sent is counted; library: sent shows 0",
    )


def measure(comm, cfg: argparse.Namespace) -> dict:
    """Every row (stage, precision) in turn on this world: its result, as --json lists it."""
    warm = torch.zeros(1, requires_grad=True)
    warm.grad = torch.ones(1)
    torch.optim.Adam([warm]).step()  # torch imports more on a first step: not stage 0's bytes
    # stage 0 in float32 always: the baseline of the ratios
    plan = [(0, "fp32")] + [(s, name) for name in cfg.precision for s in STAGES[1:]]
    rows = [bench_stage(comm, stage, precision, cfg) for stage, precision in plan]
    if comm.backend == "threads":  # one process holds every rank: no per-rank peak
        for row in rows:
            row["peak_rss"] = None
    keys = ("layers", "width", "batch", "steps", "algorithm", "precision")
    result = {"backend": comm.backend, "world_size": comm.world_size, "rows": rows}
    result["fsdp2"] = beside_fsdp2(comm, cfg)  # after the rows: their peaks are their own
    return result | {"numel": cfg.layers * cfg.width**2, "config": {k: vars(cfg)[k] for k in keys}}


def fsdp2(model: nn.Sequential, group, device_type: str) -> nn.Sequential:
    """model under FSDP2 on group: fully_shard on every Linear, then on the root (ZeRO-3's
    units), resharded after forward (ZeRO-3), each layer prefetching the next one's all-gather
    in forward and the previous one's in backward (ZeRO-3's prefetch). Every rank must hold
    the same values already: fully_shard keeps each rank's own."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device_type)
    layers = [m for m in model if isinstance(m, nn.Linear)]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for before, after in itertools.pairwise(layers):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])
    return model


def beside_fsdp2(comm, cfg: argparse.Namespace) -> dict | None:
    """ZeRO-3 (library collectives) and FSDP2 on comm's process group, float32, Adam, the same
    model and batch: their gradients after one backward compared, then one step of each per
    round (interleaved_rounds: the ratio of the medians, and ratio_spread); None on a backend
    without a torch process group."""
    group = torch_group(comm)
    if group is None:
        return None
    torch.manual_seed(0)  # the same model on every rank: nothing to broadcast
    model = make_model(cfg.layers, cfg.width)
    ours = zero.wrap(
        copy.deepcopy(model), comm, torch.optim.Adam, 3, {"lr": 1e-4}, algorithm="library"
    )
    theirs = fsdp2(copy.deepcopy(model), group, device_of(comm).type)
    optimizer = torch.optim.Adam(theirs.parameters(), lr=1e-4)
    x = torch.randn(cfg.batch, cfg.width, generator=torch.Generator().manual_seed(comm.rank))
    ours(x).square().mean().backward()  # x: (B, width), this rank's batch
    ours.finish_gradient_sync()
    theirs(x).square().mean().backward()
    difference = max_over_ranks(comm, _gradient_difference(ours, theirs))
    if difference > 1e-5:
        raise RuntimeError(f"ZeRO-3's and FSDP2's gradients differ by {difference:.2e} (relative)")
    ours.zero_grad()
    optimizer.zero_grad()

    def ours_step():
        ours(x).square().mean().backward()
        ours.step()
        ours.zero_grad()

    def theirs_step():
        theirs(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    rounds = interleaved_rounds(comm, {"zero3": ours_step, "fsdp2": theirs_step}, cfg.steps)
    seconds = medians(rounds)
    return {
        "zero3_ms": seconds["zero3"] * 1e3,
        "fsdp2_ms": seconds["fsdp2"] * 1e3,
        "ratio": seconds["zero3"] / seconds["fsdp2"],
        "spread": ratio_spread(rounds["zero3"], rounds["fsdp2"]),
        "grad_difference": difference,
    }


def _gradient_difference(ours, theirs) -> float:
    """The largest |ZeRO-3's - FSDP2's| over this rank's gradient pieces, relative to the
    parameter's largest |gradient|. FSDP2's gradients are all-gathered whole (every rank, the
    same order)."""
    full = {n: q.grad.full_tensor().reshape(-1) for n, q in theirs.named_parameters()}
    worst = 0.0
    for name, lo, hi, t in ours.shard_pieces():
        scale = full[name].abs().max().clamp_min(torch.finfo(t.dtype).tiny)
        worst = max(worst, ((t.grad - full[name][lo:hi]).abs().max() / scale).item())
    return worst


def _nbytes(tensors) -> int:
    """Bytes of the tensors (None: none)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# the ranks' processes: large tensors straight from mmap, and back on free: RSS follows what is live
ENV = (("MALLOC_MMAP_THRESHOLD_", str(1 << 17)), ("OMP_NUM_THREADS", "1"))
ZERO = Bench(
    "zero",
    "ZeRO stages 0..3: bytes held and sent, step time",
    __name__,
    flags,
    measure,
    report,
    ranks=(2, 4),
    ranks_help="world sizes (one launch each)",
    env=ENV,
)

if __name__ == "__main__":
    rank_main(sys.argv[1:], ZERO)
