"""The `minidist` command: `minidist run`, `minidist bench`, ...

minidist run -n 4 --backend mpi script.py args...     start 4 ranks on this machine
minidist bench allreduce -n 2 --backend mpi           nccl-tests style tables
"""

from __future__ import annotations

import argparse
import sys

from .launch import BACKENDS, launch, run_threads


def _run(args: argparse.Namespace) -> int:
    argv = [args.script, *args.args]
    if args.backend == "threads":
        outcome = run_threads(argv, args.n)
    else:
        outcome = launch(argv, args.n, args.backend)
    if outcome.returncode != 0:
        print(f"minidist run: {outcome.report()}", file=sys.stderr, end="")
    return outcome.returncode


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="start N ranks of a script on this machine")
    p.add_argument("-n", type=int, required=True, help="number of ranks")
    p.add_argument("--backend", choices=BACKENDS, default="mpi")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run)


def _add_bench(sub) -> None:
    from . import bench  # the flags live beside the benchmark, which every rank parses too

    p = sub.add_parser("bench", help="nccl-tests style tables: hand-written vs library")
    bench.add_arguments(p)
    p.set_defaults(func=bench.main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minidist", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_bench(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
