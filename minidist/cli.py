"""The `minidist` command: `minidist run`, `minidist bench`, ...

minidist train --dp 2 --pp 2 --tp 2 --check          the main job: a small GPT, 8 ranks
minidist run -n 4 --backend mpi script.py args...      start 4 ranks on this machine
minidist bench allreduce|p2p -n 2 --backend mpi        nccl-tests style tables
minidist bench dp|tp|pipeline|zero|sgd|batch ...            the techniques, measured
minidist schedule --schedule 1f1b --stages 4 --microbatches 8   a pipeline schedule, drawn
"""

from __future__ import annotations

import argparse
import sys

from .launch import BACKENDS, launch, run_threads
from .schedules import add_schedule_command
from .watchdog import job_timeout


def _run(args: argparse.Namespace) -> int:
    argv = [args.script, *args.args]
    if args.backend == "threads":
        outcome = run_threads(argv, args.n, job_timeout())
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
    # each benchmark keeps its flags beside it: the parent and every rank parse the same ones
    from . import bench, bench_batch, bench_dp, bench_pipeline, bench_sgd, bench_tp, bench_zero

    p = sub.add_parser("bench", help="measure: collectives and every technique")
    kinds = p.add_subparsers(dest="what", required=True)
    for what, about in (("allreduce", "all-reduce: hand-written vs library"), ("p2p", "ping-pong")):
        q = kinds.add_parser(what, help=f"nccl-tests style table, {about}")
        bench.add_arguments(q, what=False)
        q.set_defaults(func=bench.main, what=what)
    for module in (bench_dp, bench_tp, bench_pipeline, bench_zero, bench_sgd, bench_batch):
        module.add_parser(kinds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minidist", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_bench(sub)
    from . import train_cli  # the main job: imports every technique, so only when asked

    train_cli.add_parser(sub)
    add_schedule_command(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
