"""The plain transformer every lesson shares: one process, full weights, no communication.

    master_linear     a Linear's full weight and bias drawn from a seed, the same on every rank
                      and device: what every parallel layer slices its part from
    attention         softmax attention of n heads over a [q | k | v] projection, causal or not
    TransformerBlock  a pre-LayerNorm block, x + attn(ln1(x)), then + mlp(ln2(x))
    Embedding, Head   the layers around the blocks: tokens plus positions in, a LayerNorm and
                      the output layer out
    recording_cut     a layer cut inside it, and which of the full layer's elements the cut
                      holds

The techniques cut this model (tensor parallelism: tensor_parallel/blocks.py and
parallelize.py; context parallelism: context_parallel/; the main job: gpt/model.py builds it,
gpt/train.py applies each technique to it) and are checked against it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


def master_linear(in_features: int, out_features: int, seed: int, bias: bool = True, dtype=None):
    """The full (O, I) weight and (O,) bias of a Linear, drawn as nn.Linear draws them,
    U(-1/sqrt(I), 1/sqrt(I)), from torch.Generator(seed): identical on every rank and device."""
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(in_features)
    dtype = dtype or torch.get_default_dtype()
    w = torch.empty(out_features, in_features, dtype=dtype).uniform_(-bound, bound, generator=gen)
    b = torch.empty(out_features, dtype=dtype).uniform_(-bound, bound, generator=gen)
    return w, (b if bias else None)


def attention(qkv: torch.Tensor, n_heads: int, causal: bool) -> torch.Tensor:
    """Softmax attention of n_heads heads: qkv (B, T, 3*n_heads*hd) laid out [q | k | v], heads
    contiguous in each -> (B, T, n_heads*hd). The parallel layer calls it with its H/p heads."""
    b, t, width = qkv.shape
    hd = width // (3 * n_heads)
    q, k, v = qkv.view(b, t, 3, n_heads, hd).permute(2, 0, 3, 1, 4)  # each (B, h, T, hd)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, h, T, T)
    if causal:
        future = torch.ones(t, t, dtype=torch.bool, device=qkv.device).triu(1)  # (T, T)
        # added, not masked_fill: an addition keeps nothing for backward
        att = att + torch.zeros(t, t, dtype=att.dtype, device=att.device).masked_fill(
            future, float("-inf")
        )
    y = att.softmax(-1) @ v  # (B, h, T, hd)
    return y.transpose(1, 2).reshape(b, t, n_heads * hd)  # (B, T, h*hd)


class TransformerBlock(nn.Module):
    """The single-process twin: x + attn(ln1(x)), then + mlp(ln2(x)); (B, T, D) -> (B, T, D).

    The layout from_full reads: qkv (3D, D) with rows [q; k; v], proj (D, D), fc1 (F, D),
    fc2 (D, F), ln1, ln2. Seeded as the parallel block is: master_linear with qkv seed,
    proj seed + 1, fc1 seed + 2, fc2 seed + 3; LayerNorms ones and zeros."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        causal: bool = True,
        seed: int = 0,
        dtype=None,
        device=None,
    ):
        super().__init__()
        self.n_heads, self.causal = n_heads, causal
        shapes = {
            "qkv": (d_model, 3 * d_model),
            "proj": (d_model, d_model),
            "fc1": (d_model, d_ff),
            "fc2": (d_ff, d_model),
        }
        for i, (name, (fan_in, fan_out)) in enumerate(shapes.items()):
            layer = nn.utils.skip_init(
                nn.Linear, fan_in, fan_out, dtype=dtype, device=device or "cpu"
            )
            w, b = master_linear(fan_in, fan_out, seed + i, dtype=dtype)
            with torch.no_grad():
                layer.weight.copy_(w)
                layer.bias.copy_(b)
            setattr(self, name, layer)
        self.ln1 = nn.LayerNorm(d_model, dtype=dtype, device=device)
        self.ln2 = nn.LayerNorm(d_model, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(attention(self.qkv(self.ln1(x)), self.n_heads, self.causal))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Embedding(nn.Module):
    """Token plus learned position embeddings: ids (B, T) -> x (B, T, D). tokens: an
    nn.Embedding or its vocabulary-parallel cut; where: the tokens' positions (T,), None for
    0..T-1 (context parallelism sets this rank's)."""

    def __init__(self, tokens: nn.Module, positions: nn.Embedding):
        super().__init__()
        self.tokens, self.positions = tokens, positions
        self.where = None

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


@contextlib.contextmanager
def recording_cut(layers: nn.ModuleList, i: int, held: dict[int, torch.Tensor]) -> Iterator[None]:
    """Cut layer i inside (replace it, or its children): on leaving, held[i] says which of the
    full layer's parameter elements (laid end to end) the cut layer holds, in the order of its
    own parameters laid end to end. Inside, each parameter holds its elements' numbers
    (float64) in place of its values; cutting is slicing (copies, no arithmetic), so the
    numbers travel as the values would, and on leaving every parameter of the cut layer takes
    the values its numbers name. One cut, no communication."""
    params = list(layers[i].parameters())
    full = torch.cat([q.detach().reshape(-1) for q in params])  # the values, laid end to end
    n = 0
    for q in params:  # each element its number in the layer's parameters laid end to end
        q.data = torch.arange(n, n + q.numel(), dtype=torch.float64).view(q.shape)
        n += q.numel()
    try:
        yield
    finally:
        cut = list(layers[i].parameters())
        held[i] = torch.cat([q.detach().reshape(-1) for q in cut]).long()
        for q, mine in zip(cut, held[i].split([q.numel() for q in cut]), strict=True):
            q.data = full[mine].view(q.shape)
