"""`minidist conform ADAPTER`: minidist's property tests, run against someone else's code.

    minidist conform minidist                                 # minidist itself: all pass
    minidist conform my_adapter.py --only collectives,dp      # your code, on threads
    minidist conform my_adapter.py --backend threads,gloo,mpi --json out.json --junit out.xml

Prints a table per capability; exit 0 only if no check failed (skipped ones do not fail).
The adapter is described in minidist/conform/adapter.py; lessons/appendix_conformance/ walks
through one for a from-scratch DDP on torch.distributed.
This module only parses: the kit (and hypothesis, which it draws cases with) is imported when
the command runs.
"""

from __future__ import annotations

import argparse
import sys

BACKENDS = ("threads", "gloo", "mpi")
EXAMPLES = 25  # drawn cases per check on threads (the process tier draws a fifth)
# registry.CAPABILITIES' names, said here without importing the kit (tests/test_conform.py
# keeps the two equal)
CAPABILITIES = ("collectives", "dp", "tp", "pp", "moe", "cp", "zero")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "conform",
        help="check your collectives, parallelisms or ZeRO against minidist's tests",
    )
    p.add_argument("adapter", help="adapter file, module, or module:name ('minidist': ours)")
    p.add_argument(
        "--only",
        default=None,
        help=f"capabilities, comma-separated: {','.join(CAPABILITIES)} (default: all)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="backends, comma-separated: threads,gloo,mpi (default: the first that can give "
        "the adapter's COMM: threads, gloo for 'torch', mpi for 'mpi4py')",
    )
    p.add_argument("--examples", type=int, default=EXAMPLES, help="drawn cases per check")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    p.add_argument("--junit", default=None, metavar="FILE", help="write JUnit XML")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        from minidist.conform import adapter as adapters
        from minidist.conform import registry, report, runner
    except ImportError as e:  # hypothesis is a development dependency
        print(f"minidist conform: {e} (pip install hypothesis)", file=sys.stderr)
        return 2
    try:
        adapter = adapters.load(args.adapter)
        checks = registry.selected(args.only.split(",") if args.only else None)
        backends = backends_for(adapter, args.backend)
    except ValueError as e:
        print(f"minidist conform: {e}", file=sys.stderr)
        return 2
    results = runner.conform(args.adapter, checks, backends, args.examples)
    print(report.table(results), end="")
    report.save(args.adapter, results, args.json, args.junit)
    totals = report.summary(results)
    print(
        f"{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped "
        f"in {totals['seconds']:.1f} s"
    )
    return 1 if totals["failed"] else 0


def backends_for(adapter, asked: str | None) -> list[str]:
    """The backends to run on: those asked for, or the first that serves the adapter's COMM."""
    from minidist.conform.adapter import SERVES, comm_kind

    if asked is None:
        return [next(b for b in BACKENDS if comm_kind(adapter) in SERVES[b])]
    names = asked.split(",")
    unknown = [b for b in names if b not in BACKENDS]
    if unknown:
        raise ValueError(f"--backend {','.join(unknown)}: the backends are {list(BACKENDS)}")
    return names
