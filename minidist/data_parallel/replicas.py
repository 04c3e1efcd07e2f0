"""Data parallelism as the main job's replicas (minidist/replicas.py): step 5 of its composition
(gpt/train.py) in fp32.

Equals: DataParallelBucketed (wrappers.py) and AdamW on each rank: the gradients averaged
once, after the whole pipeline step (the pipeline accumulates its microbatches first).
Communication per step: the gradients (and the "used" flags) all-reduced once over dp_comm.
Lesson: lessons/04_data_parallel/; the composition: lessons/12_3d_parallel/.
"""

from __future__ import annotations

from torch import nn

from minidist.data_parallel.wrappers import DataParallelBucketed
from minidist.replicas import Replicas, adam_checkpoint, held_nbytes, trainable


def apply_dp(module: nn.ModuleList, dp_comm, adamw, scaler) -> Replicas:
    """module's replicas over dp_comm kept equal by data parallelism, stepped by adamw (an
    AdamW over module's parameters); scaler: the fixed loss scale (fp32)."""
    dp = DataParallelBucketed(module, dp_comm)

    def update() -> bool:
        dp.finish_gradient_sync()
        adamw.step()
        return True

    state, load = adam_checkpoint(module, trainable(module), adamw, None)
    held = lambda: held_nbytes(module, adamw, [])  # noqa: E731
    return Replicas(
        module, adamw, scaler, update, adamw.zero_grad, state, load, held, accumulating=dp.no_sync
    )
