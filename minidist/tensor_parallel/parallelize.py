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
from minidist.transformer import Embedding, Head, TransformerBlock, held_elements


def apply_tp(layers: nn.ModuleList, tp_comm) -> dict[int, torch.Tensor]:
    """Each layer cut over tp_comm, in place, this rank's slices of the full weights
    (Megatron): the Embedding's token table by vocabulary (VocabParallelEmbedding), each
    TransformerBlock by heads and by d_ff, the Head's output layer by vocabulary
    (ColumnParallelLinear), whose logits (B, T, V/tp) go straight into the
    vocabulary-parallel cross-entropy. The positions and the LayerNorms are replicated: every
    tp rank computes, and gets, the same gradients for them. Any other layer (a block with
    experts) is left whole. Returns {i: which of layer i's elements this rank holds}
    (held_elements) for every layer cut."""
    cuts = {
        Embedding: lambda x: Embedding(VocabParallelEmbedding.from_full(x.tokens, tp_comm),
                                       x.positions),
        TransformerBlock: lambda x: ParallelTransformerBlock.from_full(x, tp_comm),
        Head: lambda x: Head(x.norm, ColumnParallelLinear.from_full(x.out, tp_comm)),
    }  # fmt: skip
    held = {}
    for i, layer in enumerate(layers):
        if type(layer) in cuts:
            layers[i], held[i] = held_elements(layer, cuts[type(layer)])
    return held
