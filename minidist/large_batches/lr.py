"""Learning rates for large batches: scale the rate with the batch (linear or square-root rule),
warm it up linearly, then decay it; a scheduler that drives any torch optimizer.

Equals: the formulas below at every step (tests/test_lr.py checks the shapes they define).
Communication per step, per rank: none. Memory: one float per parameter group.
Formulas (batch B from a base batch B0 tuned with rate lr0; k = B / B0):
    linear rule:   lr = lr0 * k               (k steps of B0 ~ one step of k B0, Goyal et al.)
    sqrt rule:     lr = lr0 * sqrt(k)         (keeps the gradient noise's variance per step)
    step s < W:    lr(s) = peak * (start + (1 - start) (s + 1) / W)     (linear warm-up)
    step s >= W:   t = min(1, (s - W) / max(1, T - W))
                   lr(s) = peak * (final + (1 - final) f(t)),
                   f = 1 (constant), 1 - t (linear), (1 + cos(pi t)) / 2 (cosine)
    start, final: fractions of the peak (Goyal et al. warm up from the small-batch rate: 1/k).
Why warm-up: at initialisation the loss surface is steep and the gradient large; k times the
rate on step 0 can throw the weights far enough that training never recovers (or recovers
late). Ramping up over W steps lets the first steps be small, as a small batch's would be.
Ladder: scaled_lr (the rule) -> lr_at (warm-up then decay, a pure function of the step) ->
WarmupDecay (sets every param group's rate before each optimizer step).
Paper: Goyal et al., Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour (2017),
sections 2.1 (linear scaling) and 2.2 (warm-up); Krizhevsky, One weird trick for parallelizing
convolutional neural networks (2014), section 5 (square-root rule); Loshchilov and Hutter, SGDR
(ICLR 2017), section 3 (cosine).   Lesson: lessons/11_large_batches/.
Run: minidist bench batch

Usage:

    lr = scaled_lr(0.1, base_batch=32, batch=512, rule="linear")       # 1.6
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)    # the peak rate
    schedule = WarmupDecay(opt, warmup_steps=20, total_steps=200, start=32 / 512)
    for step in range(200):
        ...; opt.step(); schedule.step()                              # lr for the next step
"""

from __future__ import annotations

import math

import torch

RULES = ("linear", "sqrt", "none")
DECAYS = ("constant", "linear", "cosine")


def scaled_lr(base_lr: float, base_batch: int, batch: int, rule: str = "linear") -> float:
    """The rate for `batch`, from `base_lr` tuned at `base_batch`, by the linear or sqrt rule."""
    if base_batch < 1 or batch < 1:
        raise ValueError(f"base_batch={base_batch} and batch={batch} must be at least 1")
    k = batch / base_batch
    if rule == "linear":
        return base_lr * k
    if rule == "sqrt":
        return base_lr * math.sqrt(k)
    if rule == "none":
        return base_lr
    raise ValueError(f"rule={rule!r} is not one of {RULES}")


def check_schedule(warmup_steps: int, total_steps: int, decay: str, start: float, final: float):
    """Raise ValueError, with the numbers, unless the schedule's settings make sense."""
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"need 0 <= warmup_steps={warmup_steps} <= total_steps={total_steps}")
    if decay not in DECAYS:
        raise ValueError(f"decay={decay!r} is not one of {DECAYS}")
    if not (0 <= start <= 1 and 0 <= final <= 1):
        raise ValueError(f"start={start} and final={final} are fractions of the peak: in [0, 1]")


def lr_at(
    step: int,
    peak: float,
    warmup_steps: int,
    total_steps: int,
    decay: str = "cosine",
    start: float = 0.0,
    final: float = 0.0,
) -> float:
    """The rate of (0-based) `step`: linear warm-up over warmup_steps, then `decay` to
    final * peak at total_steps, and final * peak after it (see the module docstring)."""
    check_schedule(warmup_steps, total_steps, decay, start, final)
    if step < warmup_steps:
        # lab 11.1 begin: linear from start * peak, reaching peak on step warmup_steps - 1
        return peak * (start + (1 - start) * (step + 1) / warmup_steps)
        # lab 11.1 end
    # lab 11.2 begin: t in [0, 1] since warm-up ended; constant, linear or cosine down to final
    t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay == "constant":
        shape = 1.0
    elif decay == "linear":
        shape = 1.0 - t
    else:
        shape = (1.0 + math.cos(math.pi * t)) / 2
    return peak * (final + (1 - final) * shape)
    # lab 11.2 end


class WarmupDecay:
    """Sets each param group's rate to lr_at(step, that group's peak, ...) before every step.

    The peaks are the groups' rates when the scheduler is made (set them with scaled_lr), so
    groups with different rates keep their ratio. Call step() after optimizer.step(): it
    advances to the next step's rate. Works with any torch.optim optimizer (anything with
    param_groups), e.g. the master-weights optimizer of minidist.mixed_precision.amp.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int,
        total_steps: int,
        decay: str = "cosine",
        start: float = 0.0,
        final: float = 0.0,
    ):
        check_schedule(warmup_steps, total_steps, decay, start, final)
        self.optimizer = optimizer
        self.settings = dict(
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            decay=decay,
            start=start,
            final=final,
        )
        self.peaks = [group["lr"] for group in optimizer.param_groups]
        self.step_count = 0
        self._apply()

    def _apply(self) -> None:
        for group, peak in zip(self.optimizer.param_groups, self.peaks, strict=True):
            group["lr"] = lr_at(self.step_count, peak, **self.settings)

    def step(self) -> None:
        """Move to the next step and set its rates."""
        self.step_count += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The rates the optimizer uses on its next step, one per param group."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "peaks": list(self.peaks), **self.settings}

    def load_state_dict(self, state: dict) -> None:
        self.step_count, self.peaks = state["step_count"], list(state["peaks"])
        self.settings = {k: state[k] for k in self.settings}
        self._apply()
