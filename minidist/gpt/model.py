"""A small GPT: the model of the main job, the plain one every technique is applied to.

Equals: `GPT(config)` (its layers: `layers_full`) is the single-process model; the main job
builds it once on every rank and applies each technique to its layers in place (train.py:
each technique's own apply_*, on the plain layers of minidist/transformer.py), recording which
full elements each cut holds, so the distributed model is the full model cut, not a look-alike
(train.py proves the training equal: float64 1e-12 relative).
Communication per step: none of its own (its cut forms communicate: tensor_parallel/blocks.py,
pipeline/stage.py, ...).
Memory per rank: the full model while it is built; after the composition, the parameters of
its stage's layers, 1/tp of each tensor-parallel weight.
Ladder: layer_full (one layer from its seed) -> GPT (the L + 2 layers, full) -> the
techniques applied to them (train.build_job).
Paper: Radford et al., Language Models are Unsupervised Multitask Learners (GPT-2, 2019), the
architecture (pre-LayerNorm blocks, a final LayerNorm, learned positions); this one is small,
byte-level (vocabulary 256), without dropout and with an untied output layer.
Lesson: lessons/12_3d_parallel/.   Run: minidist train --dp 2 --pp 2 --tp 2
With config.experts > 0 every block's MLP is a mixture of experts (expert_parallel/
moe_block.py: MoEBlock).

The model as a sequence of layers, which the pipeline cuts between any two:

    Embedding (tokens + positions) -> Block 0 -> ... -> Block L-1 -> Head (LayerNorm, Linear)
    ids (B, T)                        x (B, T, D) ...............   logits (B, T, V)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minidist.expert_parallel.moe_block import block_full
from minidist.pipeline.partition import balance
from minidist.transformer import Embedding, Head, TransformerBlock, master_linear


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape. Every layer is drawn from seed, layer by layer, so any rank can build
    any layer alone and get the same numbers."""

    vocab_size: int = 256  # bytes
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    d_ff: int = 256
    n_layers: int = 4
    seed: int = 0
    experts: int = 0  # > 0: every block's MLP is a mixture of this many experts (MoEBlock)
    topk: int = 1  # experts per token
    capacity_factor: float = 1.25  # an expert takes at most ceil(cf k n / E) of n tokens

    def problems(self, tp: int) -> list[str]:
        """What makes this shape unusable with tp tensor-parallel ranks, with the numbers."""
        found = []
        if self.d_model % self.n_heads:
            found.append(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.experts < 0:
            found.append(f"experts={self.experts} must be at least 0 (0: a dense MLP)")
        if self.experts and not 1 <= self.topk <= min(2, self.experts):
            found.append(f"topk={self.topk} must be 1 or 2 and at most experts={self.experts}")
        if self.experts and not self.capacity_factor > 0:
            found.append(f"capacity_factor={self.capacity_factor} must be > 0")
        for name in ("n_heads", "d_ff", "vocab_size"):
            if getattr(self, name) % tp:
                found.append(f"{name}={getattr(self, name)} is not divisible by tp={tp}")
        return found


def _table(rows: int, cols: int, seed: int, dtype) -> nn.Embedding:
    """An nn.Embedding drawn N(0, 0.02^2) from torch.Generator(seed), as GPT-2 draws its own."""
    emb = nn.Embedding(rows, cols, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(rows, cols, generator=gen, dtype=dtype) * 0.02)
    return emb


def layer_full(config: GPTConfig, i: int, dtype=torch.float32) -> nn.Module:
    """Layer i of the full model (0: Embedding, 1..L: blocks, L+1: Head), from the seed."""
    c, seed = config, config.seed * 1000 + 10 * i  # each layer its own seeds, 10 apart
    if i == 0:
        return Embedding(
            _table(c.vocab_size, c.d_model, seed, dtype),
            _table(c.seq_len, c.d_model, seed + 1, dtype),
        )
    if i <= c.n_layers and c.experts:
        return block_full(c, seed, dtype)
    if i <= c.n_layers:
        return TransformerBlock(c.d_model, c.n_heads, c.d_ff, causal=True, seed=seed, dtype=dtype)
    if i == c.n_layers + 1:
        out = nn.Linear(c.d_model, c.vocab_size, bias=False, dtype=dtype)
        with torch.no_grad():
            out.weight.copy_(master_linear(c.d_model, c.vocab_size, seed, bias=False)[0])
        return Head(nn.LayerNorm(c.d_model, dtype=dtype), out)
    raise ValueError(f"layer {i} does not exist: the model has {c.n_layers + 2} layers")


def layers_full(config: GPTConfig, dtype=torch.float32) -> list[nn.Module]:
    """The single-process model, as its L + 2 layers; nn.Sequential(*them) runs it."""
    return [layer_full(config, i, dtype) for i in range(config.n_layers + 2)]


class GPT(nn.Module):
    """The model as its L + 2 layers (layers_full), run one after the other: ids (B, T) ->
    logits (B, T, V). Built full from the seeds; the main job applies each technique to its
    layers in place (train.build_job)."""

    def __init__(self, config: GPTConfig, dtype=torch.float32):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layers_full(config, dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids
        for layer in self.layers:
            x = layer(x)
        return x


def layer_costs(config: GPTConfig) -> list[int]:
    """Parameters per layer, the pipeline's balancing cost (a block's compute grows alike)."""
    c = config
    block = 4 * c.d_model * c.d_model + 2 * c.d_model * c.d_ff + 9 * c.d_model + c.d_ff
    if c.experts:  # the router, E experts in place of one MLP
        mlp = 2 * c.d_model * c.d_ff + c.d_model + c.d_ff
        block += c.experts * c.d_model + (c.experts - 1) * mlp
    head = c.vocab_size * c.d_model + 2 * c.d_model
    return [(c.vocab_size + c.seq_len) * c.d_model, *[block] * c.n_layers, head]


def stage_layer_ids(config: GPTConfig, pp: int, n_chunks: int, stage: int) -> list[list[int]]:
    """The layer numbers of each of `stage`'s chunks: chunk c is part c*pp + stage of a
    balanced cut of the L + 2 layers into pp * n_chunks contiguous parts."""
    n_parts = pp * n_chunks
    if n_parts > config.n_layers + 2:
        raise ValueError(
            f"pp={pp} x chunks={n_chunks} = {n_parts} pipeline parts, but the model has only"
            f" n_layers={config.n_layers} + 2 = {config.n_layers + 2} layers"
        )
    bounds = balance(layer_costs(config), n_parts)
    return [list(range(*bounds[c * pp + stage])) for c in range(n_chunks)]


def loss_full(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over all B*T tokens: logits (B, T, V), targets (B, T)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
