"""A check of the conformance kit, as data: what it needs from the adapter, its cases, what each
rank runs, and how the kit judges what the ranks return; and the pieces every check shares.

A check is one property of one capability, restated from minidist's own tests, e.g. "all_reduce
with op=sum equals the sum of every rank's tensor, exactly, on every rank". It is judged over a
list of cases (each a dict with the world size "p"): fixed hard ones first (world size 1, sizes
not divisible by p, empty and 0-d tensors), then cases drawn by hypothesis, derandomized, so
every run draws the same. The first case that fails is the one reported.

Each case runs in two halves, data apart from execution:
- `run(rank, case)`, on every rank of a world of case["p"] ranks: rebuild the problem from the
  case's seed, call the adapter (through `rank.adapter`, with the communicator it asked for in
  `rank.comm`), and return plain tensors (detached copies);
- `judge(case, outputs)`, once, in the kit's own process: compute the single-process reference
  from the same seed, compare every rank's outputs (outputs[r] is what rank r returned), and
  return the problems found, each naming the tensor, the rank and the largest difference.
The reference is computed by the kit, never by the code under test, and the kit slices inputs
itself, never with the adapter's shard function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class Unavailable(Exception):
    """The check cannot run here: the adapter lacks a function, or the backend cannot give the
    communicator the adapter asks for. The check is reported skipped, with this reason."""


@dataclass(frozen=True)
class Problem:
    """What a judge found wrong: a line of words and the largest difference (None: not a
    numeric difference, e.g. a shape, a gradient that should be None, an error)."""

    text: str
    max_difference: float | None = None


@dataclass(frozen=True)
class Check:
    """One property of a capability (see the module docstring)."""

    capability: str  # "collectives", "dp", "tp", ...: the --only names
    name: str  # e.g. "all_reduce.sum"; unique within its capability
    about: str  # one line: what it checks and to what tolerance
    needs: tuple[str, ...]  # the adapter's functions (or attributes) it calls
    run: Callable  # run(rank: Rank, case: dict) -> outputs of this rank (picklable)
    judge: Callable  # judge(case: dict, outputs: list) -> list[Problem]
    cases: Callable  # cases(max_p: int) -> a hypothesis strategy of case dicts with "p" <= max_p
    explicit: tuple = field(default=())  # hard cases, run first (those with p <= the world)
    skip: Callable | None = None  # skip(adapter) -> '' or why the check cannot judge it

    @property
    def full_name(self) -> str:
        return f"{self.capability}.{self.name}"


def draw(check: Check, max_p: int, n: int) -> list[dict]:
    """The cases of `check` for worlds of at most max_p ranks: its explicit ones, then n drawn by
    hypothesis, derandomized (the same list on every run and every machine), without repeats."""
    from hypothesis import HealthCheck, Phase, given, settings  # the kit's one use of it

    drawn: list[dict] = []

    @settings(
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=max(n, 1),
        phases=[Phase.generate],
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(check.cases(max_p))
    def collect(case: dict) -> None:
        drawn.append(case)

    if n > 0:
        collect()
    cases = [c for c in check.explicit if c["p"] <= max_p]
    for case in drawn:
        if case not in cases:
            cases.append(case)
    return cases


def compare(name: str, got, want: torch.Tensor, rtol: float = 0.0, atol: float = 0.0):
    """None if got equals want (rtol = atol = 0: exactly; else elementwise within
    atol + rtol |want|, NaN equal to NaN), else a Problem naming `name` and the largest
    difference. got must be a tensor of want's shape and dtype."""
    if not isinstance(got, torch.Tensor):
        return Problem(f"{name}: got {type(got).__name__}, expected a tensor")
    if got.shape != want.shape or got.dtype != want.dtype:
        return Problem(
            f"{name}: got shape {tuple(got.shape)} {got.dtype}, "
            f"expected {tuple(want.shape)} {want.dtype}"
        )
    a, e = got.detach().cpu(), want.detach().cpu()
    if a.dtype == torch.bool:
        a, e = a.to(torch.int8), e.to(torch.int8)
    if rtol == 0 and atol == 0:
        if torch.equal(a, e):
            return None
    elif torch.allclose(a.double(), e.double(), rtol=rtol, atol=atol, equal_nan=True):
        return None
    diff = (a.double() - e.double()).abs()
    worst = diff.nan_to_num(math.inf).max().item() if diff.numel() else 0.0
    tolerance = "exact" if rtol == 0 and atol == 0 else f"rtol={rtol:g}, atol={atol:g}"
    return Problem(f"{name}: max |difference| {worst:.3g} ({tolerance})", worst)


def compare_all(pairs: dict, rtol: float = 0.0, atol: float = 0.0) -> list[Problem]:
    """compare() every name: (got, want) pair; the problems found, in order."""
    found = [compare(name, got, want, rtol, atol) for name, (got, want) in pairs.items()]
    return [p for p in found if p is not None]


def same_on_every_rank(name: str, tensors: list) -> list[Problem]:
    """[] if every rank's tensor has rank 0's bits (-0.0 and +0.0 differ), else one Problem."""
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return []  # compare() has said so already
    first = tensors[0]
    differ = [
        r
        for r, t in enumerate(tensors)
        if t.shape != first.shape or t.dtype != first.dtype or not _same_bits(t, first)
    ]
    if not differ:
        return []
    return [Problem(f"{name}: ranks {differ} differ from rank 0 bitwise")]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return True
    a = a.detach().cpu().reshape(-1).clone(memory_format=torch.contiguous_format)
    b = b.detach().cpu().reshape(-1).clone(memory_format=torch.contiguous_format)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def integer_valued(shape, dtype: torch.dtype, seed: int, rank: int = 0) -> torch.Tensor:
    """Small integers in `dtype`, different per rank: a sum over 8 ranks is exact in every dtype
    (so any order of additions gives the exact result)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-8, 8, tuple(shape), generator=g).to(dtype)


def detached(t):
    """A copy of t that leaves the rank: detached, on the CPU (None stays None)."""
    return None if t is None else t.detach().cpu().clone()
