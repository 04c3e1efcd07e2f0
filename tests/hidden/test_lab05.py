"""Hidden checks of lab 05 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests, fixed cases on three ranks, float64 against one nn.Linear or one
F.cross_entropy (slices taken here, never by the module): the row-parallel layer in all four
modes with a bias (a bias added before g counts three times; a missing g leaves partial sums;
without f on the bias under sequence parallelism its gradient sees a third of the tokens); the
cross-entropy with each row's largest logit on another rank than its target, at scores of 1e4
(a shift by this rank's max, or no shift, gives inf or a wrong sum); the sequence-parallel
column layer's backward (a split instead of a reduce-scatter of dL/dx: a missing f).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minidist.testing import check_all, impl, run_threads

F64 = torch.float64
FAST = {"timeout": 30, "comm_timeout": 3}
RTOL, ATOL = 1e-12, 1e-12


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def linear_and_data(i: int, o: int, b: int, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(i, o, dtype=F64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(o, i, generator=g, dtype=F64))
        lin.bias.copy_(torch.randn(o, generator=g, dtype=F64))
    x = torch.randn(b, t, i, generator=g, dtype=F64)
    gy = torch.randn(b, t, o, generator=g, dtype=F64)
    return lin, x, gy


def row_layer(comm, split_here: bool, sp: bool) -> None:
    """RowParallelLinear(I=6, O=5, bias) vs nn.Linear: y (this rank's tokens with sp), dL/dx
    (its columns unless split here), this rank's columns of dL/dW, and dL/db whole."""
    tp = impl("tensor_parallel.layers")
    p, r = comm.world_size, comm.rank
    lin, x, gy = linear_and_data(2 * p, 5, 2, 2 * p, seed=51)
    x_ref = leaf(x)
    y_ref = lin(x_ref)
    y_ref.backward(gy)
    cols = slice(2 * r, 2 * r + 2)  # this rank's input features
    toks = slice(2 * r, 2 * r + 2) if sp else slice(None)  # this rank's tokens
    layer = tp.RowParallelLinear.from_full(
        lin, comm, input_is_parallel=not split_here, sequence_parallel=sp
    )
    x_in = leaf(x if split_here else x[..., cols])
    y = layer(x_in)
    y.backward(gy[:, toks])
    pairs = {
        "y": (y, y_ref[:, toks]),
        "dL/dx": (x_in.grad, x_ref.grad if split_here else x_ref.grad[..., cols]),
        "dL/dW": (layer.weight.grad, lin.weight.grad[:, cols]),
        "dL/db": (layer.bias.grad, lin.bias.grad),
    }
    check_all(comm, pairs, RTOL, ATOL, context=f"row split_here={split_here} sp={sp}")


@pytest.mark.threads
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("split_here", [False, True])
def test_05_1_row_parallel_with_a_bias_on_three_ranks(split_here, sp):
    run_threads(row_layer, 3, split_here, sp, **FAST)


def cross_entropy_far_max(comm) -> None:
    """Logits (2, 3, 3p) at about 1e4: each row's largest logit sits on the rank after its
    target's; loss and dL/dlogits vs F.cross_entropy on the whole vocabulary."""
    tp = impl("tensor_parallel.layers")
    p, r = comm.world_size, comm.rank
    v = 3 * p
    g = torch.Generator().manual_seed(52)
    logits = torch.randn(2, 3, v, generator=g, dtype=F64) * 1e4  # (B, T, V)
    target = torch.randint(0, v, (2, 3), generator=g)
    far = (target + 3) % v  # another rank's column
    logits.scatter_(-1, far[..., None], 3e4)  # the max over the vocabulary, not the target
    gl = torch.randn(2, 3, generator=g, dtype=F64)
    full = leaf(logits)
    ref = F.cross_entropy(full.view(-1, v), target.view(-1), reduction="none").view(2, 3)
    ref.backward(gl)
    mine = leaf(logits[..., 3 * r : 3 * r + 3])
    loss = tp.vocab_parallel_cross_entropy(mine, target, comm)
    loss.backward(gl)
    pairs = {"loss": (loss, ref), "dL/dlogits": (mine.grad, full.grad[..., 3 * r : 3 * r + 3])}
    check_all(comm, pairs, RTOL, 1e-9)


@pytest.mark.threads
def test_05_2_cross_entropy_with_the_max_on_another_rank_at_scores_of_1e4():
    run_threads(cross_entropy_far_max, 3, **FAST)


def sequence_parallel_column(comm) -> None:
    """ColumnParallelLinear(I=4, O=3p, bias, sequence_parallel) vs nn.Linear: x_local this
    rank's tokens, y_local its output columns for every token; dL/dx_local, its rows of dL/dW
    and dL/db."""
    tp = impl("tensor_parallel.layers")
    p, r = comm.world_size, comm.rank
    lin, x, gy = linear_and_data(4, 3 * p, 2, 2 * p, seed=53)
    x_ref = leaf(x)
    lin(x_ref).backward(gy)
    outs, toks = slice(3 * r, 3 * r + 3), slice(2 * r, 2 * r + 2)
    layer = tp.ColumnParallelLinear.from_full(lin, comm, sequence_parallel=True)
    x_in = leaf(x[:, toks])
    y = layer(x_in)
    y.backward(gy[..., outs])
    pairs = {
        "y": (y, lin(x).detach()[..., outs]),
        "dL/dx": (x_in.grad, x_ref.grad[:, toks]),
        "dL/dW": (layer.weight.grad, lin.weight.grad[outs]),
        "dL/db": (layer.bias.grad, lin.bias.grad[outs]),
    }
    check_all(comm, pairs, RTOL, ATOL)


@pytest.mark.threads
def test_05_3_sequence_parallel_column_backward_on_three_ranks():
    run_threads(sequence_parallel_column, 3, **FAST)
