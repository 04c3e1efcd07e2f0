"""Hidden checks of lab 04 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests: assign_buckets on hand-made lists (a bucket closes at exactly
bucket_bytes, the partial last one stays, a tensor larger than the limit sits alone); buckets
launched in order when a middle layer is unused on one rank only (a bucket launched as soon as
it is full would pair one rank's bucket with another's of the same shape: silently wrong sums);
the average over all p ranks of a parameter only some ranks used, on an odd world (04.3), and
the gradient of a parameter no rank used left None (04.4).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minidist.testing import check_all, impl, run_threads, verdict

F64 = torch.float64
FAST = {"timeout": 30, "comm_timeout": 3}


@pytest.mark.pure
def test_04_1_buckets_close_at_exactly_bucket_bytes():
    assign = impl("data_parallel.wrappers").assign_buckets
    cases = [
        (([8, 8, 8], 16), [[0, 1], [2]]),
        (([8, 8, 8], 8), [[0], [1], [2]]),
        (([8, 8, 8], 100), [[0, 1, 2]]),
        (([40, 1, 1], 8), [[0], [1, 2]]),
        (([3, 5, 0, 8, 0], 8), [[0, 1], [2, 3], [4]]),
        (([0, 0], 1), [[0, 1]]),
        (([], 4), []),
    ]
    for (nbytes, limit), want in cases:
        got = assign(nbytes, limit)
        assert got == want, (nbytes, limit, got, want)


class Three(nn.Module):
    """a -> (b only if use_b) -> c: three Linear(4, 4), float64; b's
    weight and bias have the shapes of a's and c's, so buckets of one tensor look alike."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.a, self.b, self.c = (nn.Linear(4, 4, dtype=F64) for _ in range(3))
        with torch.no_grad():
            for q in self.parameters():
                q.copy_(torch.randn(q.shape, generator=g, dtype=F64))

    def forward(self, x, use_b: bool):
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + torch.tanh(self.b(h))
        return self.c(h)


def unused_on_one_rank(comm, bucket_bytes: int) -> None:
    """Rank 0 never runs b; the others do. The averaged gradients equal one process's over
    the whole batch (b's: the sum over the ranks that used it, over p); replicas agree."""
    dp = impl("data_parallel.wrappers")
    p, r = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(9)
    xs = torch.randn(p, 2, 4, generator=g, dtype=F64)  # (p, 2, 4): two rows per rank
    ref = Three()
    for i in range(p):  # the mean over ranks of each rank's mean loss
        (ref(xs[i], i != 0).square().mean() / p).backward()
    model = Three()
    wrapped = dp.DataParallelBucketed(model, comm, bucket_bytes)
    model(xs[r], r != 0).square().mean().backward()
    wrapped.finish_gradient_sync()
    pairs = {
        f"bucket_bytes={bucket_bytes} {name}.grad": (q.grad, q_ref.grad)
        for (name, q), q_ref in zip(model.named_parameters(), ref.parameters(), strict=True)
    }
    check_all(comm, pairs, rtol=1e-12, atol=1e-15)


@pytest.mark.threads
@pytest.mark.parametrize("bucket_bytes", [1, 4 * 8 + 1, 1 << 20])
def test_04_2_buckets_launch_in_order_when_a_layer_is_unused_on_one_rank(bucket_bytes):
    run_threads(unused_on_one_rank, 3, bucket_bytes, **FAST)


def used_by_some(comm, check: str) -> None:
    """p = 3; w used by ranks 0 and 2 only (rank 1 runs no backward), v by none. check
    "average": w.grad is (g0 + g2) / 3 on every rank (integer-valued, each divided by 3 before
    the sum: equal to one division after it within a few ulps); "unused": v.grad stays None and
    w.grad exists, on every rank."""
    dp = impl("data_parallel.wrappers")
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(3, dtype=F64))
    model.v = nn.Parameter(torch.zeros(2, dtype=F64))
    wrapped = dp.DataParallelBucketed(model, comm, bucket_bytes=1)
    r = comm.rank
    if r != 1:
        (model.w * torch.tensor([1.0, 2.0, 3.0], dtype=F64) * (r + 1)).sum().backward()
    wrapped.finish_gradient_sync()
    if check == "unused":
        ok = model.v.grad is None and model.w.grad is not None
        verdict(comm, ok, f"rank {r}: v.grad {model.v.grad}, w.grad {model.w.grad}")
        return
    want = torch.tensor([1.0, 2.0, 3.0], dtype=F64) * (1 + 3) / 3
    got = model.w.grad if model.w.grad is not None else torch.full((3,), float("nan"), dtype=F64)
    check_all(comm, {"w.grad": (got, want)}, rtol=1e-15, atol=0)


@pytest.mark.threads
def test_04_3_gradients_are_averaged_over_all_p_ranks_even_where_unused():
    run_threads(used_by_some, 3, "average", **FAST)


@pytest.mark.threads
def test_04_4_a_parameter_no_rank_used_keeps_grad_none():
    run_threads(used_by_some, 3, "unused", **FAST)
