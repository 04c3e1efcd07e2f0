"""Tensor parallelism's communication as autograd functions: Megatron's f and g and their
sequence-parallel kin, apart from the layers that use them (as Megatron's mappings.py is apart
from its layers.py).

    f  (CopyToRegion)             identity forward, all-reduce backward: enters a parallel region
    g  (ReduceFromRegion)         all-reduce forward, identity backward: leaves it
    ScatterToRegion / GatherFromRegion    split / all-gather along a dimension, and back
    ReduceScatterToSequence       sequence-parallel g: sum and keep this rank's T/p tokens

Each one's backward is its conjugate's forward. Communication: one all-reduce (f backward,
g forward) of the tensor's elements, or one all-gather / reduce-scatter along a dimension.
Equals: the identity on the whole tensor in one process (tests/test_tensor_parallel.py).
Lesson: lessons/05_tensor_parallel/.
"""

from __future__ import annotations

import torch


def check_divisible(name: str, n: int, p: int) -> int:
    """n // p, or ValueError naming both numbers (a remainder would be dropped silently)."""
    if n % p != 0:
        raise ValueError(f"{name}={n} is not divisible by tp={p}")
    return n // p


def split_along(x: torch.Tensor, comm, dim: int) -> torch.Tensor:
    """This rank's chunk of x along dim, a new contiguous tensor: (.., n, ..) -> (.., n/p, ..)."""
    n = check_divisible(f"x.shape[{dim}]", x.shape[dim], comm.world_size)
    return x.narrow(dim, comm.rank * n, n).clone(memory_format=torch.contiguous_format)


def gather_along(x: torch.Tensor, comm, dim: int) -> torch.Tensor:
    """All-gather x along dim, rank 0's chunk first: (.., n, ..) -> (.., p*n, ..)."""
    d, p = dim % x.dim(), comm.world_size
    out = torch.empty((p, *x.shape), dtype=x.dtype, device=x.device)  # (p, .., n, ..)
    comm.all_gather(out, x.contiguous())
    return out.movedim(0, d).reshape(*x.shape[:d], p * x.shape[d], *x.shape[d + 1 :])


def reduce_scatter_along(x: torch.Tensor, comm, dim: int) -> torch.Tensor:
    """Sum x over the ranks and keep this rank's chunk along dim: (.., n, ..) -> (.., n/p, ..)."""
    d, p = dim % x.dim(), comm.world_size
    n = check_divisible(f"x.shape[{dim}]", x.shape[d], p)
    chunks = x.reshape(*x.shape[:d], p, n, *x.shape[d + 1 :]).movedim(d, 0).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)  # (.., n/p, ..)
    comm.reduce_scatter(out, chunks, "sum")  # rank r gets the sum of every rank's chunk r
    return out


# ---- the conjugate operators: each one's backward is the other one's forward ----------------


class CopyToRegion(torch.autograd.Function):
    """f: identity forward; backward all-reduces (sums) the gradient on comm.

    Enters the parallel region: every rank feeds the whole x to its slice of the layer, so each
    rank's backward holds only its slice's part of dL/dx, and the parts must be summed."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone(memory_format=torch.contiguous_format)
        ctx.comm.all_reduce(total, "sum")
        return total, None


class ReduceFromRegion(torch.autograd.Function):
    """g: forward all-reduces (sums) the partial results on comm; backward is the identity.

    Leaves the parallel region: after it every rank holds the same full result, so the
    gradient arriving from the (replicated) code after it is already the full dL/dy."""

    @staticmethod
    def forward(ctx, x, comm):
        total = x.clone(memory_format=torch.contiguous_format)  # a new tensor: x is not touched
        comm.all_reduce(total, "sum")
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScatterToRegion(torch.autograd.Function):
    """Keep this rank's chunk of x along dim; backward all-gathers the gradient chunks."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return split_along(x, comm, dim)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.comm, ctx.dim), None, None


class GatherFromRegion(torch.autograd.Function):
    """All-gather x along dim; backward keeps this rank's chunk (the code after it is replicated,
    so every rank already holds the whole gradient)."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return gather_along(x, comm, dim)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, ctx.comm, ctx.dim), None, None


class ReduceScatterToSequence(torch.autograd.Function):
    """Sequence-parallel g: sum the partial results and keep this rank's T/p tokens.

    x: (B, T, D) partial -> (B, T/p, D) summed; backward all-gathers the gradient along T."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return reduce_scatter_along(x, comm, 1)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.comm, 1), None


def f(x: torch.Tensor, comm) -> torch.Tensor:
    """Megatron's f (CopyToRegion): identity forward, all-reduce backward."""
    return CopyToRegion.apply(x, comm)


def g(x: torch.Tensor, comm) -> torch.Tensor:
    """Megatron's g (ReduceFromRegion): all-reduce forward, identity backward."""
    return ReduceFromRegion.apply(x, comm)
