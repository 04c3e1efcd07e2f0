"""Replicas: one pipeline stage's chunks kept equal over the ranks that hold the same part of
the model, as a training step and its checkpoints use them, whatever technique does it (data
parallelism, ZeRO, mixed precision, expert parallelism: each fills one in, apply_* in its own
folder); and the pieces several of them share: AdamW's checkpoint state, the bytes held.

Equals: the technique each wraps, unchanged: the main job composed with any of them equals its
single-process run (tests/test_train.py), and state() then load() resumes it exactly
(tests/test_resume.py).
Communication: none of its own (each technique's, behind update, state and load).
Lesson: lessons/12_3d_parallel/ (the composition, its last steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from minidist.memory import storage_nbytes

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state per parameter element


def _nothing(*_) -> None:
    return None


@dataclass
class Replicas:
    """The stage's chunks kept equal over their replicas, as the step and checkpoints use them.

    module          the stage's chunks, one ModuleList
    optimizer       what the learning-rate schedule drives (its param_groups)
    scaler          the loss scale this step's losses carry (scale; a LossScaler)
    update()        the gradients made equal over the replicas, then the optimizer step: True,
                    or False where the world skipped it (inf/nan)
    clear()         the technique's zero_grad
    on_backward(op) after every backward op of the pipeline (PipelineStage's hook)
    accumulating()  the pipeline step runs inside it: data parallelism waits for every microbatch
    gathered()      full parameters inside (ZeRO-3), to read them
    state()         this rank's slices by parameter name, {name: {"value", "exp_avg",
                    "exp_avg_sq"}}, AdamW's step and the scaler's state (ZeRO: collective over
                    dp, consolidated on its rank 0, None elsewhere)
    load(...)       the same put back, every rank its own slices (collective over dp for ZeRO)
    held_nbytes()   bytes of parameters and of optimizer state (with masters) held now
    """

    module: nn.ModuleList
    optimizer: object
    scaler: object
    update: Callable[[], bool]
    clear: Callable[[], None]
    state: Callable[[], tuple | None]
    load: Callable[[dict, float, dict | None], None]
    held_nbytes: Callable[[], dict[str, int]]
    on_backward: Callable[[object], None] = _nothing
    accumulating: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    gathered: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @property
    def scale(self) -> float:
        return self.scaler.scale

    def step(self) -> bool:
        """update(), then every gradient dropped: True if the step was taken."""
        stepped = self.update()
        self.clear()
        self.module.zero_grad(set_to_none=True)
        return stepped


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter of module that trains, in order."""
    return [(n, q) for n, q in module.named_parameters() if q.requires_grad]


def names(module: nn.Module) -> list[str]:
    """The names of module's trainable parameters, in order."""
    return [n for n, _ in trainable(module)]


def adam_checkpoint(module: nn.Module, weights: list, optimizer, scaler) -> tuple:
    """(state, load) of AdamW stepping weights, [(name, tensor)] (the parameters or their
    masters, in the order of module's trainable parameters); every replica holds the same
    (resume.save takes replica 0's). scaler: its state saved too (None: fixed)."""
    params = [q for _, q in trainable(module)]

    def state():
        values, steps = {}, [0.0]
        for name, w in weights:
            st = optimizer.state.get(w, {})  # nothing before the first step, as AdamW starts
            values[name] = {"value": w.detach(), **{k: st.get(k) for k in MOMENTS}}
            if "step" in st:
                steps.append(float(st["step"]))
        return values, max(steps), None if scaler is None else scaler.state_dict()

    def load(mine: dict, adam_step: float, saved_scaler: dict | None) -> None:
        step = torch.tensor(adam_step, dtype=torch.float32)
        with torch.no_grad():
            for q, (name, w) in zip(params, weights, strict=True):
                w.copy_(mine[name]["value"])
                q.copy_(w)  # the model: the master rounded
                if adam_step > 0:
                    moments = {k: mine[name][k].to(w.device, w.dtype) for k in MOMENTS}
                    optimizer.state[w] = {"step": step.clone(), **moments}
        if scaler is not None and saved_scaler is not None:
            scaler.load_state_dict(saved_scaler)

    return state, load


def held_nbytes(module: nn.Module, optimizer, masters: list) -> dict[str, int]:
    """Bytes of module's parameters and of the optimizer's state with the masters."""
    state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    state += masters
    return {
        "params": storage_nbytes(list(module.parameters())),
        "optimizer": storage_nbytes([t for t in state if t.dim() > 0]),  # not AdamW's 0-d steps
    }
