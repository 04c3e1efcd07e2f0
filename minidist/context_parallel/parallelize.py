"""Context parallelism applied to a transformer's layers (minidist/transformer.py), in place:
each cp rank holds its zigzag chunks of every sequence, and every block's attention runs as
ring attention over cp_comm. The main job's second step (gpt/train.py).

Equals: the same layers on the whole sequences: the embedding puts this rank's tokens at their
global positions (positions), every block attends through ring_attention (ring_attention.py),
every other layer acts token by token. float64: the main job's losses 1e-12 relative
(tests/test_train.py).
Communication per block and microbatch: ring_attention's (forward 2 (cp-1) messages of k|v,
backward 2 (2cp-1)); none while applying.
Memory per rank: 1/cp of every activation and of attention's saved tensors; no weight is cut.
Ladder: positions (which tokens a rank holds) -> RingSelfAttention (a block's attention over
the ring) -> apply_cp (the layers made context parallel in place).
Paper: Liu, Zaharia and Abbeel, Ring Attention (2023); Llama Team, The Llama 3 Herd of Models
(2024), section 3.3.2 (the zigzag chunks).
Lesson: lessons/15_context_parallel/; the composition: lessons/12_3d_parallel/.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.context_parallel.ring_attention import chunk_size, chunks_of, ring_attention
from minidist.transformer import Embedding

LAYOUT = "zigzag"  # every cp rank the same causal work (lesson 15)


def positions(seq_len: int, cp: int, c: int) -> torch.Tensor:
    """(T/cp,) the global positions of the tokens cp rank c holds: its two chunks of 2 cp."""
    m = chunk_size(seq_len, cp, LAYOUT)
    return torch.cat([torch.arange(i * m, (i + 1) * m) for i in chunks_of(cp, c, LAYOUT)])


class RingSelfAttention(nn.Module):
    """An attention's qkv and proj (heads cut over tp or whole: n_heads_local of them) around
    ring_attention over cp_comm: x_local (B, T/cp, D) -> (B, T/cp, D), this rank's tokens in
    shard order."""

    def __init__(self, attn: nn.Module, cp_comm):
        super().__init__()
        self.qkv = attn.qkv
        self.proj = attn.proj
        self.n_heads = attn.n_heads_local
        self.cp_comm = cp_comm

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        b, n, _ = x_local.shape
        qkv = self.qkv(x_local)  # (B, T/cp, 3 D/tp): [q | k | v], heads contiguous in each
        hd = qkv.shape[-1] // (3 * self.n_heads)
        q, k, v = qkv.view(b, n, 3, self.n_heads, hd).permute(2, 0, 3, 1, 4)  # (B, h, T/cp, hd)
        y = ring_attention(q, k, v, self.cp_comm, LAYOUT)  # (B, h, T/cp, hd)
        return self.proj(y.transpose(1, 2).reshape(b, n, self.n_heads * hd))  # (B, T/cp, D)


def apply_cp(layers: nn.ModuleList, cp_comm) -> None:
    """Context parallelism, in place: the Embedding looks up this rank's positions, every
    block (a layer with an attn: dense or with experts) attends over the ring of cp_comm. The
    parameters stay the same tensors."""
    for layer in layers:
        if hasattr(layer, "attn"):
            layer.attn = RingSelfAttention(layer.attn, cp_comm)
    for layer in layers:
        if isinstance(layer, Embedding):
            mine = positions(layer.positions.num_embeddings, cp_comm.world_size, cp_comm.rank)
            layer.where = mine.to(layer.positions.weight.device)
