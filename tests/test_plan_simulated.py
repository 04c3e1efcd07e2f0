"""The planner (plan.step) against the simulated cluster (simulate.py) on the toy 3D job.

The same shape, layout and cluster: plan.step's formulas on one side, minidist's own training
step (gpt/train.py) run on simulated ranks on the other, timed message by message and FLOP by
FLOP. Both are deterministic, so the ratio is pinned.

The cluster is a DGX H100 slowed down so that the toy sits where large runs sit: its links
10^4 times slower (a 4 KB activation is to the latency what GPT-3's 50 MB is on the real links),
its GPUs 10^5 times slower (compute dominates), and memory bandwidth unbounded (the simulator
charges FLOPs only, so the plan's optimizer term is left out). The toy trains in float32: e=4.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from minidist import cluster, plan
from minidist.gpt.model import GPTConfig
from minidist.gpt.train import TrainConfig, build_job, train_step
from minidist.simulate import simulate

H100 = cluster.preset("dgx-h100")
SLOW = replace(
    H100,
    gpu=replace(H100.gpu, peak_flops=H100.gpu.peak_flops / 1e5, memory_bw=float("inf")),
    intra=replace(H100.intra, bandwidth=H100.intra.bandwidth / 1e4),
    inter=replace(H100.inter, bandwidth=H100.inter.bandwidth / 1e4),
)
MODEL = GPTConfig(seq_len=16, d_model=32, n_heads=8, d_ff=128, n_layers=4)
pytestmark = pytest.mark.threads


def two_steps(comm, config: TrainConfig) -> list[float]:
    """This rank's clock after each of two training steps."""
    job, clocks = build_job(comm, config), []
    for _ in range(2):
        train_step(job)
        clocks.append(comm.me.clock)
    return clocks


def simulated_step(config: TrainConfig) -> float:
    """The second step's simulated seconds (the first is set-up free as well, but warms up)."""
    report = simulate(two_steps, SLOW, config.dp * config.pp * config.tp, config)
    return max(c[1] for c in report.results) - max(c[0] for c in report.results)


def planned_step(config: TrainConfig) -> float:
    m = config.model
    shape = plan.Shape("toy", m.n_layers, m.d_model, m.n_heads, m.d_ff, m.vocab_size, m.seq_len)
    b = config.batch // (config.dp * config.microbatches)
    # minidist's pipeline sends whole activations (no scatter over tp)
    x = plan.Layout(config.dp, config.pp, config.tp, config.chunks, config.zero, b, scatter=False)
    # minidist's main job syncs gradients after the whole pipeline step: no overlap; but ZeRO-3
    # gathers the next unit's parameters while this one computes, and reduce-scatters while the
    # next backward runs (zero3.py): as much overlap as there is compute
    eff = plan.Efficiency(compute=0.5, network=1.0, overlap=1.0 if config.zero == 3 else 0.0)
    return sum(plan.step(shape, x, SLOW, config.batch, eff, e=4).values())


# plan / simulated, pinned; every one within 5%. The 2x2x2 step: the plan spreads the logits
# over the stages, where the pipeline puts the head on the last stage (27% more compute there
# than on the first, which sets the pace), and the plan's pipeline messages wait on links the
# simulator lets overlap; 16 ranks: dp 4 of 2x2 ZeRO-3.
RATIOS = {
    (2, 1, 1, 0): 0.987,
    (1, 2, 1, 0): 0.971,
    (1, 1, 2, 0): 0.996,
    (2, 2, 2, 0): 0.976,
    (2, 2, 2, 3): 0.969,
}


@pytest.mark.parametrize("dp,pp,tp,zero", list(RATIOS))
def test_plan_and_simulated_step_agree(dp, pp, tp, zero):
    config = TrainConfig(dp, pp, tp, zero, microbatches=4, steps=2, batch=8 * dp, warmup=0)
    config = replace(config, model=MODEL)
    ratio = planned_step(config) / simulated_step(config)
    assert ratio == pytest.approx(RATIOS[dp, pp, tp, zero], abs=0.002)
    assert abs(ratio - 1) <= 0.05, ratio
