"""Mixed precision as the main job's replicas (minidist/replicas.py): steps 5 and 6 of its
composition (gpt/train.py) with bf16 or fp16 compute and no ZeRO.

Equals: MixedPrecisionOptimizer (amp.py): fp32 masters and a loss scale, the gradients
accumulated per microbatch in float32 and all-reduced over dp in the step; the skip of an
overflowed step (fp16) agreed by the whole world.
Communication per step: the gradients all-reduced once over dp_comm in the reduce dtype; the
overflow flag over the world.
Lesson: lessons/09_mixed_precision/; the composition: lessons/12_3d_parallel/.
"""

from __future__ import annotations

from torch import nn

from minidist.mixed_precision.amp import MixedPrecisionOptimizer
from minidist.replicas import Replicas, adam_checkpoint, held_nbytes, names


def apply_amp(module: nn.ModuleList, optimizer, precision, scaler, dp_comm, world) -> Replicas:
    """module's replicas over dp_comm in precision (compute, master and reduce dtypes):
    optimizer(masters or groups) makes the optimizer over the fp32 masters, scaler the loss
    scale; world agrees on every skip (every stage and tp rank must skip the same steps)."""
    mp = MixedPrecisionOptimizer(
        module, optimizer, precision, scaler, dp_comm=dp_comm, overflow_comm=world
    )
    state, load = adam_checkpoint(
        module, list(zip(names(module), mp.master, strict=True)), mp.optimizer, mp.scaler
    )
    held = lambda: held_nbytes(module, mp.optimizer, list(mp.master))  # noqa: E731
    return Replicas(
        module,
        mp,
        mp.scaler,
        mp.step,
        mp.zero_grad,
        state,
        load,
        held,
        on_backward=lambda op: mp.collect(),
    )
