"""ZeRO as the main job's replicas (minidist/replicas.py): steps 5 and 6 of its composition
(gpt/train.py) with --zero 1, 2 or 3, in any precision.

Equals: the ZeRO stage it wraps (stages.py), with its own master shards and scaler; the
checkpoint state consolidated on dp rank 0 (state.py) and loaded back into any dp.
Communication per step: ZeRO-1 a reduce-scatter and an all-gather over dp_comm; ZeRO-2/3 free
the gradients as they go, so with a pipeline they are reduce-scattered after every backward op
(m times ZeRO-1's bytes); ZeRO-3 gathers parameters per microbatch.
Lesson: lessons/07_zero/; the composition: lessons/12_3d_parallel/.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.replicas import MOMENTS, Replicas, names
from minidist.zero.cost import memory_nbytes
from minidist.zero.stages import wrap


def apply_zero(module: nn.ModuleList, dp_comm, optimizer, stage: int, **options) -> Replicas:
    """module's replicas over dp_comm kept by ZeRO-`stage` (wrap: optimizer, options
    param_groups, precision, scaler, overflow_comm)."""
    z = wrap(module, dp_comm, optimizer, stage, **options)
    master = options["precision"].master

    def on_backward(op) -> None:
        if stage >= 2:
            z.finish_gradient_sync()  # this microbatch's gradients, reduce-scattered

    def state():
        full = z.state_dict(dst=0)  # collective over dp: consolidated on its rank 0
        if full is None:
            return None
        optim = full["optimizer"]
        steps = [float(v["step"]) for v in optim.values() if "step" in v]
        values = {}
        for name in names(module):
            moments = optim.get(name, {})
            values[name] = {"value": full["model"][name], **{k: moments.get(k) for k in MOMENTS}}
        return values, max(steps, default=0.0), full.get("scaler")

    def load(mine: dict, adam_step: float, scaler: dict | None) -> None:
        step = torch.tensor(adam_step, dtype=torch.float32)
        optimizer = {}
        for n in names(module):  # the optimizer's state is in the masters' dtype
            moments = {k: mine[n][k].to(master) for k in MOMENTS}
            optimizer[n] = {"step": step.clone(), **moments}
        full = {
            "model": {n: mine[n]["value"] for n in names(module)},
            "elementwise": list(MOMENTS),
            "optimizer": optimizer,
        }
        if scaler is not None:
            full["scaler"] = scaler
        z.load_state_dict(full, src=0)  # collective over dp

    held = lambda: memory_nbytes(z)  # noqa: E731
    return Replicas(
        module,
        z.optimizer,
        z.scaler,
        z.step,
        z.zero_grad,
        state,
        load,
        held,
        on_backward=on_backward,
        gathered=z.gathered,
    )
