"""The skeleton of every `minidist bench ...`: flags, ranks, timing and output, written once.

A benchmark is a Bench, declared in its technique's folder beside the code it measures (its
bench.py holds the measurements, the formulas and the table); this module does the rest, the
same way for all of them:

    flags    -n, --backend, the benchmark's own flags (Bench.flags), --json: the parent and
             every rank parse the same ones (Bench.parser)
    refuse   Bench.problems(args), in the parent, before anything starts: why these flags
             cannot run, one line each (minidist/cli.py prints them and exits with 2)
    parent   Bench.main: start -n ranks of the benchmark's module on --backend through the
             launcher, handing on every flag as parsed (hand_on); with several world sizes in
             -n (bench zero), one launch each, whose rank 0 leaves its result in a file
    rank     rank_main: parse, one torch thread per rank (the ranks share the machine's cores),
             init() the world, result = Bench.measure(comm, args) on every rank; rank 0 prints
             Bench.report(result, args), or with --json the result itself as one JSON object
    time     time_it: the median seconds of a call over timed iterations, each started after a
             barrier, the slowest rank's; time_columns: several implementations of one step,
             one after the other on the same group, a column each

A column measured by another implementation on the same group (torch DDP beside
DataParallelBucketed, say) is one more entry in the benchmark's time_columns call (None on a
backend that lacks it, as the raw library on threads), one more key in its result and one more
cell in its report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from minidist.launch.init import init
from minidist.launch.launcher import start_ranks


def no_problems(args: argparse.Namespace) -> list[str]:
    """Every value in its range runs (the CLI checks the ranges of all flags)."""
    return []


@dataclass(frozen=True)
class Bench:
    """`minidist bench <name>`: what only this benchmark knows; the skeleton does the rest."""

    name: str  # minidist bench <name>
    about: str  # its line in `minidist bench --help`
    module: str  # what its ranks run (python -m module): the benchmark's own module
    flags: Callable[[argparse.ArgumentParser], None]  # its own flags, after -n and --backend
    measure: Callable[[Any, argparse.Namespace], Any]  # (comm, args) -> result, every rank
    report: Callable[[Any, argparse.Namespace], str]  # rank 0's result -> its table
    problems: Callable[[argparse.Namespace], list[str]] = no_problems
    ranks: int | tuple[int, ...] = 2  # -n's default; a tuple: world sizes, one launch each
    ranks_help: str = "ranks"
    backends: tuple[str, ...] = ("mpi", "gloo", "threads")  # --backend's choices; first: default
    wait: float | None = None  # seconds a rank may wait for another (None: MINIDIST_TIMEOUT)
    env: tuple[tuple[str, str], ...] = ()  # variables of the ranks' processes

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        """The flags of `minidist bench <name>`, the same in the parent and in every rank."""
        if isinstance(self.ranks, tuple):  # a list: cli.command_problems checks each size
            p.add_argument(
                "-n", type=int, nargs="+", default=list(self.ranks), help=self.ranks_help
            )
        else:
            p.add_argument("-n", type=int, default=self.ranks, help=self.ranks_help)
        p.add_argument("--backend", choices=self.backends, default=self.backends[0])
        self.flags(p)
        p.add_argument("--json", action="store_true", help="print one JSON object instead")

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=f"minidist bench {self.name}")
        self.add_arguments(p)
        return p

    def add_parser(self, sub) -> None:
        """Add <name> to `sub`, the subcommands of `minidist bench`."""
        p = sub.add_parser(self.name, help=self.about)
        self.add_arguments(p)
        p.set_defaults(func=self.main)

    def main(self, args: argparse.Namespace) -> int:
        """The parent: start the ranks and wait; 0, or the failing rank's exit code. Several
        world sizes: one launch each, then the report (or JSON object) of all their results."""
        if not isinstance(args.n, list):
            return self._start(args, args.n)
        results = []
        for n in args.n:
            with tempfile.TemporaryDirectory(prefix=f"minidist-bench-{self.name}-") as folder:
                path = os.path.join(folder, "result.json")
                code = self._start(args, n, ["--result", path])
                if code != 0:
                    return code
                with open(path) as f:
                    results.append(json.load(f))
        if args.json:
            print(json.dumps({"bench": self.name, "results": results}))
        else:
            print(self.report(results, args))
        return 0

    def _start(self, args: argparse.Namespace, n: int, more: list[str] | None = None) -> int:
        argv = [self.name, *hand_on(self.parser(), args, n), *(more or [])]
        how: dict = {"env": dict(self.env)} if self.env else {}
        if self.wait is not None:
            how["timeout"] = self.wait  # the threads world's: init(timeout=...) sets the others'
        return start_ranks(self.module, argv, n, args.backend, f"minidist bench {self.name}", **how)


def hand_on(parser: argparse.ArgumentParser, args: argparse.Namespace, n: int) -> list[str]:
    """args as the flags that parser parses back to the same values, -n as n: what the parent
    hands each rank (a switch that is off, and an option left at None, are left out)."""
    argv = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[-1]
        value = n if action.dest == "n" else getattr(args, action.dest)
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv.append(f"{flag}={value}")  # = : a value may start with '-'
    return argv


def rank_main(argv: list[str], *benches: Bench) -> None:
    """One rank of `minidist bench argv[0]`, one of benches (its module's): parse the rest,
    measure on every rank; rank 0 prints the report or the JSON object, or, one of several
    launches (--result), leaves the result in that file for the parent."""
    (bench,) = [b for b in benches if b.name == argv[0]]
    parser = bench.parser()
    parser.add_argument("--result", help="the file for rank 0's result, which the parent shows")
    args = parser.parse_args(argv[1:])
    # one core per rank: the ranks share the machine (a 4 MiB ring ran 0.63x raw with two
    # threads per rank, 0.87x with one)
    torch.set_num_threads(1)
    comm = init(timeout=bench.wait)
    args.n, args.backend = comm.world_size, comm.backend  # the world as it is, mpiexec too
    result = bench.measure(comm, args)
    if comm.rank != 0:
        return
    if args.result:
        with open(args.result, "w") as f:
            json.dump(result, f)
    else:
        print(json.dumps(result) if args.json else bench.report(result, args))


def device_of(comm) -> torch.device:
    """Where a benchmark's tensors live: comm's device (CUDA on nccl), else the CPU."""
    return getattr(comm, "device", torch.device("cpu"))


def time_it(comm, fn, iters: int, warmup: int = 1, fill=None) -> float:
    """Median seconds of fn() over iters timed calls on this rank, the slowest rank's; warmup
    untimed calls first, and fill() (fresh data) before every call, outside the timing."""
    cuda = device_of(comm).type == "cuda"
    for _ in range(warmup):
        if fill:
            fill()
        fn()
    times = []
    for _ in range(iters):
        if fill:
            fill()
        comm.barrier()  # start together: otherwise one rank's wait for the others is timed
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()  # a CUDA collective returns when queued, not when done
        times.append(time.perf_counter() - t0)
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64)
    return comm.all_reduce(worst, "max").item()


def time_columns(comm, calls: dict, iters: int, warmup: int = 1, fill=None) -> dict:
    """{name: time_it(calls[name])}, the implementations one after the other on the same comm;
    None where calls[name] is None (one this backend lacks, as the raw library on threads)."""
    return {
        name: None if fn is None else time_it(comm, fn, iters, warmup, fill)
        for name, fn in calls.items()
    }


def medians(rounds: dict) -> dict:
    """{name: the median of its rounds} (None stays None)."""
    return {name: None if t is None else statistics.median(t) for name, t in rounds.items()}


def interleaved_rounds(comm, calls: dict, rounds: int, warmup: int = 1) -> dict:
    """{name: [seconds of each round, the slowest rank's]} of implementations of one step timed
    in turn, one call each per round after warmup untimed calls of each, so that a machine that
    speeds up or slows down during the run weighs on every column alike (the fair way to quote
    a ratio on a shared machine: medians for the columns, ratio_spread for how far one round's
    ratio strays). None where calls[name] is None."""
    ready = {name: fn for name, fn in calls.items() if fn is not None}
    for fn in ready.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in ready}
    for _ in range(rounds):
        for name, fn in ready.items():
            comm.barrier()  # start together, as time_it
            t0 = time.perf_counter()
            fn()
            if device_of(comm).type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    found = {name: None for name in calls}
    for name, seen in times.items():
        slowest = comm.all_reduce(torch.tensor(seen, dtype=torch.float64), "max")
        found[name] = slowest.tolist()
    return found


def ratio_spread(ours: list[float], theirs: list[float]) -> tuple[float, float]:
    """The middle half (first and third quartiles) of the per-round ratios ours / theirs of
    two implementations timed in the same rounds: how far one round's ratio strays on this
    machine, printed beside the ratio of the medians so that a reader can tell a difference
    from the noise."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    if len(ratios) < 2:
        return ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, q3


def spread_words(spread: tuple[float, float] | None) -> str:
    """' (rounds 0.98-1.09)': ratio_spread's middle half, for a report line ('' for None)."""
    return "" if spread is None else f" (rounds {spread[0]:.2f}-{spread[1]:.2f})"


def max_over_ranks(comm, value: float) -> float:
    """The largest of every rank's value (the busiest rank's bytes, the slowest one's time)."""
    return comm.all_reduce(torch.tensor([float(value)], dtype=torch.float64), "max").item()


def all_ranks(comm, ok: bool) -> bool:
    """Whether ok holds on every rank."""
    return max_over_ranks(comm, 0.0 if ok else 1.0) == 0.0


def gather_over_ranks(comm, value: float) -> list[float]:
    """Every rank's value, in rank order."""
    out = torch.empty(comm.world_size, dtype=torch.float64)
    comm.all_gather(out, torch.tensor([float(value)], dtype=torch.float64))
    return out.tolist()


def torch_group(comm):
    """comm's torch.distributed process group (gloo, nccl; the world's, None, as
    dist.group.WORLD), or None on a backend without one (threads, mpi): where a bench times
    PyTorch's own implementation beside minidist's."""
    group = getattr(comm, "group", False)
    if group is False:
        return None
    import torch.distributed as dist

    return dist.group.WORLD if group is None else group
