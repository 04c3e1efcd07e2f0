"""The pipeline applied to a model's layers: this stage's chunks, the step of the main job's
composition (gpt/train.py) after the cuts, before the replicas.

Equals: the chunks hold the very layers given (no copies), so the stage runs the model's own
parameters; stage.py proves a pipeline equal to the model run whole.
Communication: none while cutting; the stage's sends and receives (stage.py).
Memory per rank: this stage's layers only; the others are left to the garbage collector.
Lesson: lessons/06_pipeline/; the composition: lessons/12_3d_parallel/.
"""

from __future__ import annotations

from torch import nn


def apply_pp(layers: nn.ModuleList, layer_ids: list[list[int]], device=None) -> list[nn.Sequential]:
    """This stage's chunks: chunk c an nn.Sequential of the layers layer_ids[c] (a balanced
    cut: partition.balance; the main job's model.stage_layer_ids), moved to device (default the
    CPU). PipelineStage (stage.py) runs them."""
    chunks = [nn.Sequential(*(layers[i] for i in ids)) for ids in layer_ids]
    return [chunk.to(device or "cpu") for chunk in chunks]
