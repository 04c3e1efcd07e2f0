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
the ring) -> apply_cp (the layers made context parallel in place): context_parallel/
parallelize.py; here, the batch's tokens as the cp ranks hold them, and what cp refuses.
Paper: Liu, Zaharia and Abbeel, Ring Attention (2023); Llama Team, The Llama 3 Herd of Models
(2024), section 3.3.2 (the zigzag chunks; the gradients reduced over the cp x dp group).
Lesson: lessons/15_context_parallel/.   Run: minidist train --dp 2 --cp 2 --tp 2 --check
"""

from __future__ import annotations

import torch

from minidist.context_parallel.parallelize import LAYOUT, positions
from minidist.context_parallel.ring_attention import shard_sequence


def token_order(batch: int, seq_len: int, cp: int, b: int) -> torch.Tensor:
    """(B T,) the batch's token numbers (b_i T + t) grouped as the ranks hold them: for each
    group of b sequences (a dp rank's microbatch), each cp rank's b T/cp tokens in its order,
    sequence after sequence. An MoE routing the batch in this order, in groups of b T/cp
    tokens, routes each rank's tokens as that rank does (moe_block.group_blocks)."""
    starts = torch.arange(batch).view(-1, b, 1) * seq_len  # (B/b, b, 1): each sequence's first
    mine = torch.stack([positions(seq_len, cp, c) for c in range(cp)])  # (cp, T/cp)
    return (starts.unsqueeze(1) + mine.view(1, cp, 1, -1)).flatten()  # (B/b, cp, b, T/cp)


def shard_tokens(t: torch.Tensor, cp_comm) -> torch.Tensor:
    """This cp rank's tokens of t (b, T) (ids or targets): (b, T/cp), its chunks in order."""
    return shard_sequence(t, cp_comm, LAYOUT, dim=1)


def problems(config) -> list[str]:
    """What stops a TrainConfig's cp from running, with the numbers."""
    t, cp = config.model.seq_len, config.cp
    if cp > 1 and t % (2 * cp):
        return [f"seq_len={t} is not divisible by 2*cp={2 * cp} (zigzag: two chunks per cp rank)"]
    return []
