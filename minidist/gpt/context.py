"""Context parallelism in the main job: each cp rank holds its zigzag chunks of every sequence,
and every block's attention runs as ring attention over cp_comm.

Equals: train_full, the same model on the whole sequences: every rank embeds its tokens at
their global positions (positions), runs the blocks on its T/cp tokens (every other layer acts
token by token), attends through ring_attention (context_parallel/ring_attention.py), and takes the
mean cross-entropy over its own tokens. Every cp rank holds T/cp tokens of the same b sequences, so
the whole batch's mean loss is the mean of the dp x cp ranks' means: the replicas average the
gradients over dcp_comm (dp x cp) instead of dp_comm, which is the gradients summed over cp
with each rank's loss divided by cp, then the usual dp average. float64: losses 1e-12
relative, parameters 1e-10 (tests/test_train.py).
Communication per step, per rank: per block and microbatch, ring_attention's (forward 2 (cp-1)
n b bytes, backward 2 (2cp-1) n b, n = b H (T/cp) d / tp elements); the gradient average over
dp x cp in place of dp (its bytes 2 (dp cp - 1) / (dp cp) of the gradients on a ring).
Memory per rank: 1/cp of every activation (tokens) and of attention's saved tensors; the
full model (no weight is cut over cp).
Ladder: positions (which tokens a rank holds) -> RingSelfAttention (the block's attention over
the ring) -> apply_cp (the model made context parallel in place).
Paper: Liu, Zaharia and Abbeel, Ring Attention (2023); Llama Team, The Llama 3 Herd of Models
(2024), section 3.3.2 (the zigzag chunks; the gradients reduced over the cp x dp group).
Lesson: lessons/15_context_parallel/.   Run: minidist train --dp 2 --cp 2 --tp 2 --check
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.context_parallel.ring_attention import (
    chunk_size,
    chunks_of,
    ring_attention,
    shard_sequence,
)

LAYOUT = "zigzag"  # every cp rank the same causal work (lesson 15)


def positions(seq_len: int, cp: int, c: int) -> torch.Tensor:
    """(T/cp,) the global positions of the tokens cp rank c holds: its two chunks of 2 cp."""
    m = chunk_size(seq_len, cp, LAYOUT)
    return torch.cat([torch.arange(i * m, (i + 1) * m) for i in chunks_of(cp, c, LAYOUT)])


def token_order(batch: int, seq_len: int, cp: int, b: int) -> torch.Tensor:
    """(B T,) the batch's token numbers (b_i T + t) grouped as the ranks hold them: for each
    group of b sequences (a dp rank's microbatch), each cp rank's b T/cp tokens in its order,
    sequence after sequence. An MoE routing the batch in this order, in groups of b T/cp
    tokens, routes each rank's tokens as that rank does (moe.group_blocks)."""
    starts = torch.arange(batch).view(-1, b, 1) * seq_len  # (B/b, b, 1): each sequence's first
    mine = torch.stack([positions(seq_len, cp, c) for c in range(cp)])  # (cp, T/cp)
    return (starts.unsqueeze(1) + mine.view(1, cp, 1, -1)).flatten()  # (B/b, cp, b, T/cp)


def shard_tokens(t: torch.Tensor, cp_comm) -> torch.Tensor:
    """This cp rank's tokens of t (b, T) (ids or targets): (b, T/cp), its chunks in order."""
    return shard_sequence(t, cp_comm, LAYOUT, dim=1)


class RingSelfAttention(nn.Module):
    """A ParallelSelfAttention's qkv and proj (heads cut over tp; or an MoE block's whole
    SelfAttention's) around ring_attention over cp_comm: x_local (B, T/cp, D) -> (B, T/cp, D),
    this rank's tokens in shard order."""

    def __init__(self, attn: nn.Module, cp_comm):
        super().__init__()
        self.qkv, self.proj, self.n_heads = attn.qkv, attn.proj, attn.n_heads_local
        self.cp_comm = cp_comm

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        b, n, _ = x_local.shape
        qkv = self.qkv(x_local)  # (B, T/cp, 3 D/tp): [q | k | v], heads contiguous in each
        hd = qkv.shape[-1] // (3 * self.n_heads)
        q, k, v = qkv.view(b, n, 3, self.n_heads, hd).permute(2, 0, 3, 1, 4)  # (B, h, T/cp, hd)
        y = ring_attention(q, k, v, self.cp_comm, LAYOUT)  # (B, h, T/cp, hd)
        return self.proj(y.transpose(1, 2).reshape(b, n, self.n_heads * hd))  # (B, T/cp, D)


def apply_cp(model, cp_comm) -> None:
    """Context parallelism on a model.GPT, in place: the embedding looks up this rank's
    positions, every block (dense or MoE) attends over the ring of cp_comm. The parameters
    stay the same tensors; an MoE block routes this rank's tokens as one group (moe.py)."""
    for i in model.blocks:
        model.layers[i].attn = RingSelfAttention(model.layers[i].attn, cp_comm)
    embedding = model.layers[0]
    mine = positions(model.config.seq_len, cp_comm.world_size, cp_comm.rank)
    embedding.where = mine.to(embedding.positions.weight.device)


def problems(config) -> list[str]:
    """What stops a TrainConfig's cp from running, with the numbers."""
    t, cp = config.model.seq_len, config.cp
    if cp > 1 and t % (2 * cp):
        return [f"seq_len={t} is not divisible by 2*cp={2 * cp} (zigzag: two chunks per cp rank)"]
    return []
