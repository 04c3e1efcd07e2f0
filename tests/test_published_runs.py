"""The planner against published large runs (tests/published_runs.py).

plan.CALIBRATED is fitted on three runs, and DeepSpeed's and llm-foundry's shares of its compute
rate (evidence.FRAMEWORK_COMPUTE) on one run each (CALIBRATION); on every other run the planner
predicts the step time of the published layout, and the error against what the source reports is
pinned in plan.VALIDATION_ERRORS (ERRORS here, checked to 0.1%) so that a change to the formulas
shows up as a change of numbers. Target: the median absolute error over the other runs at most 15%.
Second check: among the layouts with the run's own techniques (its recompute, sequence parallelism,
ZeRO stage, flash attention; without model parallelism where the run had none; its framework's
execution profile, published.PROFILE: what traffic hides behind compute, where ranks sit, and
whether its pipeline interleaves), the planner ranks first the published layout or one predicted
within 5% of it; RANKING pins the gap for every run.
`python tests/test_published_runs.py` prints the table lesson 13 shows (a test keeps them equal).
plan.error_band draws every prediction's band from the same errors (their middle 80%).
"""

from __future__ import annotations

import functools
import os
import statistics
from dataclasses import replace

import pytest

from minidist.cluster import hardware as cluster
from minidist.cluster import plan, profiles
from minidist.cluster import search as plan_search

try:
    from . import published_runs as published
except ImportError:  # run as a script
    import published_runs as published

CALIBRATION = ("r06", "r38", "r12", "r36", "r41")
pytestmark = pytest.mark.pure


def shape_of(rid: str) -> plan.Shape:
    row = published.RUNS[rid]
    L, h, a, kv, f, glu, V, s = published.SHAPES[row[0]]
    dropout = row[1] not in published.NO_DROPOUT
    more = published.SHAPE_MORE.get(row[0], {})
    return plan.Shape(rid, L, h, a, f, V, s, kv, glu, dropout, row[1] in published.TIED, **more)


def cluster_of(rid: str) -> cluster.Cluster:
    gpu, gb = published.RUNS[rid][2:4]
    c = cluster.preset("dgx-h100" if gpu == "H100" else "dgx-a100")
    bw = published.MEMORY_BW.get(published.RUNS[rid][1], c.gpu.memory_bw)
    return replace(c, gpu=replace(c.gpu, memory=gb * 1e9, memory_bw=bw))


def layout_of(rid: str) -> plan.Layout:
    _, source, _, _, gpus, tp, pp, v, zero, b, _, recompute, sp, _ = published.RUNS[rid]
    ends = source in published.ENDS or rid in published.ENDS
    more = published.MORE.get(rid, {})
    dp = gpus // (tp * pp * more.get("cp", 1))
    return plan.Layout(dp, pp, tp, v, zero, b, recompute, bool(sp), ends=ends, **more)


def published_seconds(rid: str) -> float:
    """The iteration time the source reports, or implies by its MFU or TFLOP/s."""
    shape = shape_of(rid)
    c = cluster_of(rid)
    what, value = published.REPORTED[rid]
    gpus, batch = published.RUNS[rid][4], published.RUNS[rid][10]
    tokens = batch * shape.seq
    if what == "seconds":
        return value
    if what == "mfu":
        return tokens * 3 * shape.forward_flops_per_token() / (value * gpus * c.gpu.peak_flops)
    if what == "tokens":  # tokens a second a GPU
        return tokens / (value * gpus)
    return tokens * shape.step_flops_per_token("full") / (value * 1e12 * gpus)


def efficiency_of(rid: str) -> plan.Efficiency:
    """The calibrated efficiencies of the run's GPU."""
    return plan.calibrated(cluster_of(rid))


def profile_of(rid: str) -> profiles.Profile:
    """The run's framework, as published.PROFILE names it (a row of its own first)."""
    name = published.PROFILE.get(rid) or published.PROFILE[published.RUNS[rid][1]]
    return profiles.PROFILES[name]


def predicted(rid: str, layout=None, eff=None) -> plan.Plan:
    row = published.RUNS[rid]
    c = cluster_of(rid)
    eff = eff or efficiency_of(rid)
    x = layout or layout_of(rid)
    shape, flash, profile = shape_of(rid), bool(row[13]), profile_of(rid)
    got = plan.evaluate(shape, x, c, row[4], row[10], eff, flash, profile=profile)
    if got.memory and not got.parts:  # refused for its memory alone: priced all the same
        parts = plan.step(shape, x, c, row[10], eff, flash=flash, profile=profile)
        got = replace(got, parts=parts)
    return got


def error(rid: str, eff=None) -> float:
    return predicted(rid, eff=eff).seconds / published_seconds(rid) - 1


@functools.cache
def ranked(rid: str, own_memory: bool = False) -> tuple:
    """(the published layout's plan, the feasible plans with the same techniques, fastest
    first). own_memory: the GPU's memory widened until the published layout just fits, the
    rivals held to the same."""
    row, mine = published.RUNS[rid], layout_of(rid)

    def same(x: plan.Layout) -> bool:
        techniques = (x.recompute, x.sp, x.zero) == (mine.recompute, mine.sp, mine.zero)
        model_parallel = mine.tp * mine.pp > 1 or x.tp * x.pp == 1
        return techniques and model_parallel

    c = cluster_of(rid)
    eff = efficiency_of(rid)
    flash = bool(row[13])
    if own_memory:
        need = sum(predicted(rid).memory.values()) / 0.9  # evaluate()'s headroom
        c = replace(c, gpu=replace(c.gpu, memory=max(c.gpu.memory, need * (1 + 1e-9))))
    profile = profile_of(rid)
    ours = plan.evaluate(shape_of(rid), mine, c, row[4], row[10], eff, flash, profile=profile)
    picked = {"recompute": mine.recompute}  # TorchTitan's "op" is no grid's
    ok, _ = plan_search.search(
        shape_of(rid),
        c,
        row[4],
        row[10],
        eff,
        flash,
        same,
        ends=mine.ends,
        picked=picked,
        profile=profile,
    )
    return ours, ok


def ranking_gap(rid: str, own_memory: bool = False) -> float:
    """The published layout's predicted time over the best one's with the same techniques,
    minus 1 (inf if the published layout does not fit the planner's memory model)."""
    ours, ok = ranked(rid, own_memory)
    if ours.why_not:
        return float("inf")
    best = min([ours, *ok], key=lambda q: q.seconds)
    return ours.seconds / best.seconds - 1


OTHERS = [rid for rid in published.RUNS if rid not in CALIBRATION]

INF = float("inf")
# the planner's error on every run not used to calibrate it (predicted / reported - 1)
ERRORS = plan.VALIDATION_ERRORS  # pinned there: plan.error_band draws from them
# the gap between the published layout and the planner's first with the same techniques; INF:
# the planner's memory model does not fit the published layout (Llama 3 with every technique
# its section 3.3.2 states, ZeRO-2, sp, v = 8, ends: 82.2 GB a GPU, 75.1 GB of it activations,
# 141 layer-microbatches in flight on the second stage under Megatron-LM's interleaved schedule;
# the paper's own schedule, tunable in N, and its deallocations fit 80 GB, unquantified; within
# the memory it needs, it ranks first: test_llama3_ranks_first_among_the_layouts_that_fit_...)
RANKING = {
    "r00": 0.0,
    "r01": 0.024,
    "r02": 0.0,
    "r03": 0.078,
    "r04": 0.154,
    "r05": 0.001,
    "r06": 0.015,
    "r07": 0.011,
    "r08": 0.0,
    "r09": 0.045,
    "r10": 0.0,
    "r11": 0.0,
    "r12": 0.0,
    "r13": 0.0,
    "r14": 0.0,
    "r15": 0.0,
    "r19": 0.011,
    "r20": 0.022,
    "r21": 0.058,
    "r22": 0.0,
    "r23": 0.041,
    "r24": 0.005,
    "r25": 0.009,
    "r26": 0.0,
    "r27": 0.0,
    "r28": 0.0,
    "r29": 0.045,
    "r30": 0.0,
    "r31": 0.0,
    "r32": 0.028,
    "r33": 0.0,
    "r34": 0.022,
    "r36": 0.012,
    "r37": 0.073,
    "r38": INF,
    "r39": INF,
    "r40": INF,
    "r41": 0.0,
    "r42": 0.0,
    "r43": 0.0,
    "r44": 0.0,
    "r45": 0.0,
    "r46": 0.0,
    "r47": 0.0,
    "r48": 0.0,
    "r49": 0.0,
    "r50": 0.0,
    "r51": 0.0,
    "r52": 0.0,
    "r53": 0.0,
    "r54": 0.0,
    "r55": INF,
    "r56": 0.0,
    "r57": 0.353,
    "r58": 0.424,
    "r59": 0.0,
}


def test_calibration_reproduces_its_runs():
    for rid in CALIBRATION[:2]:  # the compute efficiencies: these two runs exactly
        assert abs(error(rid)) < 0.002, (rid, error(rid))
    assert abs(error("r12")) < 0.002, error("r12")  # ZeRO-3's sharded-traffic efficiency
    for rid in ("r36", "r41"):  # DeepSpeed's and llm-foundry's shares of the compute rate
        assert abs(error(rid)) < 0.002, (rid, error(rid))


def test_errors_are_pinned_and_the_median_is_at_most_15_percent():
    got = {rid: round(error(rid), 3) for rid in OTHERS}
    assert got == pytest.approx(ERRORS, abs=0.0011)
    assert statistics.median(abs(e) for e in got.values()) <= 0.15


def test_the_error_band_is_drawn_from_these_errors():
    # the band is the pinned errors' middle 80%, the 10th and 90th percentiles interpolated
    # between the sorted errors
    errors = sorted(ERRORS.values())

    def percentile(f: float) -> float:
        at = f * (len(errors) - 1)
        below = int(at)
        return errors[below] + (at - below) * (errors[below + 1] - errors[below])

    low, high = plan.error_band(10.0)
    assert (low, high) == pytest.approx((10 / (1 + percentile(0.9)), 10 / (1 + percentile(0.1))))
    inside = [e for e in errors if percentile(0.1) <= e <= percentile(0.9)]
    assert abs(len(inside) / len(errors) - 0.8) < 0.05, len(inside)  # 41 of 51 runs


def test_the_plan_ranks_the_published_layout_first_or_within_5_percent():
    got = {rid: round(ranking_gap(rid), 3) for rid in published.RUNS}
    assert got == pytest.approx(RANKING, abs=0.0011)
    misses = sorted(rid for rid, gap in got.items() if gap > 0.05)
    # Megatron-LM 18.4B and 39.1B: the planner prefers tp4 pp2 and tp2 pp8, both interleaved
    # (7.8%, 15.4% faster), to the published tp8, whose six all-reduces of every activation per
    # layer cost 13% and 9% of the step on NVLink, against 6% and 2% for the smaller tp and a
    # bubble of 3% and 4%; GPT-NeoX-20B: the planner prefers dp 32 x pp 3 x tp 1 (7.6%
    # faster): a smaller bubble (48 microbatches of 1, not 32 of 4: 1.3 s against 2.8) and no
    # tensor-parallel all-reduces (0.7 s); Llama 3: see RANKING; PTD 529.6B on 2240 GPUs: the
    # planner prefers the same tp8 pp35 interleaved by 3 (5.8% faster: a third of the bubble),
    # as the paper's table 1 ran the same model on the same tp8 pp35 with v = 3 (163 TFLOP/s on
    # 2520 GPUs, 280 microbatches as here, against this row's 159): v = 1 is the row's
    # assumption (published.ASSUMED); Llama 3's long-context stage (r40): memory, as r38 and
    # r39 (82 GB a GPU in the model); Megatron-Bridge's Llama 3 70B (r55): memory, 76.8 GB a
    # GPU in the model (52.8 GB of activations: every one stored at 2 bytes, the 1F1B
    # schedule's microbatches in flight on the first stage), over the 72 GB the plan allows
    # itself of 80; what the run kept in FP8 or freed early is not published; Qwen3-235B-A22B
    # (r57): the planner prefers tp 2 x pp 4 x dp 32 with ep 8 over tp and dp (35.3% faster),
    # whose ep group is one node's in Megatron-Core's rank order, where the published ep 32
    # spans four nodes: 12.9 s of all-to-alls, exposed in the planner, which the run's preset
    # overlaps with compute (moe_a2a_overlap, not priced: lesson 13's misses); Qwen3-30B-A3B on
    # 26.06 (r58): the planner prefers ep 8 on one node with microbatches of 2 (42.4% faster),
    # since it prices the published ep 16's all-to-alls across two nodes at 17.2 s, each token's
    # copies to its experts on the other node sent over the network one by one; the run's flex
    # dispatcher (moe_flex_dispatcher_backend="hybridep") forwards between NVLink and the
    # network as DeepEP's kernels do (DeepEP's README), which is not modelled
    want = ["r03", "r04", "r21", "r37", "r38", "r39", "r40", "r55", "r57", "r58"]
    assert misses == want, misses


def test_llama3_ranks_first_among_the_layouts_that_fit_its_own_memory():
    # the misses r38, r39, r40 are memory, not time: given the 82.2 GB the memory model says the
    # published layout needs, no layout with its techniques that fits the same is faster
    for rid in ("r38", "r39", "r40"):
        ours, rivals = ranked(rid, own_memory=True)
        assert not ours.why_not and rivals, (rid, ours.why_not)  # rivals fit the same memory
        assert ranking_gap(rid, own_memory=True) == 0.0, (rid, ranking_gap(rid, own_memory=True))


def table() -> str:
    """The markdown table lesson 13 shows: every run, reported and predicted seconds."""
    lines = ["| run | GPUs | layout | reported s | predicted s | error | ranking gap |"]
    lines.append("|---|---|---|---|---|---|---|")
    for rid in published.RUNS:
        x, row = layout_of(rid), published.RUNS[rid]
        layout = f"tp{x.tp} pp{x.pp} dp{x.dp} {x.recompute}"
        layout += (f" cp{x.cp}" if x.cp > 1 else "") + (" fp8" if x.fp8 else "")
        err = "calibration" if rid in CALIBRATION else f"{error(rid):+.1%}"
        gap = ranking_gap(rid)
        gap = "does not fit" if gap == float("inf") else f"{gap:+.1%}"
        name = published.NAMES[rid]
        pub, pred = published_seconds(rid), predicted(rid).seconds
        lines.append(f"| {name} | {row[4]} | {layout} | {pub:.2f} | {pred:.2f} | {err} | {gap} |")
    return "\n".join(lines)


def test_lesson_13_shows_this_table():
    here = os.path.dirname(os.path.abspath(__file__))
    readme = os.path.join(here, "..", "lessons", "13_beyond_one_machine", "README.md")
    assert table() in open(readme).read(), "run python tests/test_published_runs.py"


if __name__ == "__main__":
    print(table())
    print({rid: round(error(rid), 3) for rid in OTHERS})
    print({rid: round(ranking_gap(rid), 3) for rid in published.RUNS})
