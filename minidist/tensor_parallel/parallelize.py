"""Tensor parallelism applied to a plain transformer's layers (minidist/transformer.py), in
place: the first step of the main job's composition (gpt/train.py).

Equals: the layers it leaves compute what the full layers compute (blocks.py proves each
cut; gpt/train.py the composition, float64 1e-12 relative).
Communication: none while cutting (from_full slices); the cut layers' own, per microbatch
(blocks.py, layers.py).
Memory per rank: 1/tp of every split weight; the positions and LayerNorms whole.
Lesson: lessons/12_3d_parallel/ (the composition, in order); the layers:
lessons/05_tensor_parallel/.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.tensor_parallel.blocks import ParallelTransformerBlock, VocabParallelEmbedding
from minidist.tensor_parallel.layers import ColumnParallelLinear
from minidist.transformer import Embedding, Head, TransformerBlock, recording_cut


def apply_tp(layers: nn.ModuleList, tp_comm) -> dict[int, torch.Tensor]:
    """Each layer cut over tp_comm, in place, this rank's slices of the full weights
    (Megatron): the Embedding's token table by vocabulary (VocabParallelEmbedding), each
    TransformerBlock by heads and by d_ff, the Head's output layer by vocabulary
    (ColumnParallelLinear), whose logits (B, T, V/tp) go straight into the
    vocabulary-parallel cross-entropy. The positions and the LayerNorms are replicated: every
    tp rank computes, and gets, the same gradients for them. Any other layer (a block with
    experts) is left whole. Returns {i: which of layer i's elements this rank holds}
    (recording_cut) for every layer cut."""
    held = {}
    for i, layer in enumerate(layers):
        if not isinstance(layer, (Embedding, Head, TransformerBlock)):
            continue  # a block with experts
        with recording_cut(layers, i, held):
            # in the model's order: the embedding, the blocks, the head
            if isinstance(layer, Embedding):
                layer.tokens = VocabParallelEmbedding.from_full(layer.tokens, tp_comm)
            elif isinstance(layer, TransformerBlock):
                layers[i] = ParallelTransformerBlock.from_full(layer, tp_comm)
            elif isinstance(layer, Head):
                layer.out = ColumnParallelLinear.from_full(layer.out, tp_comm)
    return held
