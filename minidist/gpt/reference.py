"""The single-process check of the main job: the program every dp x pp x tp layout must equal
(train_full), and how far a run is from it (differences, within TOLERANCES). The distributed
model is put back together to compare by gather.py.

Equals: train_full is the reference itself: model.GPT, full, on the full batch, the same
batches, AdamW (with the same weight-decay groups: optimizer.decay_groups),
learning-rate schedule and precision as train.py's ranks, run by the same loop (loop.run);
any cp and tp alike (the same model cut otherwise); with experts, each block routes the batch
in the groups the ranks' microbatches make (moe_block.group_blocks): one per dp rank, microbatch and
cp rank, whatever ep.
Communication: none (one process).
Memory: the full model and its optimizer state, in the run's dtype.
Lesson: lessons/12_3d_parallel/.   Run: minidist train --dp 2 --pp 2 --tp 2 --check
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minidist.expert_parallel.moe_block import group_blocks
from minidist.gpt import context
from minidist.gpt import model as gpt
from minidist.gpt.config import DTYPES, TrainConfig
from minidist.gpt.data import batch_at, load_bytes
from minidist.gpt.loop import run
from minidist.gpt.optimizer import grouped_optimizer, make_scaler
from minidist.large_batches.lr import WarmupDecay, lr_at
from minidist.mixed_precision.amp import LossScaler, MixedPrecisionOptimizer


@dataclass
class FullJob:
    """The single-process run: the full model, its optimizer (AdamW over decay_groups, or amp's
    masters), loss scaler and schedule, stepped by step_full."""

    config: TrainConfig
    model: gpt.GPT
    optimizer: object
    scaler: LossScaler
    schedule: WarmupDecay
    data: torch.Tensor
    step: int = 0


def full_job(config: TrainConfig, data=None) -> FullJob:
    """The single-process program every layout must equal: the full model on the full batch,
    same batches, same AdamW, same schedule, same precision."""
    model = gpt.GPT(config.model, DTYPES[config.dtype])
    # MoE: the ranks' groups, each b T / cp tokens (b = B / (dp m)), the aux loss their mean
    m = config.dp * config.microbatches
    cp = config.cp
    t = config.model.seq_len
    order = context.token_order(config.batch, t, cp, config.batch // m) if cp > 1 else None
    group_blocks(model, config.batch // m * t // cp, 1 / (m * cp), order)
    groups = grouped_optimizer(config, model)  # as every rank: AdamW over decay_groups
    scaler = make_scaler(config.amp)
    if config.amp != "fp32":
        optimizer = MixedPrecisionOptimizer(model, groups, config.precision, scaler)
    else:
        optimizer = groups()
    schedule = WarmupDecay(optimizer, config.warmup, config.steps)
    data = load_bytes() if data is None else data
    return FullJob(config, model, optimizer, scaler, schedule, data)


def step_full(job: FullJob) -> tuple[float, bool]:
    """One step of the single-process run: (the full batch's mean loss, stepped)."""
    c = job.config
    ids, targets = batch_at(job.data, job.step, c.batch, c.model.seq_len, c.seed)  # (B, T)
    loss = gpt.loss_full(job.model(ids), targets)
    (loss * job.scaler.scale).backward()
    stepped = job.optimizer.step()  # amp: False where skipped (inf/nan); AdamW: None
    job.optimizer.zero_grad()
    job.schedule.step()
    job.step += 1
    return loss.item(), stepped is not False


def train_full(config: TrainConfig, data=None, on_step: Callable | None = None) -> dict:
    """full_job trained config.steps steps by the main job's loop (loop.run, on_step(job, loss,
    stepped) after each): its result, with "parameters" each layer's, flat, in float64."""
    job = full_job(config, data)
    result = run(job, step_full, config.steps, on_step)
    flat = lambda layer: torch.cat([q.detach().double().reshape(-1) for q in layer.parameters()])  # noqa: E731
    return result | {"parameters": [flat(layer) for layer in job.model.layers]}


# the largest relative differences --check accepts, and why:
# float64: sums in another order (losses); AdamW's division by sqrt(v) + eps lets the last bits
#   of near-eps gradient elements move a parameter by ~1e-12 of the largest (see test_train).
# float32: the same, 2^29 times coarser, grown over the steps: measured 1e-7 (loss) and 3e-4
#   (parameters) after 60 steps of the demo.
# bf16/fp16: the loss curve within 1e-2 (the model's own rounding, 2^-8 or 2^-11, in another
#   order: measured ~3e-4, bf16). The parameters by amp_tolerance below, layer by layer: not by
#   their largest difference, which AdamW makes 2 lr a step for any weight whose gradient is
#   within rounding of zero (its step is +-lr whatever the gradient's size: measured 0.07 of a
#   layer's largest weight after one bf16 step, 0.2 after 60), in bf16 and fp16 alike.
TOLERANCES = {"float64": (1e-12, 1e-10), "float32": (1e-5, 2e-3), "amp": (1e-2, None)}
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}  # u: half the gap between neighbours at 1
# the weights whose step can flip, per step: at most FLIPS * u_bf16 of them, in either format
# (measured: 0.2% of a block's weights at the first step, bf16 and fp16 alike: lesson 09)
FLIPS = 4


def amp_tolerance(config: TrainConfig, weights_rms: float) -> float:
    """The relative RMS difference (||x - y|| / ||y||) of one layer's final weights that --check
    accepts in bf16 or fp16, for a layer whose reference weights have RMS weights_rms:

        sqrt((2u)^2 + FLIPS u sum_t (2 lr_t / weights_rms)^2)

    with u the format's unit roundoff. The first term: the weights compared are the model's
    copies, rounded to the format; two runs whose masters differ at all can round a weight one
    unit in the last place apart, 2u of it at most. The second: each step, the weights whose
    gradient is within rounding noise of zero (at most a fraction FLIPS u_bf16, in bf16 and
    fp16 alike) may step +-lr_t in one run and -+lr_t in the other, 2 lr_t apart; independent
    from step to step, they add in quadrature over the schedule's rates lr_t: the run's length.
    Lesson 09 derives it and measures both terms."""
    u = UNIT_ROUNDOFF[config.amp]
    rates = [lr_at(t, config.lr, config.warmup, config.steps) for t in range(config.steps)]
    flips = FLIPS * UNIT_ROUNDOFF["bf16"] * sum((2 * lr / weights_rms) ** 2 for lr in rates)
    return math.sqrt((2 * u) ** 2 + flips)


def differences(result: dict, reference: dict, config: TrainConfig | None = None) -> dict:
    """The largest relative difference of the loss curves and of the final parameters (each
    layer's largest difference over its largest value), and each layer's relative RMS
    difference (parameters_rms); with config, "ok": within TOLERANCES, and in bf16 or fp16 every
    layer's RMS difference within amp_tolerance (tolerance["parameters_rms"], per layer)."""
    first = result.get("first_step", 0)  # a resumed run: its steps only
    a = torch.tensor(result["losses"], dtype=torch.float64)
    b = torch.tensor(reference["losses"][first : first + len(a)], dtype=torch.float64)
    loss = ((a - b).abs() / b.abs().clamp_min(1e-30)).max().item()
    params = max(
        ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
        for x, y in zip(result["parameters"], reference["parameters"], strict=True)
    )
    pairs = list(zip(result["parameters"], reference["parameters"], strict=True))
    rms = [((x - y).norm() / y.norm().clamp_min(1e-30)).item() for x, y in pairs]
    found = {"loss": loss, "parameters": params, "parameters_rms": rms}
    found["same_skipped_steps"] = result["skipped"] == [
        k for k in reference["skipped"] if k >= first
    ]
    if config is not None:
        loss_tol, param_tol = TOLERANCES["amp" if config.amp != "fp32" else config.dtype]
        found["tolerance"] = {"loss": loss_tol, "parameters": param_tol, "parameters_rms": None}
        found["ok"] = loss <= loss_tol and (param_tol is None or params <= param_tol)
        if config.amp != "fp32":  # never skipped: each layer within its own tolerance
            tol = [amp_tolerance(config, y.pow(2).mean().sqrt().item()) for _, y in pairs]
            found["tolerance"]["parameters_rms"] = tol
            found["ok"] = found["ok"] and all(d <= t for d, t in zip(rms, tol, strict=True))
    return found
