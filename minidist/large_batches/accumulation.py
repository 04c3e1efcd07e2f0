"""Gradient accumulation: one optimizer step over m microbatches, each run forward and backward
on its own and their gradients summed: the activation memory of a microbatch, the step of the
whole batch.

Equals: one step on the concatenated batch of B = m b rows, with the loss a mean over rows,
when the model treats rows independently (no BatchNorm) and draws no random numbers (dropout
draws other masks for b rows than for B): float64, 1e-12 relative (the sum over rows happens in
another order); with m = 1, exactly the plain step.
Why 1/m: mean_B(l) = (1/m) sum_j mean_b(l)_j for equal microbatches, so each microbatch's loss
is scaled by 1/m before its backward and the gradients add up in .grad.
Communication per step, per rank: none by itself; under data parallelism pass no_sync and
finish (DataParallelBucketed's), and the gradients are reduced once per step, not m times.
Memory per rank: activations of b = B/m rows (1/m of the whole batch's); gradients once.
Ladder: microbatches (equal splits, uneven refused) -> accumulate (m forward/backward) ->
train_step (zero_grad, accumulate, finish, step).
Paper: Ott et al., Scaling Neural Machine Translation (WMT 2018): "accumulating gradients from
multiple backward passes" to train with large batches on few GPUs.
Lesson: lessons/11_large_batches/.   Run: python lessons/11_large_batches/demo.py
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn


def microbatches(x: torch.Tensor, y: torch.Tensor, n_microbatches: int) -> list[tuple]:
    """x: (B, ...), y: (B, ...) -> m pairs (x_j, y_j) of B/m rows each, in order."""
    n = x.shape[0]
    if n_microbatches < 1 or n % n_microbatches != 0:
        raise ValueError(f"batch={n} is not divisible by n_microbatches={n_microbatches}")
    if y.shape[0] != n:
        raise ValueError(f"x has {n} rows but y has {y.shape[0]}")
    return list(zip(x.chunk(n_microbatches), y.chunk(n_microbatches), strict=True))


def accumulate(
    model: nn.Module,
    loss_fn: Callable,
    x: torch.Tensor,
    y: torch.Tensor,
    n_microbatches: int,
    backward: Callable | None = None,
    no_sync: Callable | None = None,
) -> torch.Tensor:
    """Forward and backward of each microbatch; the gradients add up in .grad. Returns the
    mean loss over the whole batch (detached).

    backward(loss): how a microbatch's loss goes backward (default loss.backward(); mixed
    precision passes MixedPrecisionOptimizer.backward, which scales it). no_sync: a context
    manager factory used around every microbatch but the last (data parallelism reduces only
    then). loss_fn must return a mean over the rows it is given.
    """
    backward = backward or torch.Tensor.backward
    total = torch.zeros((), dtype=torch.float64)
    pairs = microbatches(x, y, n_microbatches)
    for j, (x_j, y_j) in enumerate(pairs):
        last = j == len(pairs) - 1
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            loss = loss_fn(model(x_j), y_j) / n_microbatches  # mean_b / m: see the docstring
            backward(loss)
        total += loss.detach().double().cpu()
    return total


def train_step(
    model: nn.Module,
    loss_fn: Callable,
    x: torch.Tensor,
    y: torch.Tensor,
    optimizer,
    n_microbatches: int = 1,
    backward: Callable | None = None,
    no_sync: Callable | None = None,
    finish: Callable | None = None,
) -> float:
    """One training step on the batch (x, y), as n_microbatches accumulated microbatches.

    zero_grad, accumulate, finish() (e.g. DataParallelBucketed.finish_gradient_sync), then
    optimizer.step(). `optimizer` is anything with zero_grad() and step(): a torch optimizer
    or a MixedPrecisionOptimizer. Returns the mean loss over the batch.
    """
    optimizer.zero_grad()
    loss = accumulate(model, loss_fn, x, y, n_microbatches, backward, no_sync)
    if finish is not None:
        finish()
    optimizer.step()
    return loss.item()
