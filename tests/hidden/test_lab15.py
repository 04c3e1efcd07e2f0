"""Hidden checks of lab 15 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests: merge on key sets of different sizes and with log-sum-exps far past
exp()'s range (a merge through exp(lse) gives inf / inf = nan), the ring's forward with five
ranks, odd chunks and scores of 1e4, and block_grads on its own, one block and two.
"""

from __future__ import annotations

import math

import pytest
import torch

from minidist.testing import check_all, impl, run_threads

F64 = torch.float64


def attention(q, k, v, mask=None):
    """(out, lse) of q to every key in one softmax, in float64: the reference."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(mask, -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.mark.pure
def test_15_1_merge_of_two_key_sets_of_different_sizes_equals_one_softmax():
    cpm = impl("context_parallel.ring_attention")
    gen = torch.Generator().manual_seed(151)
    q = torch.randn(1, 2, 3, 5, generator=gen, dtype=F64)  # (B, H, m, d)
    k, v = (torch.randn(1, 2, 6, 5, generator=gen, dtype=F64) for _ in range(2))
    scale = 1 / math.sqrt(5)
    left = cpm.attend_block(q, k[:, :, :2], v[:, :, :2], False, scale)
    right = cpm.attend_block(q, k[:, :, 2:], v[:, :, 2:], False, scale)
    out, lse = cpm.merge(*left, *right)
    want_out, want_lse = attention(q, k, v)
    assert torch.allclose(out, want_out, rtol=1e-12, atol=1e-14), (out - want_out).abs().max()
    assert torch.allclose(lse, want_lse, rtol=1e-12, atol=1e-14), (lse - want_lse).abs().max()
    again, _ = cpm.merge(*right, *left)  # either order
    assert torch.allclose(again, want_out, rtol=1e-12, atol=1e-14)


@pytest.mark.pure
def test_15_1_merge_survives_log_sum_exps_far_past_exps_range():
    """lse 1e4 and 1e4 - 1 (exp overflows at 710), 800 against -800, and -inf (no keys yet) on
    either side: the weights are sigmoid(lse - lse_block), never nan."""
    cpm = impl("context_parallel.ring_attention")
    a = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64).view(1, 1, 4, 1)  # (B, H, m, d)
    b = torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=F64).view(1, 1, 4, 1)
    lse_a = torch.tensor([1e4, 800.0, -math.inf, 5.0], dtype=F64).view(1, 1, 4)
    lse_b = torch.tensor([1e4 - 1, -800.0, 3.0, -math.inf], dtype=F64).view(1, 1, 4)
    out, lse = cpm.merge(a, lse_a, b, lse_b)
    w = torch.sigmoid(torch.tensor([1.0, 1600.0, -math.inf, math.inf], dtype=F64))
    want = (w * a.view(4) + (1 - w) * b.view(4)).view(1, 1, 4, 1)
    want_lse = torch.tensor([1e4 + math.log1p(math.exp(-1)), 800.0, 3.0, 5.0], dtype=F64)
    assert not out.isnan().any() and not lse.isnan().any(), (out, lse)
    assert torch.allclose(out, want, rtol=1e-12, atol=0), (out.view(4), want.view(4))
    assert torch.allclose(lse.view(4), want_lse, rtol=1e-12, atol=0), lse.view(4)


def ring_forward(comm, layout: str, m: int, scale: float) -> None:
    """ring_attention's forward on this rank's tokens equals causal attention over the whole
    sequence (q scaled: scores of about scale)."""
    cpm = impl("context_parallel.ring_attention")
    cp, r = comm.world_size, comm.rank
    chunks = cpm.chunks_of(cp, r, layout)
    t = m * cp * len(chunks)
    gen = torch.Generator().manual_seed(152)
    q = torch.randn(1, 2, t, 3, generator=gen, dtype=F64) * scale
    k, v = (torch.randn(1, 2, t, 3, generator=gen, dtype=F64) for _ in range(2))
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    want, _ = attention(q, k, v, future)
    rows = torch.cat([torch.arange(c * m, (c + 1) * m) for c in chunks])  # this rank's tokens
    out = cpm.ring_attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], comm, layout)
    check_all(comm, {"out": (out, want[:, :, rows])}, rtol=1e-9, atol=1e-9)


@pytest.mark.threads
@pytest.mark.parametrize("layout", ["plain", "zigzag"])
def test_15_2_five_ranks_odd_chunks_and_scores_of_1e4(layout):
    """Five ranks, chunks of 3 tokens, q scaled so scores reach about 1e4: an online softmax
    that does not merge by log-sum-exps overflows. Output only: the forward's own check."""
    run_threads(ring_forward, 5, layout, 3, 1e4, timeout=40, comm_timeout=8)


def two_block_grads(diagonal_second: bool):
    """block_grads summed over two key blocks, with the final lse and delta, against autograd
    of one softmax over both blocks: (got, want) pairs of dq, dk, dv."""
    cpm = impl("context_parallel.ring_attention")
    gen = torch.Generator().manual_seed(153)
    m, d = 4, 3
    q = torch.randn(2, 1, m, d, generator=gen, dtype=F64, requires_grad=True)
    k, v = (
        torch.randn(2, 1, 2 * m, d, generator=gen, dtype=F64, requires_grad=True) for _ in range(2)
    )
    grad_out = torch.randn(2, 1, m, d, generator=gen, dtype=F64)
    mask = torch.zeros(m, 2 * m, dtype=torch.bool)
    if diagonal_second:  # q is the second block's own chunk: causal inside it
        mask[:, m:] = torch.ones(m, m, dtype=torch.bool).triu(1)
    out, lse = attention(q, k, v, mask)
    (out * grad_out).sum().backward()
    delta = (grad_out * out.detach()).sum(-1)
    scale = 1 / math.sqrt(d)
    grads = [
        cpm.block_grads(
            q.detach(),
            k.detach()[:, :, s],
            v.detach()[:, :, s],
            grad_out,
            lse.detach(),
            delta,
            diag,
            scale,
        )
        for s, diag in ((slice(0, m), False), (slice(m, 2 * m), diagonal_second))
    ]
    dq = grads[0][0] + grads[1][0]
    dk = torch.cat([grads[0][1], grads[1][1]], 2)
    dv = torch.cat([grads[0][2], grads[1][2]], 2)
    return {"dq": (dq, q.grad), "dk": (dk, k.grad), "dv": (dv, v.grad)}


@pytest.mark.pure
@pytest.mark.parametrize("diagonal_second", [False, True])
def test_15_3_block_grads_of_two_blocks_sum_to_one_softmaxs_gradients(diagonal_second):
    for name, (got, want) in two_block_grads(diagonal_second).items():
        assert got.shape == want.shape, (name, got.shape, want.shape)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-14), (
            name,
            (got - want).abs().max().item(),
        )
