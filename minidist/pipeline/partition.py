"""Partitioning a sequential model into pipeline stages: contiguous runs of layers, balanced.

Equals: nothing to match, a plan is data. `balance` splits n per-layer costs into k contiguous
non-empty parts whose most expensive part is as cheap as possible (exact, by dynamic
programming; a test checks it against brute force).
Communication: none here; the stages planned here pass activations in pipeline/stage.py.
Memory per stage: its layers; the plan's `costs` say how much, when the cost is parameters.
Ladder: balance by parameter count (`param_counts`) -> by any per-layer cost (a measured time,
FLOPs: whatever the slowest stage is slow in) -> v chunks per stage (interleaved: k = v * p).
Paper: GPipe (Huang et al. 2019, sec. 2: "partition ... to balance the computation").
Lesson: lessons/06_pipeline/.   Run: python lessons/06_pipeline/demo.py

Why balance matters: every stage does one forward per microbatch in lockstep, so a pipeline runs
at the pace of its slowest stage; with stage costs c_0..c_{k-1} the others idle a fraction
1 - mean(c) / max(c) of the steady state. `Plan.imbalance` = max(c) / mean(c) (1.0 is perfect).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from torch import nn


@dataclass(frozen=True)
class Plan:
    """Part k holds layers bounds[k] = (lo, hi), i.e. layers[lo:hi], costing costs[k]."""

    bounds: tuple[tuple[int, int], ...]
    costs: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """max / mean of the part costs: the slowest part sets the pace (1.0: perfectly even)."""
        mean = sum(self.costs) / len(self.costs)
        return max(self.costs) / mean if mean > 0 else 1.0

    def table(self) -> str:
        """One line per part: its layers and cost, then the imbalance."""
        lines = [
            f"part {k}: layers {lo:>3}..{hi - 1:<3} cost {cost:g}"
            for k, ((lo, hi), cost) in enumerate(zip(self.bounds, self.costs, strict=True))
        ]
        return "\n".join(lines + [f"imbalance (max / mean cost): {self.imbalance:.3f}"])


def param_counts(layers: Sequence[nn.Module]) -> list[int]:
    """The number of parameter elements of each layer (a cost for `partition`)."""
    return [sum(p.numel() for p in layer.parameters()) for layer in layers]


def balance(costs: Sequence[float], n_parts: int) -> list[tuple[int, int]]:
    """(lo, hi) of each of n_parts contiguous, non-empty runs of `costs`, minimizing the largest
    run's sum. best[k][j]: the least possible largest sum when the first j layers form k parts;
    O(k n^2) time, fine for the hundreds of layers a model has."""
    n = len(costs)
    if n_parts < 1:
        raise ValueError(f"n_parts={n_parts} must be at least 1")
    if n < n_parts:
        raise ValueError(f"{n} layers cannot fill {n_parts} parts: each needs at least one layer")
    if any(c < 0 for c in costs):
        raise ValueError(f"costs must be non-negative, got {list(costs)}")
    prefix = [0.0, *accumulate(float(c) for c in costs)]  # prefix[j] = sum(costs[:j])
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(n_parts + 1)]  # where the k-th part starts
    best[0][0] = 0.0
    for k in range(1, n_parts + 1):
        for j in range(k, n - (n_parts - k) + 1):  # leave a layer for each later part
            for i in range(k - 1, j):  # part k is layers i..j-1
                worst = max(best[k - 1][i], prefix[j] - prefix[i])
                if worst < best[k][j]:
                    best[k][j], cut[k][j] = worst, i
    bounds, hi = [], n
    for k in range(n_parts, 0, -1):  # walk the cuts back from the end
        bounds.append((cut[k][hi], hi))
        hi = cut[k][hi]
    return bounds[::-1]


def partition(costs: Sequence[float], n_stages: int, n_chunks: int = 1) -> Plan:
    """The balanced plan of n_stages * n_chunks parts (part c*p + s: chunk c of stage s)."""
    bounds = balance(costs, n_stages * n_chunks)
    return Plan(tuple(bounds), tuple(float(sum(costs[lo:hi])) for lo, hi in bounds))


def stage_chunks(
    layers: Sequence[nn.Module], plan: Plan, stage: int, n_stages: int
) -> list[nn.Sequential]:
    """The model chunks of `stage`: chunk c is nn.Sequential(layers of part c*n_stages + stage).

    The layers are the caller's modules, not copies: build the model once per rank and keep
    only this stage's chunks. A layer must not share parameters with a layer of another stage
    (a tied weight would need its gradient summed across stages, which this does not do).
    """
    n_parts = len(plan.bounds)
    if n_parts % n_stages or not 0 <= stage < n_stages:
        raise ValueError(f"{stage=} of {n_stages=} does not fit a plan of {n_parts} parts")
    parts = range(stage, n_parts, n_stages)  # chunk c = part c * n_stages + stage
    return [nn.Sequential(*layers[plan.bounds[k][0] : plan.bounds[k][1]]) for k in parts]
