"""The steps of the main job's composition that cut the plain model: tensor parallelism,
activation recomputation and the pipeline, each a small function applied in place to the
model.GPT that build_job (train.py) built once, full. Context and expert parallelism apply
beside their GPT pieces (context.apply_cp, moe.apply_ep); the replicas come last (replicas.py).

Equals: the model they leave computes what the full model computes: tensor_parallel/blocks.py
and pipeline/stage.py prove each cut, train.py the composition (float64 1e-12 relative).
Communication: none while cutting (from_full slices; the pipeline picks layers).
Memory per rank: after apply_pp, this stage's layers only (1/tp of each split weight); the
others are left to the garbage collector with the full model.
Lesson: lessons/12_3d_parallel/ (the composition, in order).
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.checkpointing.recompute import checkpoint
from minidist.gpt.model import GPT, Embedding, Head, stage_layer_ids
from minidist.tensor_parallel.blocks import ParallelTransformerBlock, VocabParallelEmbedding
from minidist.tensor_parallel.layers import ColumnParallelLinear


def apply_tp(model: GPT, tp_comm) -> None:
    """Tensor parallelism: each layer cut over tp_comm, this rank's slices of the full weights
    (Megatron): the token table by vocabulary (VocabParallelEmbedding), each block by heads and
    by d_ff, the output layer by vocabulary (ColumnParallelLinear), whose logits (B, T, V/tp) go
    straight into the vocabulary-parallel cross-entropy. The positions and the LayerNorms are
    replicated: every tp rank computes, and gets, the same gradients for them. A block with
    experts is not cut over tp (moe.problems refuses tp > 1 with experts)."""
    tokens, out = VocabParallelEmbedding.from_full, ColumnParallelLinear.from_full
    model.cut(0, lambda x: Embedding(tokens(x.tokens, tp_comm), x.positions), tp_comm)
    model.cut(model.config.n_layers + 1, lambda x: Head(x.norm, out(x.out, tp_comm)), tp_comm)
    if not model.config.experts:
        for i in model.blocks:
            model.cut(i, lambda x: ParallelTransformerBlock.from_full(x, tp_comm), tp_comm)


class Recompute(nn.Module):
    """A block whose activations are recomputed in backward (gradient checkpointing)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x)


def apply_recompute(model: GPT) -> None:
    """Activation recomputation (lesson 10): every block checkpointed, its activations
    recomputed in backward. The parameters stay the same tensors."""
    for i in model.blocks:
        model.layers[i] = Recompute(model.layers[i])


def apply_pp(
    model: GPT, pp: int, n_chunks: int, stage: int, device=None
) -> tuple[list[list[int]], list[nn.Sequential]]:
    """The pipeline: (the layer numbers of each of this stage's chunks, the chunks), each chunk
    an nn.Sequential of its layers of model, moved to device (default the CPU). Chunk c is part
    c pp + stage of a balanced cut of the L + 2 layers into pp n_chunks contiguous parts
    (model.stage_layer_ids); PipelineStage runs them."""
    layer_ids = stage_layer_ids(model.config, pp, n_chunks, stage)
    chunks = [nn.Sequential(*(model.layers[i] for i in ids)) for ids in layer_ids]
    return layer_ids, [chunk.to(device or "cpu") for chunk in chunks]
