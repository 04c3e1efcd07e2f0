"""What the planner knows from published runs: the efficiencies fitted on a few of them, and its
errors on all the others, from which every prediction's band is drawn.

Equals: nothing runs here; numbers. tests/test_published_runs.py fits CALIBRATED on three of
its rows and FRAMEWORK_COMPUTE on one row of each framework it holds, and checks
VALIDATION_ERRORS, each to 0.1%, on every other row of tests/published_runs.py.
Band: a run's real step is predicted / (1 + error); the middle 80% of VALIDATION_ERRORS (their
10th and 90th percentiles, interpolated between the sorted errors) bound it.
Ladder: Efficiency (what the formulas cannot know) -> CALIBRATED, FRAMEWORK_COMPUTE (fitted) ->
VALIDATION_ERRORS (checked) -> error_band (every prediction's).
Lesson: lessons/13_beyond_one_machine/.   Run: python tests/test_published_runs.py
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from minidist.cluster.hardware import Cluster


@dataclass(frozen=True)
class Efficiency:
    """What the formulas cannot know: the fraction of peak FLOP/s matmuls reach when their tiles
    fill the SMs (matmul_share takes the rest off), of the network cards' line rate NCCL's
    collectives reach (network), of that ZeRO-3's gathers and reduce-scatters reach
    (sharded). Which traffic hides behind compute is the framework's (cluster/profiles.py).
    Calibrated: CALIBRATED."""

    compute: float = 0.5
    network: float = 1.0
    sharded: float = 1.0  # ZeRO-3's gathers and reduce-scatters: of the network's bandwidth


# Fitted on three published runs (tests/published_runs.py), checked on every other one: compute
# on Megatron-LM's 145.6B on 1536 A100s (r06: Narayanan et al., SC 2021, table 1) and Llama 3
# 405B on 8,192 H100s (r38: Dubey et al., 2024, table 4, laid out as its section 3.3.2 says:
# ZeRO-2, an interleaved pipeline, ends, no recompute); sharded on ZeRO-3 with 174.6B on 1536
# A100s (r12: Narayanan et al., table 2), where gathered parameters and gradients dwarf the
# compute: its collectives reached 7.9% of the eight cards a node NCCL would drive (about one
# card's worth), which the H100 rows take too, having no ZeRO-3 run of their own to fit on.
# network is measured, not fitted: nccl-tests all_reduce_perf's bus bandwidth over the cards'
# line rate, A100 nodes 91 GB/s of 4 x 25 (two HGX A100 with four ConnectX-6 HDR each, 1-8 GB:
# NVIDIA/nccl-tests issue #100, 2022), NDR cards 48 of 50 GB/s ("CX-7 NICs at NDR rate
# (400Gbps) should achieve up to 48-49GB/s per NIC", NVIDIA, NVIDIA/nccl-tests issue #267).
# What hides behind compute is not fitted either: each run's framework says (cluster/profiles.py).
CALIBRATED = {
    "A100": Efficiency(compute=0.6796, network=0.91, sharded=0.0786),
    "H100": Efficiency(compute=0.5653, network=0.96, sharded=0.0786),
}


# What share of the calibrated compute rate a framework's runs reach (profiles.Profile.compute): 1
# but where fitted here, each on one run of the framework and checked on its others. The calibrated
# rates are Megatron-LM's (A100) and Llama 3's (H100); a framework's kernels and overheads make it
# faster or slower on the same GPUs and models.
# DeepSpeed's runs reach a smaller share of peak than Megatron-LM's, by more than their execution
# profiles explain: MT-NLG's 530B on 2,240 A100s under DeepSpeed's pipeline engine took 60.1 s for
# 1,920 sequences (Smith et al., 2022, as quoted), Megatron-LM's own 530B on 2,240 A100s 55.45 s for
# 2,240 (Narayanan et al., table 2): a sequence took 26% longer under DeepSpeed in the same tp 8 x
# pp 35 layout, 2 points of it the smaller batch's larger bubble; priced with the A100's compute,
# every DeepSpeed run of the table read fast (-11% to -28%, but where ZeRO-3's traffic, not compute,
# decides). Fitted on one run, BLOOM-176B on 384 A100s (r36: its training log's elapsed time per
# iteration, 104.70 s, the one DeepSpeed row read from its primary source, and nine-tenths compute
# in the plan), checked on the other nine. Fitted on A100s; a DeepSpeed plan on other GPUs takes it
# too, untested there.
# MosaicML's llm-foundry runs faster: at the calibrated rate, its attention priced as the Triton
# kernel its benchmarks ran (profiles.py, [LLM-FOUNDRY]), every MPT benchmark whose time is compute
# read slow, +4% to +19%, on H100s and A100s alike (MPT-13B on 64 H100s, whose ZeRO-3 traffic
# decides, +188%). Fitted on MPT-70B on 64 H100s (r41: the H100 rows' largest model and GPU count,
# 99.8% compute in the plan, and the least of its time in attention, whose H100 rate is a stand-in),
# checked on the other eight, five of them on A100s (the share taken for both).
FRAMEWORK_COMPUTE = {"deepspeed": 0.8815, "llm-foundry": 1.187}


def calibrated(cluster: Cluster) -> Efficiency:
    """The calibrated efficiencies of the cluster's GPU: as its calibration says, or by its
    name: Hopper's (H100, H200), else the A100's."""
    return CALIBRATED[generation(cluster)]


def generation(cluster: Cluster) -> str:
    """ "H100" or "A100": whose calibration the cluster's GPU takes (GPU.calibration, or its
    name: H100 and H200 are Hopper's)."""
    if cluster.gpu.calibration:
        return cluster.gpu.calibration
    hopper = any(name in cluster.gpu.name for name in ("H100", "H200"))
    return "H100" if hopper else "A100"


# The planner's own errors, predicted / reported - 1, on the published runs it was not calibrated
# on (tests/published_runs.py): tests/test_published_runs.py checks each to 0.1%, and
# error_band() reads them.
VALIDATION_ERRORS = {
    "r00": -0.073,
    "r01": -0.059,
    "r02": -0.045,
    "r03": -0.058,
    "r04": 0.005,
    "r05": -0.072,
    "r07": -0.015,
    "r08": -0.008,
    "r09": 0.041,
    "r10": -0.109,
    "r11": -0.001,
    "r13": -0.161,
    "r14": 0.124,
    "r15": 0.102,
    "r19": 0.01,
    "r20": 0.016,
    "r21": 0.024,
    "r22": -0.016,
    "r23": 0.021,
    "r24": 0.04,
    "r25": 0.062,
    "r26": 0.066,
    "r27": 0.088,
    "r28": 0.126,
    "r29": 0.128,
    "r30": 0.038,
    "r31": 0.066,
    "r32": -0.079,
    "r33": -0.09,
    "r34": -0.117,
    "r37": -0.188,
    "r39": 0.006,
    "r40": -0.155,
    "r42": 0.029,
    "r43": 1.881,
    "r44": -0.079,
    "r45": -0.049,
    "r46": 0.012,
    "r47": -0.062,
    "r48": 0.139,
    "r49": -0.029,
    "r50": -0.167,
    "r51": -0.245,
    "r52": -0.42,
    "r53": -0.052,
    "r54": -0.638,
    "r55": 0.012,
    "r56": -0.109,
    "r57": 0.051,
    "r58": -0.022,
    "r59": -0.03,
}


def error_band(seconds: float) -> tuple[float, float]:
    """(low, high) seconds: where a run predicted to take `seconds` fell, were its error one of
    the middle 80% of VALIDATION_ERRORS: reported = predicted / (1 + error), error between the
    errors' 10th and 90th percentiles (statistics.quantiles, inclusive: linear between the
    sorted errors). It holds for runs like the table's (its GPUs, frameworks and layouts)."""
    low, high = error_deciles()
    return seconds / (1 + high), seconds / (1 + low)


def error_deciles() -> tuple[float, float]:
    """The 10th and 90th percentiles of VALIDATION_ERRORS (statistics.quantiles, inclusive)."""
    deciles = statistics.quantiles(VALIDATION_ERRORS.values(), n=10, method="inclusive")
    return deciles[0], deciles[-1]
