"""Hidden checks of lab 02 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
"""

from __future__ import annotations

import pytest
import torch

from minidist.testing import impl, run_threads, verdict


def signed_zeros(comm, op: str) -> None:
    """Every rank holds zeros of a sign that depends on rank and position (and one +1 where
    the ranks disagree least): max/min must leave the same bits on every rank."""
    C = impl("collectives")
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
