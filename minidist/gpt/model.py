"""A small GPT: the model of the main job, whole for one process and cut for dp x pp x tp.

Equals: `layers_full(config)` is the single-process model; `stage_chunks` gives this rank's
pipeline chunks of the same model, every layer sliced for tensor parallelism with from_full, so
the distributed model is the full model cut, not a look-alike (train.py proves the training
equal: float64 1e-12 relative).
Communication per step: that of its parts (tensor_parallel/blocks.py for tp; pipeline/stage.py for
pp), none of its own.
Memory per rank: the parameters of its stage's layers, 1/tp of each tensor-parallel weight.
Ladder: layers_full (one process) -> parallel_layer (each layer cut over tp_comm) ->
stage_chunks (the layers of this pipeline stage, balanced by parameter count).
Paper: Radford et al., Language Models are Unsupervised Multitask Learners (GPT-2, 2019), the
architecture (pre-LayerNorm blocks, a final LayerNorm, learned positions); this one is small,
byte-level (vocabulary 256), without dropout and with an untied output layer.
Lesson: lessons/12_3d_parallel/.   Run: minidist train --dp 2 --pp 2 --tp 2
With config.experts > 0 every block's MLP is a mixture of experts (moe.py: MoEBlock, its
experts cut over ep by parallel_layer); context parallelism re-shapes the cut chunks in place
(context.py).

The model as a sequence of layers, which the pipeline cuts between any two:

    Embedding (tokens + positions) -> Block 0 -> ... -> Block L-1 -> Head (LayerNorm, Linear)
    ids (B, T)                        x (B, T, D) ...............   logits (B, T, V)

Tensor parallel: the token table is split by vocabulary (VocabParallelEmbedding), each block by
heads and by d_ff (Megatron), the output layer by vocabulary (ColumnParallelLinear), whose
logits (B, T, V/tp) go straight into the vocabulary-parallel cross-entropy. The positions and
the LayerNorms are replicated: every tp rank computes, and gets, the same gradients for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minidist.checkpointing.recompute import checkpoint
from minidist.gpt import moe
from minidist.pipeline.partition import balance
from minidist.tensor_parallel.blocks import ParallelTransformerBlock, VocabParallelEmbedding
from minidist.tensor_parallel.layers import ColumnParallelLinear
from minidist.transformer import TransformerBlock, master_linear


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
    experts: int = 0  # > 0: every block's MLP is a mixture of this many experts (moe.py)
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


class Embedding(nn.Module):
    """Token plus learned position embeddings: ids (B, T) -> x (B, T, D)."""

    def __init__(self, tokens: nn.Module, positions: nn.Embedding):
        super().__init__()
        self.tokens, self.positions = tokens, positions
        self.where = None  # (T,) the tokens' positions; None: 0..T-1 (cp: context.py)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        where = torch.arange(ids.shape[1], device=ids.device) if self.where is None else self.where
        # called as a module (not .weight[:T]): ZeRO-3 gathers a module's weights on its call
        return self.tokens(ids) + self.positions(where)  # (B, T, D)


class Head(nn.Module):
    """The final LayerNorm and the output layer: x (B, T, D) -> logits (B, T, V) (or V/tp)."""

    def __init__(self, norm: nn.LayerNorm, out: nn.Module):
        super().__init__()
        self.norm, self.out = norm, out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class Recompute(nn.Module):
    """A block whose activations are recomputed in backward (gradient checkpointing)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x)


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
        return moe.block_full(c, seed, dtype)
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


def parallel_layer(layer: nn.Module, tp_comm, ep_comm=None) -> nn.Module:
    """The same layer cut over tp_comm: this rank's slices of every split weight (from_full);
    a mixture-of-experts block's experts cut over ep_comm (None: all of them here)."""
    if isinstance(layer, moe.MoEBlock):
        return moe.parallel_block(layer, tp_comm, ep_comm)
    if isinstance(layer, Embedding):
        return Embedding(VocabParallelEmbedding.from_full(layer.tokens, tp_comm), layer.positions)
    if isinstance(layer, TransformerBlock):
        return ParallelTransformerBlock.from_full(layer, tp_comm)
    if isinstance(layer, Head):
        return Head(layer.norm, ColumnParallelLinear.from_full(layer.out, tp_comm))
    raise TypeError(f"no tensor-parallel form for {type(layer).__name__}")


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


def stage_chunks(
    config: GPTConfig,
    tp_comm,
    layer_ids: list[list[int]],
    dtype=torch.float32,
    recompute: bool = False,
    device=None,
    ep_comm=None,
) -> list[nn.Sequential]:
    """This rank's chunks: each an nn.Sequential of its layers cut over tp_comm (and the
    experts over ep_comm). Only these layers are ever built, full and then sliced (a larger
    model would draw the slices alone). recompute: every block checkpointed (its activations
    recomputed in backward). device: where the chunks go (built on the CPU, then moved)."""
    chunks = []
    for ids in layer_ids:
        layers = [parallel_layer(layer_full(config, i, dtype), tp_comm, ep_comm) for i in ids]
        if recompute:
            blocks = (ParallelTransformerBlock, moe.MoEBlock)
            layers = [Recompute(x) if isinstance(x, blocks) else x for x in layers]
        chunks.append(nn.Sequential(*layers).to(device or "cpu"))
    return chunks


def unwrap(layer: nn.Module) -> nn.Module:
    """The layer itself, without a Recompute around it."""
    return layer.block if isinstance(layer, Recompute) else layer


def loss_full(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over all B*T tokens: logits (B, T, V), targets (B, T)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
