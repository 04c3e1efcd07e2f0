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
GRID_B = (1, 2, 4, 8)
MOST_V = 4  # interleaving: every factor of a stage's layers up to this
LONG = 16_384  # from this sequence length on, context parallelism is tried
GRID_CP = (2, 4, 8, 16, 32)
RECOMPUTES = ("none", "selective", "full")  # and "op" (TorchTitan's), when picked


def layouts(
    shape: Shape, cluster: Cluster, gpus: int, batch: int, scatter=True, ends=False, picked=None
):
    """Every layout worth a look: tp up to two nodes, cp (sequences of LONG tokens and more)
    up to 32, pp up to the layers (uneven stages allowed), ep dividing the experts and dp (a
    mixture of experts; with tp > 1 also its experts whole, etp = 1, and ep over tp's ranks
    first, then dp's), v every factor of a stage's layers up to MOST_V (pp > 1), b up to 8,
    every ZeRO stage, recompute, sp; ends (the embedding and the head as pipeline slots of their
    own) where pp > 1 if asked; plan.problems() filters. picked: {"tp": 3, "pp": ..., "v": ...,
    "b": ..., "m": microbatches, "cp": ..., "ep": ..., "etp": ..., "fp8": True,
    "recompute": ...}, held to one value, whatever the grid (so that plan.problems() says why
    a tp of 3 or a microbatch of 3 cannot run, instead of it never being tried); pp still
    divides gpus / (tp cp)."""
    picked = picked or {}
    g = cluster.gpus_per_node
    tps = [picked["tp"]] if "tp" in picked else [t for t in GRID_TP if t <= 2 * g]
    fp8 = picked.get("fp8", False)
    for tp in (t for t in tps if gpus % t == 0):
        for cp in (c for c in _cps(shape, picked) if (gpus // tp) % c == 0):
            rest = gpus // (tp * cp)
            pps = divisors(rest, shape.layers) if "pp" not in picked else [picked["pp"]]
            for pp in (p for p in pps if rest % p == 0):
                dp = rest // pp
                end = ends and pp > 1
                for etp, ep in _eps(shape, tp, dp, picked):
                    for v, zero, b, recompute, sp in _options(shape, tp, pp, dp, batch, picked):
                        yield Layout(
                            dp, pp, tp, v, zero, b, recompute, sp, scatter, end, cp, ep, fp8, etp
                        )


def _cps(shape: Shape, picked: dict) -> list[int]:
    """The context-parallel sizes to try: the picked one, or 1 and, for a long sequence,
    GRID_CP's that leave every rank two chunks of at least 1024 tokens."""
    if "cp" in picked:
        return [picked["cp"]]
    if shape.seq < LONG:
        return [1]
    return [1, *(c for c in GRID_CP if shape.seq % (2 * c) == 0 and shape.seq // c >= 2048)]


def _eps(shape: Shape, tp: int, dp: int, picked: dict) -> list[tuple[int, int]]:
    """(etp, ep) pairs to try: etp 0 (the experts cut over tp, as the dense layers) and, with
    tp > 1, 1 (whole experts: tp's ranks go to ep), or as picked; ep the picked one, or every
    one dividing the experts and its room (dp; tp x dp with etp = 1); for a dense model only
    the picked ones (plan.problems() refuses them), else (0, 1)."""
    if not shape.experts:
        return [(picked.get("etp", 0), picked.get("ep", 1))]
    etps = [picked["etp"]] if "etp" in picked else ([0, 1] if tp > 1 else [0])
    pairs = []
    for etp in etps:
        room = dp * (tp // etp if etp and tp % etp == 0 else 1)
        eps = [picked["ep"]] if "ep" in picked else divisors(shape.experts, room)
        pairs += [(etp, e) for e in eps if "ep" in picked or room % e == 0]
    return pairs


def divisors(n: int, most: int) -> list[int]:
    """The divisors of n up to most, smallest first: trials up to sqrt(n), so a million GPUs
    or a billion layers cost a thousand steps, not a million."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    every = sorted({*small, *(n // d for d in small)})
    return [d for d in every if d <= most]


def _options(shape: Shape, tp: int, pp: int, dp: int, batch: int, picked: dict):
    """(v, zero, b, recompute, sp) for every layout of this tp, pp and dp: v every factor of a
    stage's layers up to MOST_V (1 without a pipeline: its chunks would interleave with
    nothing), or as picked; b as GRID_B, or as picked, or batch / (dp m) for picked m;
    recompute RECOMPUTES, or as picked."""
    sps = (False, True) if tp > 1 else (False,)
    if "v" in picked:
        vs = [picked["v"]]
    else:
        vs = divisors(max(1, shape.layers // pp), MOST_V) if pp > 1 else [1]
    if "b" in picked:
        bs = [picked["b"]]
    elif "m" in picked:
        whole = batch % (dp * picked["m"]) == 0
        bs = [batch // (dp * picked["m"])] if whole else []
    else:
        bs = GRID_B
    recomputes = [picked["recompute"]] if "recompute" in picked else RECOMPUTES
    return product(vs, (0, 1, 2, 3), bs, recomputes, sps)


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
