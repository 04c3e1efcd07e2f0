"""Benchmarks in the style of nccl-tests: the hand-written all-reduce beside the library's.

    minidist bench allreduce -n 2 --backend mpi [--min-bytes 1K] [--max-bytes 64M] [--json]
    minidist bench p2p -n 2 --backend mpi

allreduce: for each size (float32, doubling by 4x from --min-bytes to --max-bytes) and each
algorithm (the library's comm.all_reduce, then minidist.collectives' naive, recursive
doubling, ring and auto), the time of one sum all-reduce, algbw = bytes / time and busbw =
algbw * 2(p-1)/p: the bytes each rank's link must carry in any all-reduce, per second, so
busbw is comparable across world sizes and against the link's bandwidth. ratio = busbw of the
best hand-written algorithm / busbw of the library's: at least 1 means the hand-written one is
as fast or faster.

p2p: ping-pong between ranks 0 and 1; one-way time = round trip / 2, bandwidth = bytes / one-way.

How times are taken: warm-up iterations, then `iters` timed ones, each after a barrier (so all
ranks start together) and with fresh data filled in before the barrier; a rank's time is the
median of its iterations, and the reported time is the slowest rank's. The parent process only
launches the ranks; rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from minidist import collectives
from minidist.launch import init, start_ranks

ALGORITHMS = ("library", "naive", "recursive_doubling", "ring", "auto")
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


def time_it(comm, fn, fill, iters: int, warmup: int) -> float:
    """Median seconds of fn() over iters timed calls on this rank, the slowest rank's."""
    for _ in range(warmup):
        fill()
        fn()
    times = []
    for _ in range(iters):
        fill()
        comm.barrier()  # start together: otherwise one rank's wait for the other is timed
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64)
    return comm.all_reduce(worst, "max").item()


def bench_allreduce(comm, byte_sizes: list[int], iters: int | None) -> list[dict]:
    """One row per size: {nbytes, <algorithm>: {time_us, algbw, busbw}, best, ratio}."""
    return [_allreduce_row(comm, nbytes, iters or default_iters(nbytes)) for nbytes in byte_sizes]


def _allreduce_row(comm, nbytes: int, iters: int) -> dict:
    p = comm.world_size
    x = torch.empty(nbytes // 4, dtype=torch.float32)
    calls = {
        "library": lambda: comm.all_reduce(x, "sum"),
        "naive": lambda: collectives.naive_all_reduce(x, comm, "sum"),
        "recursive_doubling": lambda: collectives.recursive_doubling_all_reduce(x, comm, "sum"),
        "ring": lambda: collectives.ring_all_reduce(x, comm, "sum"),
        "auto": lambda: collectives.all_reduce(x, comm, "sum", "auto"),
    }

    def fill() -> None:
        x.fill_(1.0 + comm.rank)  # fresh data each iteration

    row: dict = {"nbytes": nbytes}
    for name, call in calls.items():
        seconds = time_it(comm, call, fill, iters, warmup=max(2, iters // 10))
        algbw = nbytes / seconds / 1e9
        row[name] = {"time_us": seconds * 1e6, "algbw": algbw, "busbw": algbw * 2 * (p - 1) / p}
    best = min(ALGORITHMS[1:], key=lambda a: row[a]["time_us"])
    row["best"], row["ratio"] = best, row["library"]["time_us"] / row[best]["time_us"]
    return row


def bench_p2p(comm, byte_sizes: list[int], iters: int | None) -> list[dict]:
    """One row per size: {nbytes, time_us (one way), bw (GB/s)}, ping-pong of ranks 0 and 1."""
    if comm.world_size < 2:
        raise ValueError(f"bench p2p needs at least 2 ranks, got world_size={comm.world_size}")
    return [_p2p_row(comm, nbytes, iters or default_iters(nbytes)) for nbytes in byte_sizes]


def _p2p_row(comm, nbytes: int, iters: int) -> dict:
    x = torch.zeros(nbytes // 4, dtype=torch.float32)

    def ping_pong():
        # 0 sends first and 1 receives first: with both sending first (blocking) large
        # messages would wait forever for a receive
        if comm.rank == 0:
            comm.send(x, 1)
            comm.recv(x, 1)
        elif comm.rank == 1:
            comm.recv(x, 0)
            comm.send(x, 0)

    one_way = time_it(comm, ping_pong, lambda: None, iters, warmup=max(2, iters // 10)) / 2
    return {"nbytes": nbytes, "time_us": one_way * 1e6, "bw": nbytes / one_way / 1e9}


def format_allreduce(rows: list[dict]) -> str:
    """The nccl-tests style table: size, then time/algbw/busbw per algorithm, then ratio."""
    head1 = f"#{'':>10}" + "".join(f"{_SHORT.get(a, a):>24}" for a in ALGORITHMS)
    head2 = f"#{'size (B)':>10}" + f"{'time(us)':>10}{'algbw':>7}{'busbw':>7}" * 5 + "  ratio"
    lines = [head1, head2]
    for row in rows:
        cells = "".join(
            f"{row[a]['time_us']:10.1f}{row[a]['algbw']:7.2f}{row[a]['busbw']:7.2f}"
            for a in ALGORITHMS
        )
        lines.append(f" {row['nbytes']:>10}{cells}{row['ratio']:7.2f}")
    return "\n".join(lines)


def format_p2p(rows: list[dict]) -> str:
    lines = [f"#{'size (B)':>10}{'one-way(us)':>13}{'bw(GB/s)':>10}"]
    lines += [f" {r['nbytes']:>10}{r['time_us']:13.1f}{r['bw']:10.2f}" for r in rows]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser, what: bool = True) -> None:
    """The flags of `minidist bench allreduce|p2p` (the parent and every rank parse the same
    ones; the parent's `what` comes from its subcommand)."""
    if what:
        p.add_argument("what", choices=("allreduce", "p2p"))
    p.add_argument("-n", type=int, default=2, help="number of ranks")
    p.add_argument("--backend", choices=("mpi", "gloo", "threads"), default="mpi")
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1K"))
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("64M"))
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default: by size)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")


def main(args: argparse.Namespace) -> int:
    """The parent: start args.n ranks of this module on args.backend and wait for them."""
    argv = [args.what, "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes)]
    argv += ["--iters", str(args.iters)] if args.iters else []
    argv += ["--json"] if args.json else []
    return start_ranks(__name__, argv, args.n, args.backend, "minidist bench")


def rank_main(argv: list[str]) -> None:
    """One rank: run the benchmark; rank 0 prints the table (or the JSON object)."""
    parser = argparse.ArgumentParser(prog="minidist bench")
    add_arguments(parser)
    args = parser.parse_args(argv)
    comm = init()
    byte_sizes = sizes(args.min_bytes, args.max_bytes)
    bench = bench_allreduce if args.what == "allreduce" else bench_p2p
    rows = bench(comm, byte_sizes, args.iters)
    if comm.rank != 0:
        return
    info = {"bench": args.what, "backend": comm.backend, "world_size": comm.world_size}
    if args.json:
        print(json.dumps(dict(info, dtype="float32", rows=rows)))
        return
    print(f"# minidist bench {args.what}: {comm.backend}, {comm.world_size} ranks, float32")
    print(format_allreduce(rows) if args.what == "allreduce" else format_p2p(rows))


if __name__ == "__main__":
    rank_main(sys.argv[1:])
