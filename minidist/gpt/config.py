"""The main job's configuration: everything a run depends on, the same on every rank, and every
reason a run cannot start, with the numbers, before any process starts work.

TrainConfig names the layout (dp x pp x cp x tp, ep carved out of dp), the techniques (ZeRO
stage, microbatches and schedule, mixed precision, recomputation), the optimizer, the data and
the model (model.GPTConfig). problems() lists what does not fit together; check() raises them.
Lesson: lessons/12_3d_parallel/.   Run: minidist train --dp 2 --pp 2 --tp 2 --check
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minidist.gpt import context, moe
from minidist.gpt import model as gpt
from minidist.gpt.data import SONNETS
from minidist.mesh import Layout
from minidist.mixed_precision.amp import PRECISIONS, Precision
from minidist.pipeline.schedules import NAMES, build_schedules

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; the same on every rank."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallel, carved out of dp (with model.experts: moe.py)
    cp: int = 1  # context parallel: each rank T/cp tokens of every sequence (context.py)
    zero: int = 0  # 0: data parallel; 1, 2, 3: ZeRO stage
    microbatches: int = 1
    schedule: str = "1f1b"
    chunks: int = 1  # model chunks per pipeline stage (the interleaved schedule)
    amp: str = "fp32"  # fp32 | bf16 | fp16: the compute dtype; masters stay in dtype
    checkpointing: bool = False  # recompute every block's activations in backward
    steps: int = 50
    batch: int = 16  # sequences per step, over all dp ranks
    lr: float = 3e-3
    weight_decay: float = 0.1  # AdamW's, on the weight matrices only (decay_groups)
    warmup: int = 5
    dtype: str = "float32"  # parameters and optimizer (float64: the tight check)
    seed: int = 0  # the batches; the model's seed is model.seed
    model: gpt.GPTConfig = field(default_factory=gpt.GPTConfig)

    @property
    def layout(self) -> Layout:
        return Layout(self.dp, self.pp, self.tp, self.ep, self.cp)

    @property
    def precision(self) -> Precision:
        """The dtype of each role: compute from amp, masters and gradient sums in dtype."""
        master = DTYPES[self.dtype]
        compute = master if self.amp == "fp32" else PRECISIONS[self.amp].compute
        return Precision(compute, master, master)

    @property
    def counts(self) -> dict[str, int]:
        """The numbers that count something: each at least 1."""
        m = self.model
        return {
            "dp": self.dp,
            "pp": self.pp,
            "tp": self.tp,
            "ep": self.ep,
            "cp": self.cp,
            "microbatches": self.microbatches,
            "chunks": self.chunks,
            "steps": self.steps,
            "batch": self.batch,
            "seq_len": m.seq_len,
            "d_model": m.d_model,
            "n_heads": m.n_heads,
            "d_ff": m.d_ff,
            "n_layers": m.n_layers,
        }

    def problems(self, world_size: int | None = None) -> list[str]:
        """Every reason this run cannot start, with the numbers; [] if it can."""
        found = []
        for name, value in self.counts.items():
            _require(found, value >= 1, f"{name}={value} must be at least 1")
        finite = math.isfinite(self.lr) and self.lr > 0
        _require(found, finite, f"lr={self.lr} must be a finite number > 0")
        _require(found, self.warmup >= 0, f"warmup={self.warmup} must be at least 0")
        if found:
            return found  # the checks below divide by these numbers
        world = self.dp * self.pp * self.cp * self.tp
        return self._layout_problems(world if world_size is None else world_size)

    def _layout_problems(self, world_size: int) -> list[str]:
        """problems() once every count is at least 1: how the numbers fit together."""
        m = self.model
        found = []
        text = SONNETS.stat().st_size
        why = f"seq_len={m.seq_len}: the text has {text} bytes, a sequence needs seq_len + 1"
        _require(found, m.seq_len + 1 <= text, why + " of them")
        why = f"steps={self.steps} is below the warm-up of {self.warmup} steps"
        _require(found, self.steps >= self.warmup, why + ": raise --steps or lower --warmup")
        found += _refused(lambda: self.layout.check(world_size))
        found += m.problems(self.tp) + moe.problems(self) + context.problems(self)
        for name, value, allowed in self.choices:
            _require(found, value in allowed, f"{name}={value!r} is not one of {allowed}")
        ok = self.batch % (self.dp * self.microbatches) == 0
        why = f"batch={self.batch} is not divisible by dp={self.dp} x microbatches="
        _require(found, ok, why + f"{self.microbatches}")
        _require(found, self.weight_decay >= 0, f"weight_decay={self.weight_decay} is negative")
        why = f"chunks={self.chunks} needs schedule='interleaved'"
        _require(found, self.chunks == 1 or self.schedule == "interleaved", why)
        why = f"pp={self.pp} x chunks={self.chunks} pipeline parts, but the model has only "
        _require(
            found,
            self.pp * self.chunks <= m.n_layers + 2,
            why + f"n_layers={m.n_layers} + 2 layers",
        )
        if self.schedule in NAMES:  # an unknown one is reported above
            found += _refused(
                build_schedules, self.schedule, self.pp, self.microbatches, self.chunks
            )
        return found

    @property
    def choices(self) -> list[tuple[str, object, tuple]]:
        """(name, value, the values allowed) of each field that names a choice."""
        return [
            ("zero", self.zero, (0, 1, 2, 3)),
            ("amp", self.amp, tuple(PRECISIONS)),
            ("dtype", self.dtype, tuple(DTYPES)),
            ("schedule", self.schedule, NAMES),
        ]

    def check(self, world_size: int | None = None) -> TrainConfig:
        """self, or a ValueError listing every problem (before any process starts work)."""
        found = self.problems(world_size)
        if found:
            raise ValueError("this run cannot start:\n  " + "\n  ".join(found))
        return self


def _require(found: list[str], ok: bool, why: str) -> None:
    """found += [why] unless ok."""
    if not ok:
        found.append(why)


def _refused(check: Callable, *args) -> list[str]:
    """[] if check(*args) passes, else [the message of the ValueError it raises]."""
    try:
        check(*args)
    except ValueError as e:
        return [str(e)]
    return []
