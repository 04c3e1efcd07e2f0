"""Benchmarks in the style of nccl-tests: the hand-written all-reduce beside the library's.

    minidist bench allreduce -n 2 --backend mpi [--min-bytes 1K] [--max-bytes 64M] [--json]
    minidist bench p2p -n 2 --backend mpi
    minidist bench allreduce -n 2 --backend nccl      # CUDA tensors, one rank per GPU

allreduce: for each size (float32, doubling by 4x from --min-bytes to --max-bytes) and each
algorithm (raw: the library called directly, outside minidist: mpi4py's COMM_WORLD.Allreduce
on mpi, torch.distributed.all_reduce on the default group on gloo/nccl; library: the same
through minidist's comm.all_reduce; then minidist.collectives.algorithms' naive, recursive doubling,
ring and auto), the time of one sum all-reduce, algbw = bytes / time and busbw = algbw * 2(p-1)/p:
the bytes each rank's link must carry in any all-reduce, per second, so busbw is comparable
across world sizes and against the link's bandwidth. ratio = time of the raw library / time of
the best hand-written algorithm (of the library through the comm on threads, which has no raw
library; `ratio_vs` names which): at least 1 means the hand-written one is as fast or faster.

p2p: ping-pong between ranks 0 and 1 through the comm and, beside it, through the raw library
(Send/Recv, torch.distributed.send/recv); one-way time = round trip / 2, bandwidth = bytes /
one-way; ratio = raw one-way time / the comm's: what the comm's per-message overhead costs.

How times are taken: warm-up iterations, then `iters` timed ones, each after a barrier (so all
ranks start together) and with fresh data filled in before the barrier; a rank's time is the
median of its iterations, and the reported time is the slowest rank's. The parent process only
launches the ranks; rank 0 prints.
"""

from __future__ import annotations

import argparse
import sys

import torch

from minidist.bench import Bench, device_of, rank_main, time_columns, time_it
from minidist.collectives import algorithms as collectives

ALGORITHMS = ("raw", "library", "naive", "recursive_doubling", "ring", "auto")
_SHORT = {"recursive_doubling": "rec-dbl"}
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """'64M' -> 67108864: an integer with an optional K, M or G suffix (powers of 1024)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1:] if text[-1:] in _UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * _UNITS[unit])


def sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """min_bytes, min_bytes * factor, ... up to max_bytes, each a whole number of float32s."""
    out, n = [], max(4, min_bytes)
    while n <= max_bytes:
        out.append(n // 4 * 4)
        n *= factor
    return out


def default_iters(nbytes: int) -> int:
    """Enough iterations for a stable median: 200 for small sizes, 10 at 64 MiB (~20 ms each)."""
    return max(10, min(200, 10 * (64 << 20) // nbytes))


def raw_library(comm):
    """(all_reduce(x), send(x, dst), recv(x, src)) of the library under comm, called directly
    (not through minidist), or None on threads, which has no library under it. x: a contiguous
    float32 tensor on comm's device; ranks are world ranks (comm is the world)."""
    if comm.backend == "mpi":
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        # the tensor's own memory as an MPI buffer: no copy, as a user of mpi4py would pass it
        return (
            lambda x: world.Allreduce(MPI.IN_PLACE, x.numpy(), MPI.SUM),
            lambda x, dst: world.Send(x.numpy(), dst),
            lambda x, src: world.Recv(x.numpy(), src),
        )
    if comm.backend in ("gloo", "nccl"):
        import torch.distributed as dist

        return (dist.all_reduce, lambda x, dst: dist.send(x, dst), lambda x, src: dist.recv(x, src))
    return None


def bench_allreduce(comm, byte_sizes: list[int], iters: int | None) -> list[dict]:
    """One row per size: {nbytes, <algorithm>: {time_us, algbw, busbw} (raw: None on threads),
    best, ratio, ratio_vs}."""
    return [_allreduce_row(comm, nbytes, iters or default_iters(nbytes)) for nbytes in byte_sizes]


def _allreduce_row(comm, nbytes: int, iters: int) -> dict:
    p, raw = comm.world_size, raw_library(comm)
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device_of(comm))
    calls = {
        "raw": (lambda: raw[0](x)) if raw else None,
        "library": lambda: comm.all_reduce(x, "sum"),
        "naive": lambda: collectives.naive_all_reduce(x, comm, "sum"),
        "recursive_doubling": lambda: collectives.recursive_doubling_all_reduce(x, comm, "sum"),
        "ring": lambda: collectives.ring_all_reduce(x, comm, "sum"),
        "auto": lambda: collectives.all_reduce(x, comm, "sum", "auto"),
    }

    def fill() -> None:
        x.fill_(1.0 + comm.rank)  # fresh data each iteration

    row: dict = {"nbytes": nbytes}
    for name, seconds in time_columns(comm, calls, iters, max(2, iters // 10), fill).items():
        row[name] = None if seconds is None else _bandwidths(nbytes, seconds, p)
    best = min(ALGORITHMS[2:], key=lambda a: row[a]["time_us"])
    row["best"], row["ratio_vs"] = best, "raw" if raw else "library"
    row["ratio"] = row[row["ratio_vs"]]["time_us"] / row[best]["time_us"]
    return row


def _bandwidths(nbytes: int, seconds: float, p: int) -> dict:
    """{time_us, algbw, busbw} of one all-reduce of nbytes that took seconds on p ranks."""
    algbw = nbytes / seconds / 1e9
    return {"time_us": seconds * 1e6, "algbw": algbw, "busbw": algbw * 2 * (p - 1) / p}


def bench_p2p(comm, byte_sizes: list[int], iters: int | None) -> list[dict]:
    """One row per size: {nbytes, time_us (one way), bw (GB/s), raw: {time_us, bw} or None on
    threads, ratio (raw time / time; None on threads)}, ping-pong of ranks 0 and 1."""
    if comm.world_size < 2:
        raise ValueError(f"bench p2p needs at least 2 ranks, got world_size={comm.world_size}")
    return [_p2p_row(comm, nbytes, iters or default_iters(nbytes)) for nbytes in byte_sizes]


def _p2p_row(comm, nbytes: int, iters: int) -> dict:
    x = torch.zeros(nbytes // 4, dtype=torch.float32, device=device_of(comm))
    raw = raw_library(comm)
    row = {"nbytes": nbytes, **_one_way(comm, comm.send, comm.recv, x, iters)}
    row["raw"] = _one_way(comm, raw[1], raw[2], x, iters) if raw else None
    row["ratio"] = row["raw"]["time_us"] / row["time_us"] if raw else None
    return row


def _one_way(comm, send, recv, x: torch.Tensor, iters: int) -> dict:
    """{time_us, bw}: half the median round trip of x between ranks 0 and 1 via send/recv."""

    def ping_pong():
        # 0 sends first and 1 receives first: with both sending first (blocking) large
        # messages would wait forever for a receive
        if comm.rank == 0:
            send(x, 1)
            recv(x, 1)
        elif comm.rank == 1:
            recv(x, 0)
            send(x, 0)

    one_way = time_it(comm, ping_pong, iters, max(2, iters // 10)) / 2
    return {"time_us": one_way * 1e6, "bw": x.numel() * 4 / one_way / 1e9}


def format_allreduce(rows: list[dict]) -> str:
    """The nccl-tests style table: size, then time/algbw/busbw per algorithm, then ratio."""
    head1 = f"#{'':>10}" + "".join(f"{_SHORT.get(a, a):>24}" for a in ALGORITHMS)
    head2 = f"#{'size (B)':>10}" + f"{'time(us)':>10}{'algbw':>7}{'busbw':>7}" * 6 + "  ratio"
    lines = [head1, head2]
    for row in rows:
        cells = "".join(_cells(row[a]) for a in ALGORITHMS)
        lines.append(f" {row['nbytes']:>10}{cells}{row['ratio']:7.2f}")
    vs = rows[0]["ratio_vs"] if rows else "raw"
    lines.append(f"# ratio = {vs} time / best hand-written time (>= 1: hand-written as fast)")
    return "\n".join(lines)


def _cells(cell: dict | None) -> str:
    if cell is None:  # no raw library under the threads backend
        return f"{'-':>10}{'-':>7}{'-':>7}"
    return f"{cell['time_us']:10.1f}{cell['algbw']:7.2f}{cell['busbw']:7.2f}"


def format_p2p(rows: list[dict]) -> str:
    """Size, the comm's one-way time and bandwidth, the raw library's, and their ratio."""
    lines = [f"#{'size (B)':>10}{'one-way(us)':>13}{'bw(GB/s)':>10}{'raw(us)':>10}{'raw bw':>8}"]
    lines[0] += "  ratio"
    for r in rows:
        line = f" {r['nbytes']:>10}{r['time_us']:13.1f}{r['bw']:10.2f}"
        if r["raw"] is None:  # no raw library under the threads backend
            line += f"{'-':>10}{'-':>8}{'-':>7}"
        else:
            line += f"{r['raw']['time_us']:10.1f}{r['raw']['bw']:8.2f}{r['ratio']:7.2f}"
        lines.append(line)
    lines.append("# ratio = raw one-way time / the comm's (>= 1: the comm adds nothing)")
    return "\n".join(lines)


def flags(p: argparse.ArgumentParser) -> None:
    """The flags of `minidist bench allreduce|p2p` beyond -n and --backend."""
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1K"))
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("64M"))
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default: by size)")


def problems(args: argparse.Namespace) -> list[str]:
    """Why these flags cannot run, one line each (the CLI prints them before starting ranks;
    every number is already in its range). A rank holds its tensor and the ring's temporaries,
    about 3 x --max-bytes: all ranks together must fit in the memory free now."""
    found = []
    if args.min_bytes > args.max_bytes:
        found.append(f"--min-bytes {args.min_bytes} is more than --max-bytes {args.max_bytes}")
    free = _free_bytes()
    if free is not None and 3 * args.n * args.max_bytes > free:
        found.append(
            f"--max-bytes {args.max_bytes}: {args.n} ranks need about 3 x {args.n} x that, "
            f"{3 * args.n * args.max_bytes / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB are free"
        )
    return found


def _free_bytes() -> int | None:
    """The memory free now (Linux: MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            found = [line.split()[1] for line in f if line.startswith("MemAvailable:")]
    except OSError:
        return None
    return int(found[0]) * 1024 if found else None


def p2p_problems(args: argparse.Namespace) -> list[str]:
    """problems(), and a ping-pong needs two ranks."""
    found = [f"-n {args.n}: bench p2p needs at least 2 ranks"] if args.n < 2 else []
    return found + problems(args)


def measure_allreduce(comm, args: argparse.Namespace) -> dict:
    rows = bench_allreduce(comm, sizes(args.min_bytes, args.max_bytes), args.iters)
    return _result(comm, "allreduce", rows)


def measure_p2p(comm, args: argparse.Namespace) -> dict:
    return _result(comm, "p2p", bench_p2p(comm, sizes(args.min_bytes, args.max_bytes), args.iters))


def _result(comm, what: str, rows: list[dict]) -> dict:
    """The object --json prints: which table, on what, and its rows."""
    info = {"bench": what, "backend": comm.backend, "world_size": comm.world_size}
    return dict(info, dtype="float32", rows=rows)


def report(result: dict, args: argparse.Namespace) -> str:
    what = result["bench"]
    head = f"# minidist bench {what}: {result['backend']}, {result['world_size']} ranks, float32"
    return head + "\n" + (format_allreduce if what == "allreduce" else format_p2p)(result["rows"])


SHARED = dict(
    module=__name__,
    flags=flags,
    report=report,
    ranks_help="number of ranks",
    backends=("mpi", "gloo", "nccl", "threads"),
)
ALLREDUCE = Bench(
    "allreduce",
    "nccl-tests style table, all-reduce: hand-written vs library",
    measure=measure_allreduce,
    problems=problems,
    **SHARED,
)
P2P = Bench(
    "p2p", "nccl-tests style table, ping-pong", measure=measure_p2p, problems=p2p_problems, **SHARED
)


if __name__ == "__main__":
    rank_main(sys.argv[1:], ALLREDUCE, P2P)
