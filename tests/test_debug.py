"""Debug mode (CheckedComm): mismatched collectives and messages become errors naming ranks.

These tests grade lab 03 (`make lab L=03`): the module comes from impl("comm.checked").
Over real processes the same check runs in tests/test_comm.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_comm import collectives_once, p2p_ring

from minidist.testing import all_dtypes, impl, ops, run_threads, seeds, shapes


def checked(comm):
    return impl("comm.checked").CheckedComm(comm)


def checked_collectives(comm, shape, dtype, op, seed):
    collectives_once(checked(comm), shape, dtype, op, seed)


class MessagesChecked:
    """Point-to-point through a CheckedComm, everything else (the verdict's collectives)
    straight to the comm: a test of the message check (lab 03.2) alone."""

    def __init__(self, comm):
        self.inner, self.checked = comm, checked(comm)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send(self, t, dst, tag=0):
        return self.checked.send(t, dst, tag)

    def recv(self, t, src, tag=0):
        return self.checked.recv(t, src, tag)

    def isend(self, t, dst, tag=0):
        return self.checked.isend(t, dst, tag)

    def irecv(self, t, src, tag=0):
        return self.checked.irecv(t, src, tag)


def checked_messages(comm, shape, dtype, seed):
    p2p_ring(MessagesChecked(comm), shape, dtype, seed, blocking=seed % 2 == 0)


@pytest.mark.threads
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), shapes(max_side=5), all_dtypes, ops, seeds)
def test_checked_collectives_change_no_result(p, shape, dtype, op, seed):
    run_threads(checked_collectives, p, shape, dtype, op, seed)


@pytest.mark.threads
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), shapes(max_side=5), all_dtypes, seeds)
def test_checked_messages_change_no_result(p, shape, dtype, seed):
    run_threads(checked_messages, p, shape, dtype, seed)


def different_collectives(comm):
    c = checked(comm)
    if comm.rank == 2:
        c.broadcast(torch.zeros(3, dtype=torch.int64), 0)
    elif comm.rank == 1:
        c.all_reduce(torch.zeros(3), "max")
    else:
        c.all_reduce(torch.zeros(3))


@pytest.mark.threads
def test_mismatched_collectives_are_named_on_every_rank():
    with pytest.raises(AssertionError) as e:
        run_threads(different_collectives, 4, timeout=20)
    text = str(e.value)
    assert "CollectiveMismatch: collective #1 differs across the 4 ranks" in text
    assert "ranks [0, 3]: all_reduce(shape=(3,), float32, op=sum)" in text
    assert "rank 1: all_reduce(shape=(3,), float32, op=max)" in text
    assert "rank 2: broadcast(shape=(3,), int64, src=0)" in text


def mismatched_message(comm):
    c = checked(comm)
    if comm.rank == 0:
        c.send(torch.zeros(4, dtype=torch.float32), 1)
    else:
        c.recv(torch.zeros(2, 3, dtype=torch.float64), 0)


@pytest.mark.threads
def test_mismatched_message_is_named_by_the_receiver():
    with pytest.raises(AssertionError) as e:
        run_threads(mismatched_message, 2, timeout=20)
    text = str(e.value)
    assert "rank 1 of 2 failed" in text
    assert "recv(tag=0) #2 with peer 0" in text
    assert "rank 0 sent 4 x torch.float32, this rank expects 6 x torch.float64" in text
