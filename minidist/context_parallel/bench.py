"""Context parallelism measured: ring attention's time, bytes and memory against the sequence
length and cp, beside the formulas of minidist/context_parallel/ring_attention.py and full
attention.

    minidist bench cp -n 4 --backend mpi [--seq 256 512 1024] [--batch 1 --heads 4
                      --head-dim 32] [--steps 3] [--json]

For each T in --seq: a `full` row, causal attention in one process (rank 0 alone; the (T, T)
scores materialized, softmax, autograd: the program ring attention equals), then for each cp
in 1, 2, 4, ... up to n (T divisible by 2 cp) and each layout (plain, zigzag), ring_attention
on the first cp ranks (comm.split; the others wait). float32 (b = 4), one thread per rank;
n = B H (T/cp) d. Per row, the busiest rank's measurement beside the formula (`exact`: every
rank's bytes and memory equal their formulas):

    step ms      median forward + backward, each step started together, the slowest rank's
    fwd, bwd     bytes sent to the next rank (ObservedComm): 2 (cp-1) n b, 2 (2cp-1) n b
    saved        bytes autograd keeps for backward (SavedTensorMeter): (4d + 1) B H T/cp b,
                 falling as 1/cp; full: the (T, T) probabilities too
    k|v, scores  peak bytes in flight in forward (LiveTensorMeter; the comm's own buffers left
                 out): k|v blocks 4n b (2n b at cp = 1), score-sized tensors 3 B H (T/c)^2 b
                 (context_parallel.inflight_nbytes); full: its (B, H, T, T) tensors
    work         the busiest rank's query-key pairs over the mean (counted as computed), beside
                 the docstring's formula: plain about 2 - 1/cp, zigzag 1

Times are noisy on a shared machine (compare within one run); bytes and memory are exact.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from minidist.bench import Bench, gather_over_ranks, max_over_ranks, rank_main, time_it
from minidist.comm.wrappers import Counter, ObservedComm
from minidist.context_parallel import ring_attention as context_parallel
from minidist.memory import LiveTensorMeter, SavedTensorMeter


class Unmetered:
    """comm, with what its sends and receives allocate (a backend's copies and frames) kept out
    of the meter: they are the transport's, not the algorithm's."""

    def __init__(self, comm, meter: LiveTensorMeter):
        self.comm, self.meter = comm, meter

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def isend(self, t, dst, tag=0):
        with self.meter.paused():
            return _Work(self.comm.isend(t, dst, tag), self.meter)

    def irecv(self, t, src, tag=0):
        with self.meter.paused():
            return _Work(self.comm.irecv(t, src, tag), self.meter)


class _Work:
    def __init__(self, work, meter: LiveTensorMeter):
        self.work, self.meter = work, meter

    def wait(self):
        with self.meter.paused():
            return self.work.wait()


def qkv(args, t: int, rank: int, cp: int, layout: str) -> list[torch.Tensor]:
    """This rank's q, k, v (B, H, T/cp, d) of one whole sequence (seed 0), leaves."""
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(args.batch, args.heads, t, args.head_dim, generator=gen) for _ in "qkv"]
    if cp == 0:  # the whole sequence, one process
        return [w.requires_grad_() for w in whole]
    m = context_parallel.chunk_size(t, cp, layout)
    chunks = context_parallel.chunks_of(cp, rank, layout)
    return [
        torch.cat([w[:, :, c * m : (c + 1) * m] for c in chunks], 2).requires_grad_() for w in whole
    ]


def kind_of(shape: tuple, m: int):
    """LiveTensorMeter's kind: k|v blocks (2, B, H, T/cp, d), scores (B, H, m, m), other."""

    def kind(t: torch.Tensor) -> str:
        if t.dim() == 5 and tuple(t.shape[1:]) == shape and t.shape[0] == 2:
            return "kv"
        return "scores" if t.dim() == 4 and tuple(t.shape[-2:]) == (m, m) else "other"

    return kind


def ring_row(comm, args, t: int, layout: str) -> dict:
    """One row on this cp group: time, bytes, memory and work, beside the formulas."""
    cp, r = comm.world_size, comm.rank
    q, k, v = qkv(args, t, r, cp, layout)
    n = q.numel()
    m = context_parallel.chunk_size(t, cp, layout)
    counter, stats = Counter(), {}
    live = LiveTensorMeter(kind_of(tuple(q.shape), m))
    with SavedTensorMeter() as saved, live:
        y = context_parallel.ring_attention(
            q, k, v, Unmetered(ObservedComm(comm, counter), live), layout, stats
        )
    fwd, kept = counter.bytes_sent, saved.live
    counter.reset()
    y.sum().backward()
    bwd = counter.bytes_sent

    def step():
        context_parallel.ring_attention(q, k, v, comm, layout).sum().backward()

    formula = formulas(args, t, cp, layout, n)
    got = {"fwd": fwd, "bwd": bwd, "saved": kept, "kv": live.peak.get("kv", 0)}
    got["scores"] = live.peak.get("scores", 0)
    pairs = [context_parallel.causal_pairs(t, cp, i, layout) for i in range(cp)]
    work = gather_over_ranks(comm, stats["pairs"])
    row = {
        "seq": t,
        "cp": cp,
        "layout": layout,
        "step_ms": time_it(comm, step, args.steps) * 1e3,
    }
    row |= {key: max_over_ranks(comm, value) for key, value in got.items()}
    row |= {f"{key}_formula": value for key, value in formula.items()}
    row["exact"] = max_over_ranks(comm, float(got != {key: formula[key] for key in got})) == 0
    row["work"] = max(work) / statistics.mean(work)
    row["work_formula"] = max(pairs) / (sum(pairs) / cp)
    return row


def formulas(args, t: int, cp: int, layout: str, n: int) -> dict:
    """The module docstring's bytes per rank (float32, b = 4; n elements in this rank's q):
    sent forward and backward, saved for backward, and in flight (inflight_nbytes)."""
    b = 4
    formula = {"fwd": 2 * (cp - 1) * n * b, "bwd": 2 * (2 * cp - 1) * n * b if cp > 1 else 0}
    formula["saved"] = (4 * args.head_dim + 1) * args.batch * args.heads * (t // cp) * b
    shape = (args.batch, args.heads, t, args.head_dim, cp, layout, b)
    return formula | context_parallel.inflight_nbytes(*shape)


def full_row(args, t: int) -> dict:
    """Causal attention in one process: step time, saved bytes, the (T, T) tensors in flight."""
    q, k, v = qkv(args, t, 0, 0, "plain")
    live = LiveTensorMeter(kind_of((), t))
    with SavedTensorMeter() as saved, live:
        y = full_attention(q, k, v)
    kept = saved.live
    y.sum().backward()
    times = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        full_attention(q, k, v).sum().backward()
        times.append(time.perf_counter() - start)
    return {
        "seq": t,
        "cp": 1,
        "layout": "full",
        "step_ms": statistics.median(times[1:]) * 1e3,
        "saved": kept,
        "scores": live.peak.get("scores", 0),
    }


def full_attention(q, k, v) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v, the (B, H, T, T) scores materialized."""
    t = q.shape[2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    return torch.softmax(s.masked_fill(future, -math.inf), -1) @ v  # (B, H, T, d)


def run(comm, args) -> dict:
    """Every T, then every cp that fits the world and divides T (2 cp), both layouts: the rows
    as --json prints them (rank 0's has them all: it is in every group)."""
    rows = []
    for t in args.seq:
        if comm.rank == 0:
            rows.append(full_row(args, t))
        comm.barrier()
        for cp in [c for c in (1, 2, 4, 8, 16) if c <= comm.world_size and t % (2 * c) == 0]:
            sub = comm.split(int(comm.rank < cp))  # collective: every rank calls it
            for layout in context_parallel.LAYOUTS:
                if comm.rank < cp:
                    rows.append(ring_row(sub, args, t, layout))
                comm.barrier()  # the others wait: a shared machine times best quiet
    return {"bench": "cp", "backend": comm.backend, "rows": rows}


def report(result: dict, args) -> str:
    """One table: the measurements, each formula beside it (KiB), per T, cp and layout."""
    lines = [
        f"# minidist bench cp: {result['backend']}, B={args.batch} H={args.heads} "
        f"d={args.head_dim}, float32, KiB per rank (busiest rank), formula in ()",
        f"{'T':>6}{'cp':>4}{'layout':>8}{'step ms':>9}{'fwd':>18}{'bwd':>18}{'saved':>18}"
        f"{'k|v':>16}{'scores':>18}{'work':>12}  exact",
    ]
    for r in result["rows"]:
        cells = "".join(
            _pair(r, key, width)
            for key, width in (("fwd", 18), ("bwd", 18), ("saved", 18), ("kv", 16), ("scores", 18))
        )
        work = f"{r['work']:.2f} ({r['work_formula']:.2f})" if "work" in r else "-"
        exact = "" if r["layout"] == "full" else "yes" if r["exact"] else "NO"
        lines.append(
            f"{r['seq']:>6}{r['cp']:>4}{r['layout']:>8}{r['step_ms']:9.1f}{cells}"
            f"{work:>12}  {exact}"
        )
    lines.append("# times: one run on a shared machine (noisy); bytes and memory: exact")
    return "\n".join(lines)


def _pair(row: dict, key: str, width: int) -> str:
    if key not in row:
        return f"{'-':>{width}}"
    got = f"{row[key] / 1024:.1f}"
    want = row.get(f"{key}_formula")
    return f"{got if want is None else f'{got} ({want / 1024:.1f})':>{width}}"


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024], help="tokens T")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=24)
    p.add_argument("--steps", type=int, default=3, help="timed forward + backward per row")


def problems(args: argparse.Namespace) -> list[str]:
    """Why these flags cannot run, one line each (the CLI prints them before starting ranks)."""
    clash = sorted({t for t in args.seq for c in (1, 2, 4, 8, 16, 32) if t == c * args.head_dim})
    if clash:  # the meter tells scores (B, H, m, m) from q's rows (B, H, m, d) by shape
        return [
            f"--head-dim {args.head_dim} equals a chunk's m = T/c for T in {clash}: scores and "
            "q's rows would share one shape; pick another --head-dim"
        ]
    return []


CP = Bench(
    "cp",
    "ring attention: time, bytes, memory vs T and cp",
    __name__,
    flags,
    run,
    report,
    problems,
    ranks=4,
    ranks_help="ranks (cp = 1, 2, 4, ... up to n)",
)

if __name__ == "__main__":
    rank_main(sys.argv[1:], CP)
