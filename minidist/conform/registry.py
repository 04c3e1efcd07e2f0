"""The check registry: every capability the kit knows, by its --only name, with its checks.

Adding a capability (pipeline, zero, moe, ring attention, ...): write
minidist/conform/<capability>.py with a list CHECKS of Check (checks.py says what one is; the
adapter functions it calls go into adapter.py's docstring), and add one line below. Nothing
else changes: the runner, the report and the command take every capability listed here.
"""

from __future__ import annotations

from minidist.conform import (
    collectives,
    context_parallel,
    data_parallel,
    moe,
    pipeline,
    tensor_parallel,
    zero,
)
from minidist.conform.checks import Check

CAPABILITIES: dict[str, list[Check]] = {
    "collectives": collectives.CHECKS,
    "dp": data_parallel.CHECKS,
    "tp": tensor_parallel.CHECKS,
    "pp": pipeline.CHECKS,
    "moe": moe.CHECKS,
    "cp": context_parallel.CHECKS,
    "zero": zero.CHECKS,
}


def checks_by_name() -> dict[str, Check]:
    """Every check by its full name, e.g. "collectives.all_reduce.sum"."""
    return {c.full_name: c for checks in CAPABILITIES.values() for c in checks}


def selected(only: list[str] | None) -> list[Check]:
    """The checks of the named capabilities (all if None); ValueError naming an unknown one."""
    names = list(CAPABILITIES) if not only else only
    unknown = [n for n in names if n not in CAPABILITIES]
    if unknown:
        raise ValueError(f"--only {','.join(unknown)}: the capabilities are {list(CAPABILITIES)}")
    return [check for name in names for check in CAPABILITIES[name]]
