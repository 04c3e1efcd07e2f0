"""Activation recomputation applied to a transformer's blocks (minidist/transformer.py), in
place: a step of the main job's composition (gpt/train.py), before the pipeline and replicas.

Equals: the same layers without recomputation: the same gradients (recompute.py proves
checkpoint bitwise in float64).
Communication: none of its own; a block's forward, and so its communication, runs again in
backward (tensor parallelism's two all-reduces, ring attention's ring).
Memory per rank: each block keeps only its input for backward; one block's activations live
while it is recomputed.
Lesson: lessons/10_checkpointing/; the composition: lessons/12_3d_parallel/.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.checkpointing.recompute import checkpoint
from minidist.transformer import Embedding, Head


class Recompute(nn.Module):
    """A block whose activations are recomputed in backward (gradient checkpointing)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x)


def apply_recompute(layers: nn.ModuleList) -> None:
    """Every block (each layer but the Embedding and the Head) checkpointed, in place: its
    activations recomputed in backward. The parameters stay the same tensors, in order."""
    for i, layer in enumerate(layers):
        if not isinstance(layer, (Embedding, Head)):
            layers[i] = Recompute(layer)
