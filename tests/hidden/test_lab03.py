"""Hidden checks of lab 03 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests: every rank raises the mismatch itself (caught inside each rank), where
rank 0 is the odd one out too, so a rank that compares only with rank 0 (and walks on into
the collective) fails; messages that differ from the buffer in dtype alone or in size alone,
named by the checked comm's own words.
"""

from __future__ import annotations

import pytest
import torch

from minidist.comm.protocol import CollectiveMismatch, CommError
from minidist.testing import impl, run_threads

FAST = {"timeout": 20, "comm_timeout": 3}


def each_rank_raises(comm, odd: int) -> str:
    """Rank `odd` all-reduces 3 elements, the others 4: every rank must raise
    CollectiveMismatch before any of them enters the inner collective."""
    c = impl("comm.checked").CheckedComm(comm)
    try:
        c.all_reduce(torch.zeros(3 if comm.rank == odd else 4))
    except CollectiveMismatch as e:
        return f"CollectiveMismatch: {e}"
    except Exception as e:  # a rank that walked on into the collective, say
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.threads
@pytest.mark.parametrize("odd", [0, 2])
def test_03_1_every_rank_raises_the_mismatch_itself(odd):
    got = run_threads(each_rank_raises, 4, odd, **FAST)
    assert all(g.startswith("CollectiveMismatch: collective #1") for g in got), got
    assert len(set(got)) == 1, f"ranks say different things: {got}"
    assert f"rank {odd}: all_reduce(shape=(3,)" in got[0], got[0]


def one_message(comm, sent: tuple, expected: tuple) -> str:
    """Rank 0 sends a tensor of `sent` (numel, dtype); rank 1 receives into one of `expected`:
    the checked comm's CommError text ('' if none)."""
    c = impl("comm.checked").CheckedComm(comm)
    if comm.rank == 0:
        c.send(torch.zeros(sent[0], dtype=sent[1]), 1)
        return ""
    try:
        c.recv(torch.zeros(expected[0], dtype=expected[1]), 0)
    except CommError as e:
        return str(e)
    return "accepted"


@pytest.mark.threads
def test_03_2_a_message_of_the_same_size_and_another_dtype_is_named():
    f32, f64 = torch.float32, torch.float64
    text = run_threads(one_message, 2, (4, f32), (4, f64), allow_unreceived=True, **FAST)[1]
    assert "rank 0 sent 4 x torch.float32, this rank expects 4 x torch.float64" in text, text


@pytest.mark.threads
def test_03_2_a_message_of_the_same_dtype_and_another_size_is_named():
    i64 = torch.int64
    text = run_threads(one_message, 2, (4, i64), (6, i64), allow_unreceived=True, **FAST)[1]
    assert "rank 0 sent 4 x torch.int64, this rank expects 6 x torch.int64" in text, text
