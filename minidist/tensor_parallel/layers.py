"""Tensor parallelism: split each weight matrix across the ranks of a group, so every rank does
1/p of every matmul, and combine the partial results inside the layer.

Equals: the same layer in one process with the full weights (nn.Linear, F.cross_entropy):
outputs, input gradients and each rank's slice of every weight gradient. float64: 1e-12
relative (an all-reduce sums partial products in another order than one matmul); at tp = 1
ColumnParallelLinear runs nn.Linear's very op (bitwise equal).
Communication per layer, per rank (p ranks on tp_comm, activations (B, T, D), b bytes each):
  ColumnParallelLinear  forward none; backward one all-reduce of B*T*D_in elements (f)
  RowParallelLinear     forward one all-reduce of B*T*D_out elements (g); backward none
  vocab_parallel_cross_entropy  forward three all-reduces of N elements (N tokens); backward none
  The ring sends 2(p-1)/p * n * b bytes per all-reduce of n elements.
  Sequence parallel: g becomes a reduce-scatter along T (payload B*T*D_out; backward an
  all-gather), f an all-gather along T (payload B*T*D_in/p) whose backward gathers again and
  reduce-scatters; in the ring an all-gather plus a reduce-scatter move the bytes of one
  all-reduce. The row bias then needs f: one all-reduce of D_out elements in backward.
Memory per rank: 1/p of each weight (a row-parallel bias whole); the activations a layer saves
for backward are 1/p where its input is split (with sequence parallelism: always).
Ladder: f, g (the conjugate operators) -> ColumnParallelLinear, RowParallelLinear ->
vocab_parallel_cross_entropy -> sequence parallelism (all-gather and reduce-scatter along T)
-> the embedding, MLP, attention and block of tensor_parallel/blocks.py.
Paper: Shoeybi et al., Megatron-LM (2019), section 3; Korthikanti et al., Reducing Activation
Recomputation in Large Transformer Models (2022), section 4.2.2 (sequence parallelism).
Lesson: lessons/05_tensor_parallel/.   Run: minidist run -n 2 lessons/05_tensor_parallel/demo.py

Every layer takes its tensor-parallel communicator `tp_comm` explicitly; all ranks of tp_comm
must call the same layers in the same order with the same shapes (collectives match by order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minidist.tensor_parallel.mappings import (
    GatherFromRegion,
    ReduceScatterToSequence,
    ScatterToRegion,
    check_divisible,
    f,
    g,
    gather_along,
    reduce_scatter_along,
)
from minidist.transformer import master_linear


class LinearWithSequenceGather(torch.autograd.Function):
    """Sequence-parallel f fused with a column-parallel matmul: y = linear(all_gather_T(x), w, b).

    x_local: (B, T/p, I) -> y_local: (B, T, O/p). Forward: one all-gather along T. Only x_local
    is saved: backward gathers it again (the activation memory saved costs one more all-gather),
    then reduce-scatters dL/dx along T (each rank holds only its columns' part of it)."""

    @staticmethod
    def forward(ctx, x_local, w, b, comm):
        ctx.comm, ctx.has_bias = comm, b is not None
        ctx.save_for_backward(x_local, w)
        return F.linear(gather_along(x_local, comm, 1), w, b)  # (B, T, O/p)

    @staticmethod
    def backward(ctx, grad_y):  # grad_y: (B, T, O/p)
        # lab 05.3 begin: gather x again, reduce-scatter dL/dx along T, then dL/dw and dL/db
        x_local, w = ctx.saved_tensors
        x_full = gather_along(x_local, ctx.comm, 1)  # (B, T, I), gathered again, never stored
        grad_x = reduce_scatter_along(grad_y @ w, ctx.comm, 1)  # (B, T/p, I)
        grad_rows = grad_y.reshape(-1, grad_y.shape[-1])  # (B*T, O/p)
        grad_w = grad_rows.t() @ x_full.reshape(-1, x_full.shape[-1])  # (O/p, I)
        grad_b = grad_rows.sum(0) if ctx.has_bias else None  # (O/p,)
        return grad_x, grad_w, grad_b, None
        # lab 05.3 end


# ---- sharded initialisation: the full master weight from a seed, this rank's slice kept --------


def column_slice(t_full: torch.Tensor, rank: int, p: int, parts: int = 1) -> torch.Tensor:
    """Rows [rank*n, (rank+1)*n) of each of `parts` stacked blocks (e.g. q, k, v), n = O/parts/p:
    (O, ..) -> (O/p, ..)."""
    blocks = t_full.reshape(parts, t_full.shape[0] // parts, *t_full.shape[1:])
    n = blocks.shape[1] // p
    return blocks[:, rank * n : (rank + 1) * n].reshape(parts * n, *t_full.shape[1:])


def from_full(cls, linear: nn.Linear, tp_comm, **kwargs):
    """A cls (ColumnParallelLinear or RowParallelLinear) holding this rank's slice of linear:
    the same features, dtype and device, then load_full_ (each class knows its slice)."""
    w = linear.weight  # (O, I)
    has_bias = linear.bias is not None
    layer = cls(w.shape[1], w.shape[0], tp_comm, has_bias, dtype=w.dtype, device=w.device, **kwargs)
    return layer.load_full_(w, linear.bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (the output features) split: rank r keeps rows r*O/p..(r+1)*O/p
    of W and b (of each of `parts` stacked blocks: parts=3 for a fused q|k|v projection).

    x: (.., I), the same on every rank -> y_local: (.., O/p), or with gather_output the whole
    y: (.., O) (an all-gather; its backward keeps this rank's columns). f before the matmul: one
    all-reduce of x's elements in backward. sequence_parallel: x_local: (B, T/p, I) -> y_local:
    (B, T, O/p) through LinearWithSequenceGather instead of f.
    Built from a seed (master_linear(I, O, seed), sliced) or from an nn.Linear (from_full)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_comm,
        bias: bool = True,
        gather_output: bool = False,
        parts: int = 1,
        sequence_parallel: bool = False,
        seed: int = 0,
        dtype=None,
        device=None,
    ):
        super().__init__()
        p = tp_comm.world_size
        if out_features % (parts * p):  # each part (q, k, v) splits evenly over the ranks
            by = f"parts={parts} x tp={p}" if parts > 1 else f"tp={p}"
            raise ValueError(f"out_features={out_features} is not divisible by {by}")
        if gather_output and (parts > 1 or sequence_parallel):
            raise ValueError("gather_output needs parts=1 and sequence_parallel=False")
        self.tp_comm, self.parts = tp_comm, parts
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        kw = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features // p, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(out_features // p, **kw)) if bias else None
        self.load_full_(*master_linear(in_features, out_features, seed, bias, dtype))

    # this rank's slice of an nn.Linear; kwargs: gather_output, parts, sequence_parallel
    from_full = classmethod(from_full)

    @torch.no_grad()
    def load_full_(self, w_full: torch.Tensor, b_full: torch.Tensor | None = None):
        """Copy this rank's rows of the full weight (O, I) and bias (O,) into the layer."""
        rank, p = self.tp_comm.rank, self.tp_comm.world_size
        self.weight.copy_(column_slice(w_full, rank, p, self.parts))
        if self.bias is not None:
            self.bias.copy_(column_slice(b_full, rank, p, self.parts))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return LinearWithSequenceGather.apply(x, self.weight, self.bias, self.tp_comm)
        y_local = F.linear(f(x, self.tp_comm), self.weight, self.bias)  # (.., O/p)
        if self.gather_output:
            return GatherFromRegion.apply(y_local, self.tp_comm, -1)  # (.., O)
        return y_local


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (the input features) split: rank r keeps W[:, r*I/p..
    (r+1)*I/p]; the bias is whole and added once, after the reduction.

    x_local: (.., I/p) (input_is_parallel, e.g. a ColumnParallelLinear's output) or x: (.., I)
    (split here; its backward all-gathers) -> y: (.., O) on every rank, by g: one all-reduce of
    y's elements forward. sequence_parallel: (B, T, I/p) -> y_local: (B, T/p, O), a reduce-scatter
    along T instead of g (the bias's gradient then needs f: each rank sees T/p tokens)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_comm,
        bias: bool = True,
        input_is_parallel: bool = False,
        sequence_parallel: bool = False,
        seed: int = 0,
        dtype=None,
        device=None,
    ):
        super().__init__()
        p = tp_comm.world_size
        check_divisible("in_features", in_features, p)
        self.tp_comm, self.input_is_parallel = tp_comm, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        kw = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // p, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.load_full_(*master_linear(in_features, out_features, seed, bias, dtype))

    # this rank's slice of an nn.Linear; kwargs: input_is_parallel, sequence_parallel
    from_full = classmethod(from_full)

    @torch.no_grad()
    def load_full_(self, w_full: torch.Tensor, b_full: torch.Tensor | None = None):
        """Copy this rank's columns of the full weight (O, I) and the whole bias into the layer."""
        n = self.weight.shape[1]
        self.weight.copy_(w_full[:, self.tp_comm.rank * n : (self.tp_comm.rank + 1) * n])
        if self.bias is not None:
            self.bias.copy_(b_full)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = self.tp_comm
        # lab 05.1 begin: split x unless input_is_parallel, local matmul, sum (g), bias once
        if not self.input_is_parallel:
            x = ScatterToRegion.apply(x, comm, -1)  # (.., I/p)
        y_partial = F.linear(x, self.weight)  # (.., O): this rank's share of the sum over I
        if self.sequence_parallel:
            y = ReduceScatterToSequence.apply(y_partial, comm)  # (B, T/p, O)
        else:
            y = g(y_partial, comm)  # (.., O), the same on every rank
        if self.bias is None:
            return y
        # after the sum: added to every partial result, the bias would be counted p times
        return y + (f(self.bias, comm) if self.sequence_parallel else self.bias)
        # lab 05.1 end


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split along the vocabulary, never gathering them.

    logits_local: (.., V/p), target: (..) -> loss: (..). Forward: three all-reduces of N
    elements (the max, subtracted for stability; the target's logit, which one rank owns;
    the sum of exponentials). Backward: softmax - one_hot, all local."""

    @staticmethod
    def forward(ctx, logits_local, target, comm):
        v_local = logits_local.shape[-1]
        lo = comm.rank * v_local
        if target.numel() and (target.min() < 0 or target.max() >= v_local * comm.world_size):
            raise ValueError(f"targets must lie in [0, {v_local * comm.world_size})")
        mine = (target >= lo) & (target < lo + v_local)  # (..) this rank owns the target
        idx = torch.where(mine, target - lo, 0)  # (..) the target's column here, 0 if not mine
        # lab 05.2 begin: shift by the max over all ranks, sum exps, pick the target; save softmax
        m = logits_local.detach().amax(-1)  # (..)
        comm.all_reduce(m, "max")  # the same shift on every rank: exp() cannot overflow
        z = logits_local - m[..., None]  # (.., V/p), all <= 0
        z_target = z.gather(-1, idx[..., None])[..., 0] * mine  # (..) zero unless mine
        comm.all_reduce(z_target, "sum")  # exactly one rank contributed
        exp = z.exp()  # (.., V/p)
        sum_exp = exp.sum(-1)  # (..)
        comm.all_reduce(sum_exp, "sum")
        ctx.save_for_backward(exp / sum_exp[..., None], idx, mine)  # softmax: all local
        return sum_exp.log() - z_target  # (..) log sum_v e^z_v - z_target
        # lab 05.2 end

    @staticmethod
    def backward(ctx, grad_loss):  # grad_loss: (..)
        softmax, idx, mine = ctx.saved_tensors
        grad = softmax.clone()  # (.., V/p)
        grad.scatter_add_(-1, idx[..., None], -mine[..., None].to(grad.dtype))  # - one_hot
        return grad * grad_loss[..., None], None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, target: torch.Tensor, tp_comm):
    """Per-token loss (..) of vocabulary-split logits (.., V/p); .mean() is F.cross_entropy."""
    return VocabParallelCrossEntropy.apply(logits_local, target, tp_comm)
