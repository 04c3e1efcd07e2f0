"""Hidden checks of lab 14 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests: keep_mask against a plain loop over every assignment (empty groups,
capacity 0, one expert, k = 2), the auxiliary loss's value and gradient for other shapes and
float32, and a collapsed router that sends every token of every rank to one rank's expert.
"""

from __future__ import annotations

import pytest
import torch

from minidist.testing import check_all, impl, run_threads

F64 = torch.float64


def keep_by_loop(choices: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """The documented order, one assignment at a time: every first choice in token order, then
    every second choice; an expert keeps its first cap assignments."""
    n, k = choices.shape
    keep = torch.zeros(n, k, dtype=torch.bool)
    taken = [0] * n_experts
    for j in range(k):
        for i in range(n):
            e = int(choices[i, j])
            keep[i, j] = taken[e] < cap
            taken[e] += 1
    return keep


@pytest.mark.pure
def test_14_1_keep_mask_equals_a_loop_over_assignments_in_priority_order():
    ep = impl("expert_parallel.moe")
    gen = torch.Generator().manual_seed(14)
    for n in (0, 1, 7, 30):
        for n_experts, k in ((1, 1), (3, 1), (3, 2), (8, 2)):
            choices = torch.rand(n, n_experts, generator=gen).argsort(-1)[:, :k]  # (n, k)
            for cap in (0, 1, 2, 5, k * n):
                got = ep.keep_mask(choices, n_experts, cap)
                want = keep_by_loop(choices, n_experts, cap)
                assert got.dtype == torch.bool and got.shape == (n, k), (got.dtype, got.shape)
                assert torch.equal(got, want), (n, n_experts, k, cap, got, want)


@pytest.mark.pure
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_14_2_switch_aux_loss_value_and_gradient_for_other_shapes(dtype):
    """alpha E sum_i f_i P_i, and its gradient alpha E f_j / n on every probs[t, j] (f has no
    gradient); an empty group pays 0, still connected to the router."""
    ep = impl("expert_parallel.moe")
    gen = torch.Generator().manual_seed(15)
    n = 7
    n_experts = 5
    alpha = 0.3
    probs = torch.softmax(torch.randn(n, n_experts, generator=gen, dtype=dtype), -1)
    probs.requires_grad_()
    first = torch.tensor([3, 0, 1, 2, 1])  # counts, int64
    loss = ep.switch_aux_loss(probs, first, alpha)
    f = first.to(F64) / n
    want = alpha * n_experts * (f * probs.detach().to(F64).mean(0)).sum()
    assert loss.dim() == 0 and loss.dtype == dtype, (loss.shape, loss.dtype)
    tol = 1e-12 if dtype == F64 else 1e-6
    assert loss.item() == pytest.approx(want.item(), rel=tol)
    loss.backward()
    grad_want = (alpha * n_experts * f / n).expand(n, n_experts).to(dtype)
    assert torch.allclose(probs.grad, grad_want, rtol=tol, atol=0), probs.grad
    empty = torch.zeros(0, n_experts, dtype=dtype, requires_grad=True)
    zero = ep.switch_aux_loss(empty, torch.zeros(n_experts, dtype=torch.int64), alpha)
    assert zero.dim() == 0 and zero.item() == 0.0
    zero.backward()  # connected: backward runs
    assert empty.grad is not None and empty.grad.shape == (0, n_experts)


def collapsed(comm) -> None:
    """Every token of every rank picks the last rank's first expert (a constant feature times a
    large router weight): the layer still equals MoE on each group, dx and that expert's
    gradient included; the other experts get no rows."""
    ep = impl("expert_parallel.moe")
    p = comm.world_size
    r = comm.rank
    d = 3
    n = 4
    n_experts = 2 * p
    target = n_experts - 2  # the last rank's first expert
    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(p * n, d, generator=gen, dtype=F64)
    xs[:, 0] = 1.0  # the constant feature the router keys on
    gy = torch.randn(p * n, d, generator=gen, dtype=F64)
    full = ep.MoE(d, 4, n_experts, 1, None, seed=3)
    layer = ep.ExpertParallelMoE(d, 4, n_experts, comm, 1, None, seed=3)
    with torch.no_grad():
        for router in (full.router, layer.router):
            router.weight.zero_()
            router.weight[target, 0] = 50.0
    x_ref = xs.clone().requires_grad_()
    y_ref, _ = full(x_ref, [n] * p)
    (y_ref * gy).sum().backward()
    x = xs[r * n : (r + 1) * n].clone().requires_grad_()
    y, _ = layer(x)
    (y * gy[r * n : (r + 1) * n]).sum().backward()
    pairs = {"y": (y, y_ref[r * n : (r + 1) * n]), "dx": (x.grad, x_ref.grad[r * n : (r + 1) * n])}
    for local, expert in enumerate(layer.experts):
        e = layer.lo + local
        for name, q in expert.named_parameters():
            want = full.experts[e].get_parameter(name).grad
            got = q.grad if q.grad is not None else torch.zeros_like(q)
            pairs[f"expert {e} {name}"] = (got, want if want is not None else torch.zeros_like(q))
    check_all(comm, pairs, rtol=1e-12, atol=1e-13)


@pytest.mark.threads
@pytest.mark.parametrize("p", [1, 3])
def test_14_3_a_collapsed_router_sends_every_token_to_one_rank(p):
    run_threads(collapsed, p, timeout=40, comm_timeout=8)
