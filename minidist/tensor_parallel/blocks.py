"""Tensor-parallel transformer layers: the vocabulary-parallel embedding, and the MLP, the
self-attention and the pre-LayerNorm block built from column- and row-parallel linears, with
Megatron's sequence parallelism as an option.

Equals: TransformerBlock (minidist/transformer.py: the same block in one process, full weights) and
nn.Embedding: outputs, input gradients, each rank's slice of every weight gradient. float64: 1e-12
relative; float32: 1e-5 (see tests/test_tensor_parallel.py).
Communication per block, per rank (p ranks on tp_comm, x: (B, T, D), b bytes an element):
  forward 2 all-reduces of B*T*D elements (g after attention and after the MLP), backward 2 (f
  before them); the ring sends 2(p-1)/p * B*T*D*b bytes for each.
  sequence_parallel: forward 2 all-gathers (payload B*T*D/p each) + 2 reduce-scatters (payload
  B*T*D); backward 4 all-gathers (two of them gather the saved input shards again) + 2
  reduce-scatters, and 6 all-reduces of D elements (the gradients of the LayerNorms and the
  row-parallel biases, which each rank saw for T/p tokens only). Ring: the same bytes forward.
Memory per rank (F = d_ff, H heads): weights 1/p, LayerNorms and the row biases whole.
  Activations saved for backward, in elements (measured by saved_activation_nbytes):
    tp = 1:                 A = 8BTD + 2BTF + BHT^2 + 4BT
    tp = p:                 4BTD + 4BT + (4BTD + 2BTF + BHT^2)/p   (LayerNorms and the inputs
                            of qkv and fc1 are replicated)
    tp = p, sequence par.:  A/p   (the replicated ones are split along T)
Ladder: VocabParallelEmbedding -> ParallelMLP (column -> gelu -> row: one f, one g) ->
ParallelSelfAttention (heads split) -> ParallelTransformerBlock -> sequence_parallel=True.
Paper: Shoeybi et al., Megatron-LM (2019), section 3 and figure 3; Korthikanti et al. (2022),
section 4.2.2 and table 2.   Lesson: lessons/05_tensor_parallel/.
Run: minidist run -n 2 --backend mpi lessons/05_tensor_parallel/demo.py

Entering and leaving sequence parallelism (e.g. around a stack of blocks):
    x_local = ScatterToRegion.apply(x, tp_comm, 1)        # (B, T, D) -> (B, T/p, D)
    y = GatherFromRegion.apply(y_local, tp_comm, 1)       # (B, T/p, D) -> (B, T, D)
or VocabParallelEmbedding(sequence_parallel=True), which reduce-scatters straight into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minidist.memory import SavedTensorMeter
from minidist.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from minidist.tensor_parallel.mappings import ReduceScatterToSequence, check_divisible, f, g
from minidist.transformer import TransformerBlock, attention


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by tokens: rank r keeps rows r*V/p..(r+1)*V/p.

    ids: (B, T), the same on every rank -> (B, T, D): each rank looks up the tokens it owns and
    writes zeros for the others, then g sums (one all-reduce of B*T*D elements). With
    sequence_parallel a reduce-scatter along T instead -> (B, T/p, D). Built from a seed (the full
    table drawn N(0, 1) as nn.Embedding does, from torch.Generator(seed)) or from_full."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        tp_comm,
        sequence_parallel: bool = False,
        seed: int = 0,
        dtype=None,
        device=None,
    ):
        super().__init__()
        self.tp_comm, self.sequence_parallel = tp_comm, sequence_parallel
        self.vocab_size = vocab_size
        self.v_local = check_divisible("vocab_size", vocab_size, tp_comm.world_size)
        self.lo = tp_comm.rank * self.v_local
        self.weight = nn.Parameter(torch.empty(self.v_local, d_model, dtype=dtype, device=device))
        gen = torch.Generator().manual_seed(seed)
        self.load_full_(torch.randn(vocab_size, d_model, generator=gen, dtype=self.weight.dtype))

    @classmethod
    def from_full(cls, emb: nn.Embedding, tp_comm, **kwargs) -> VocabParallelEmbedding:
        """This rank's rows of an nn.Embedding (kwargs: sequence_parallel)."""
        w = emb.weight
        layer = cls(w.shape[0], w.shape[1], tp_comm, dtype=w.dtype, device=w.device, **kwargs)
        return layer.load_full_(w)

    @torch.no_grad()
    def load_full_(self, w_full: torch.Tensor):
        self.weight.copy_(w_full[self.lo : self.lo + self.v_local])
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.vocab_size}), got "
                f"[{ids.min().item()}, {ids.max().item()}]"
            )
        mine = (ids >= self.lo) & (ids < self.lo + self.v_local)  # (B, T)
        e = F.embedding(torch.where(mine, ids - self.lo, 0), self.weight)  # (B, T, D)
        e = e.masked_fill(~mine[..., None], 0.0)  # another rank owns these tokens
        if self.sequence_parallel:
            return ReduceScatterToSequence.apply(e, self.tp_comm)  # (B, T/p, D)
        return g(e, self.tp_comm)


class ParallelMLP(nn.Module):
    """fc2(gelu(fc1(x))), fc1 column-parallel (d_ff split), fc2 row-parallel: gelu runs on each
    rank's own d_ff/p columns, so the only communication is fc1's f and fc2's g.

    x: (B, T, D) -> (B, T, D); sequence_parallel: (B, T/p, D) -> (B, T/p, D). Seeds: fc1 seed,
    fc2 seed + 1."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        tp_comm,
        seed: int = 0,
        sequence_parallel: bool = False,
        dtype=None,
        device=None,
    ):
        super().__init__()
        check_divisible("d_ff", d_ff, tp_comm.world_size)
        kw = {"sequence_parallel": sequence_parallel, "dtype": dtype, "device": device}
        self.fc1 = ColumnParallelLinear(d_model, d_ff, tp_comm, seed=seed, **kw)
        self.fc2 = RowParallelLinear(
            d_ff, d_model, tp_comm, input_is_parallel=True, seed=seed + 1, **kw
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (B, T, d_ff/p) in between


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention with the heads split: rank r computes heads r*H/p..(r+1)*H/p.

    qkv is column-parallel in 3 parts (this rank's q, k and v columns), each rank attends with
    its heads alone (no communication), proj is row-parallel: one f, one g. x: (B, T, D) ->
    (B, T, D); sequence_parallel: (B, T/p, D) -> (B, T/p, D). Seeds: qkv seed, proj seed + 1."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        tp_comm,
        causal: bool = True,
        seed: int = 0,
        sequence_parallel: bool = False,
        dtype=None,
        device=None,
    ):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads_local = check_divisible("n_heads", n_heads, tp_comm.world_size)
        self.causal = causal
        kw = {"sequence_parallel": sequence_parallel, "dtype": dtype, "device": device}
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, tp_comm, parts=3, seed=seed, **kw)
        self.proj = RowParallelLinear(
            d_model, d_model, tp_comm, input_is_parallel=True, seed=seed + 1, **kw
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv_local = self.qkv(x)  # (B, T, 3D/p): T whole, also with sequence parallelism
        return self.proj(attention(qkv_local, self.n_heads_local, self.causal))


class ParallelTransformerBlock(nn.Module):
    """A pre-LayerNorm transformer block, tensor-parallel: the twin of TransformerBlock.

    x: (B, T, D), the same on every rank -> (B, T, D); sequence_parallel: x_local (B, T/p, D),
    this rank's tokens T/p*r..T/p*(r+1) -> (B, T/p, D), and T must be divisible by p. The
    LayerNorms are replicated; with sequence parallelism each rank normalises its own tokens,
    and their weights pass through f so the gradients are summed over the ranks.
    Built from a seed (equal to TransformerBlock(seed=seed), sliced) or from_full(block)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        tp_comm,
        causal: bool = True,
        seed: int = 0,
        sequence_parallel: bool = False,
        dtype=None,
        device=None,
    ):
        super().__init__()
        self.tp_comm, self.sequence_parallel = tp_comm, sequence_parallel
        kw = {"sequence_parallel": sequence_parallel, "dtype": dtype, "device": device}
        self.ln1 = nn.LayerNorm(d_model, dtype=dtype, device=device)
        self.attn = ParallelSelfAttention(d_model, n_heads, tp_comm, causal, seed, **kw)
        self.ln2 = nn.LayerNorm(d_model, dtype=dtype, device=device)
        self.mlp = ParallelMLP(d_model, d_ff, tp_comm, seed + 2, **kw)

    @classmethod
    def from_full(cls, block: TransformerBlock, tp_comm, sequence_parallel: bool = False):
        """This rank's slices of a TransformerBlock's weights (anything with its layout)."""
        w = block.qkv.weight
        d_model, d_ff = w.shape[1], block.fc1.weight.shape[0]
        new = cls(
            d_model,
            block.n_heads,
            d_ff,
            tp_comm,
            block.causal,
            sequence_parallel=sequence_parallel,
            dtype=w.dtype,
            device=w.device,
        )
        new.attn.qkv.load_full_(block.qkv.weight, block.qkv.bias)
        new.attn.proj.load_full_(block.proj.weight, block.proj.bias)
        new.mlp.fc1.load_full_(block.fc1.weight, block.fc1.bias)
        new.mlp.fc2.load_full_(block.fc2.weight, block.fc2.bias)
        new.ln1.load_state_dict(block.ln1.state_dict())
        new.ln2.load_state_dict(block.ln2.state_dict())
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self._norm(self.ln1, x))
        return x + self.mlp(self._norm(self.ln2, x))

    def _norm(self, ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return ln(x)  # every rank normalises all tokens: the same gradients everywhere
        # each rank saw T/p tokens: f sums the weight and bias gradients over the ranks
        c = self.tp_comm
        return F.layer_norm(x, ln.normalized_shape, f(ln.weight, c), f(ln.bias, c), ln.eps)


def saved_activation_nbytes(module: nn.Module, run) -> tuple[int, object]:
    """(bytes autograd keeps for backward while run() executes, run()'s result): the peak of
    memory.SavedTensorMeter, the module's parameters left out. A measurement, not an estimate."""
    with SavedTensorMeter(exclude=module.parameters()) as meter:
        out = run()
    return meter.peak, out


def activation_elements(b: int, t: int, d: int, h: int, d_ff: int, p: int, sp: bool) -> int:
    """The module docstring's formula: elements a block keeps for backward, per rank."""
    full = 8 * b * t * d + 2 * b * t * d_ff + b * h * t * t + 4 * b * t
    if sp:
        return full // p
    return 4 * b * t * d + 4 * b * t + (4 * b * t * d + 2 * b * t * d_ff + b * h * t * t) // p
