"""Searching a run's layouts: every way to cut a GPU count, each judged by plan.evaluate, the
feasible ones ranked by their step time.

Equals: nothing runs here; the verdicts are cluster/plan.py's formulas, one layout at a time. A
layout is listed if its dimensions multiply to the GPU count and tp stays within two nodes
(a dimension the user picks takes the picked value, on the grid or not);
plan.problems() refuses the rest with the numbers (divisibility, memory).
Ladder: plan.Shape, plan.Layout -> plan.evaluate -> search -> plan_cli (`minidist plan`).
Lesson: lessons/13_beyond_one_machine/.
Run: minidist plan --model llama-70b --cluster dgx-h100 --gpus 512 --batch 1024
"""

from __future__ import annotations

import math
import sys
from itertools import product

from tqdm import tqdm

from minidist.cluster.hardware import Cluster
from minidist.cluster.plan import Layout, Shape, calibrated, evaluate

GRID_TP = (1, 2, 4, 8, 16)  # up to two nodes of 8
GRID_V = (1, 2, 4)
GRID_B = (1, 2, 4, 8)


def layouts(
    shape: Shape, cluster: Cluster, gpus: int, batch: int, scatter=True, ends=False, picked=None
):
    """Every layout worth a look: tp up to two nodes, pp up to the layers (uneven stages
    allowed), b up to 8, v up to 4 (pp > 1), every ZeRO stage, recompute, sp; ends (the
    embedding and the head as pipeline slots of their own) where pp > 1 if asked;
    plan.problems() filters. picked: {"tp": 3, "pp": ..., "v": ..., "b": ...}, a dimension held
    to one value, whatever the grid (so that plan.problems() says why a tp of 3 or a microbatch
    of 3 cannot run, instead of it never being tried); pp still divides gpus / tp."""
    picked = picked or {}
    tps = (
        [picked["tp"]] if "tp" in picked else [t for t in GRID_TP if t <= 2 * cluster.gpus_per_node]
    )
    for tp in (t for t in tps if gpus % t == 0):
        pps = divisors(gpus // tp, shape.layers) if "pp" not in picked else [picked["pp"]]
        for pp in (p for p in pps if (gpus // tp) % p == 0):
            for v, zero, b, recompute, sp in _options(tp, picked):
                if v == 1 or pp > 1:  # chunks of one stage interleave with nothing
                    dp, end = gpus // (tp * pp), ends and pp > 1
                    yield Layout(dp, pp, tp, v, zero, b, recompute, sp, scatter, end)


def divisors(n: int, most: int) -> list[int]:
    """The divisors of n up to most, smallest first: trials up to sqrt(n), so a million GPUs
    or a billion layers cost a thousand steps, not a million."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    every = sorted({*small, *(n // d for d in small)})
    return [d for d in every if d <= most]


def _options(tp: int, picked: dict):
    """(v, zero, b, recompute, sp) for every layout of this tp (v and b as picked, if)."""
    sps = (False, True) if tp > 1 else (False,)
    vs = [picked["v"]] if "v" in picked else GRID_V
    bs = [picked["b"]] if "b" in picked else GRID_B
    return product(vs, (0, 1, 2, 3), bs, ("none", "selective", "full"), sps)


def search(
    shape,
    cluster,
    gpus,
    batch,
    eff=None,
    flash=True,
    allowed=None,
    e=2,
    scatter=True,
    ends=False,
    picked=None,
    profile=None,
) -> tuple[list, list]:
    """(feasible plans, fastest first; the infeasible ones) over the layouts() allowed(x) takes
    (default all). eff: plan.calibrated(cluster) unless given; e, scatter, ends, profile: as
    plan.step() and plan.Layout; picked: as layouts()."""
    eff = eff or calibrated(cluster)
    candidates = layouts(shape, cluster, gpus, batch, scatter, ends, picked)
    candidates = [x for x in candidates if allowed is None or allowed(x)]
    # a GPU count with many divisors (720,720 has 240) means 10^5 layouts, tens of seconds: a bar
    quiet = len(candidates) < 20_000 or not sys.stderr.isatty()
    bar = tqdm(candidates, "pricing layouts", disable=quiet, leave=False)
    plans = [
        evaluate(shape, x, cluster, gpus, batch, eff, flash, e=e, profile=profile) for x in bar
    ]
    ok = sorted((q for q in plans if not q.why_not), key=lambda q: q.seconds)
    return ok, [q for q in plans if q.why_not]
