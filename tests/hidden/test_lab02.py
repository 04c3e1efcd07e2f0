"""Hidden checks of lab 02 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests: the ring on odd worlds with sizes p does not divide (and fewer
elements than ranks), exactly, from a strided input; recursive doubling's signed zeros.
"""

from __future__ import annotations

import pytest
import torch

from minidist.testing import check_all, impl, run_threads, verdict


def signed_zeros(comm, op: str) -> None:
    """Every rank holds zeros of a sign that depends on rank and position (and one +1 where
    the ranks disagree least): max/min must leave the same bits on every rank."""
    C = impl("collectives.algorithms")
    p, r = comm.world_size, comm.rank
    signs = torch.tensor([(-1.0) ** ((r >> k) + k) for k in range(8)])  # (8,) of +-1
    x = signs * 0.0  # (8,) of +-0.0
    C.recursive_doubling_all_reduce(x, comm, op)
    bits = torch.empty(p * 8, dtype=torch.int32)
    comm.all_gather(bits, x.view(torch.int32))
    rows = bits.view(p, 8)
    same = all(torch.equal(rows[i], rows[0]) for i in range(p))
    verdict(comm, same and bool((x == 0).all()), f"p={p} {op}: got {x.tolist()} on rank {r}")


@pytest.mark.threads
@pytest.mark.parametrize("p", [2, 3, 5, 6, 7, 8])
@pytest.mark.parametrize("op", ["max", "min"])
def test_02_3_recursive_doubling_folds_signed_zeros_the_same_on_every_rank(p, op):
    run_threads(signed_zeros, p, op, timeout=20, comm_timeout=4)


def uneven_reduce_scatter(comm, n: int, op: str) -> None:
    """ring_reduce_scatter of n integer-valued float64 elements (a strided view), n not a
    multiple of p: rank r gets elements [r n // p, (r + 1) n // p) of the reduction."""
    C = impl("collectives.algorithms")
    p, r = comm.world_size, comm.rank
    xs = [torch.arange(n, dtype=torch.float64) * (i + 1) % 7 - 3 for i in range(p)]  # (n,) each
    base = torch.stack([xs[r], torch.zeros(n, dtype=torch.float64)], 1)  # (n, 2)
    lo, hi = r * n // p, (r + 1) * n // p
    out = torch.zeros(hi - lo, dtype=torch.float64)
    C.ring_reduce_scatter(out, base[:, 0], comm, op)
    full = torch.stack(xs)  # (p, n)
    want = full.sum(0) if op == "sum" else full.amax(0)
    check_all(comm, {f"p={p} n={n} {op} [{lo}:{hi}]": (out, want[lo:hi])})


@pytest.mark.threads
@pytest.mark.parametrize("p", [3, 5])
def test_02_1_ring_reduce_scatter_of_sizes_p_does_not_divide(p):
    for n in (1, 7, 2 * p + 1):
        for op in ("sum", "max"):
            run_threads(uneven_reduce_scatter, p, n, op, timeout=20, comm_timeout=4)


def uneven_all_gather(comm, n: int) -> None:
    """ring_all_gather of chunk_bounds-sized chunks (some empty when n < p) into a strided
    out: every rank ends with the whole 0 .. n-1."""
    C = impl("collectives.algorithms")
    p, r = comm.world_size, comm.rank
    lo, hi = r * n // p, (r + 1) * n // p
    base = torch.full((n, 2), -1.0)
    out = C.ring_all_gather(base[:, 0], torch.arange(lo, hi, dtype=torch.float32), comm)
    pairs = {f"p={p} n={n}": (out, torch.arange(n, dtype=torch.float32))}
    check_all(comm, pairs | {"gaps": (base[:, 1], torch.full((n,), -1.0))})


@pytest.mark.threads
@pytest.mark.parametrize("p", [3, 6])
def test_02_2_ring_all_gather_of_sizes_p_does_not_divide(p):
    for n in (2, 7, 3 * p + 2):
        run_threads(uneven_all_gather, p, n, timeout=20, comm_timeout=4)
