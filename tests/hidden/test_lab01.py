"""Hidden checks of lab 01 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests, through run_threads (so the learner's world runs every rank): a sender
that overwrites its tensor right after the send, messages queued before any receive and taken
oldest first on each channel, a message of another dtype but the same size, a receive into a
strided 2-d view of a larger buffer, and deadlocks named at once (two ranks that both receive
first; a rank waiting for one that returned), not after the comm's timeout.
"""

from __future__ import annotations

import time

import pytest
import torch

from minidist.comm.protocol import CommError
from minidist.testing import run_threads

FAST = {"timeout": 20, "comm_timeout": 3}  # a correct lab waits milliseconds


def overwrites_after_sending(comm) -> list[float]:
    """Rank 0 sends x to itself and to rank 1, overwriting x right after each isend (the
    receive is posted only later, after a barrier): both must get the values sent."""
    x = torch.tensor([1.0, 2.0, 3.0])
    if comm.rank == 0:
        comm.isend(x, 0, tag=4).wait()  # to self: buffered, done at once
        x.fill_(-1.0)
        mine = comm.recv(torch.zeros(3), 0, tag=4)
        x.copy_(torch.tensor([1.0, 2.0, 3.0]))
        send = comm.isend(x, 1, tag=5)
        x.fill_(-2.0)  # before rank 1 has even posted its receive
        comm.barrier()
        send.wait()
        return mine.tolist()
    comm.barrier()
    return comm.recv(torch.zeros(3), 0, tag=5).tolist()


@pytest.mark.threads
def test_01_1_the_sender_may_overwrite_its_tensor_as_soon_as_isend_returns():
    got = run_threads(overwrites_after_sending, 2, **FAST)
    assert got == [[1.0, 2.0, 3.0]] * 2, got


def queued_then_received(comm) -> list[list[float]]:
    """Rank 0 sends three messages on tag 1 and two on tag 2 before rank 1 posts anything;
    rank 1 then takes tag 2 first, then tag 1: each channel in the order sent."""
    if comm.rank == 0:
        works = [comm.isend(torch.tensor([float(i)]), 1, tag=1) for i in range(3)]
        works += [comm.isend(torch.tensor([10.0 + i]), 1, tag=2) for i in range(2)]
        comm.barrier()  # every message is in the mailbox before any receive
        for work in works:
            work.wait()
        return []
    comm.barrier()
    two = [comm.recv(torch.zeros(1), 0, tag=2).item() for _ in range(2)]
    one = [comm.recv(torch.zeros(1), 0, tag=1).item() for _ in range(3)]
    return [two, one]


@pytest.mark.threads
def test_01_1_messages_queued_before_any_receive_keep_their_order():
    got = run_threads(queued_then_received, 2, **FAST)[1]
    assert got == [[10.0, 11.0], [0.0, 1.0, 2.0]], got


def two_senders_posted_receives(comm) -> list[float]:
    """Ranks 1 and 2 each send rank 0 two messages before rank 0 receives; rank 0 posts all
    four receives (irecv) and waits in the reverse order: each takes its channel's oldest."""
    if comm.rank > 0:
        works = [comm.isend(torch.tensor([comm.rank * 10.0 + i]), 0) for i in range(2)]
        comm.barrier()
        for work in works:
            work.wait()
        return []
    comm.barrier()
    bufs = [torch.zeros(1) for _ in range(4)]
    works = [comm.irecv(bufs[2 * (src - 1) + i], src) for src in (1, 2) for i in range(2)]
    for work in reversed(works):
        work.wait()
    return [b.item() for b in bufs]


@pytest.mark.threads
def test_01_2_each_receive_takes_the_oldest_message_of_its_channel():
    got = run_threads(two_senders_posted_receives, 3, **FAST)[0]
    assert got == [10.0, 11.0, 20.0, 21.0], got


def mismatched_messages(comm) -> list[str]:
    """Rank 0 sends float64 (4,) then float32 (5,); rank 1 receives each into float32 (4,):
    both must be refused with CommError naming both sides, never cast or cut."""
    if comm.rank == 0:
        comm.send(torch.ones(4, dtype=torch.float64), 1)
        comm.send(torch.ones(5), 1)
        return []
    found = []
    for _ in range(2):
        buf = torch.zeros(4)
        try:
            comm.recv(buf, 0)
            found.append(f"accepted: {buf.tolist()}")
        except CommError as e:
            found.append(str(e))
    return found


@pytest.mark.threads
def test_01_2_a_message_of_another_dtype_or_size_is_refused_naming_both():
    dtype, size = run_threads(mismatched_messages, 2, **FAST)[1]
    assert "4 x torch.float64" in dtype and "4 x torch.float32" in dtype, dtype
    assert "5 x torch.float32" in size and "4 x torch.float32" in size, size


def strided_receive(comm) -> None:
    """Rank 1 receives into two columns of a (3, 4) buffer (a strided 2-d view): they get the
    message in row-major order, the other columns keep their values."""
    if comm.rank == 0:
        comm.send(torch.arange(6.0), 1)
        return
    base = torch.full((3, 4), 7.0)
    comm.recv(base[:, 1:3], 0)
    want = torch.full((3, 4), 7.0)
    want[:, 1:3] = torch.arange(6.0).view(3, 2)
    assert torch.equal(base, want), base


@pytest.mark.threads
def test_01_2_a_receive_fills_a_strided_view_and_nothing_else():
    run_threads(strided_receive, 2, **FAST)


def both_receive_first(comm) -> None:
    other = 1 - comm.rank
    comm.recv(torch.zeros(2), other)
    comm.send(torch.zeros(2), other)


def returns_early(comm) -> None:
    if comm.rank == 0:
        comm.recv(torch.zeros(2), 1)  # rank 1 returns without sending


@pytest.mark.threads
def test_01_2_deadlocks_are_named_at_once_not_after_the_timeout():
    """The comm timeout is 8 s here: a receive that tells the world who waits for whom is
    named by the detector within a second or two."""
    for fn, words in [
        (both_receive_first, ["deadlock", "wait-for cycle: rank 0 in recv(from 1"]),
        (returns_early, ["rank 1 returned while rank 0 waits for it in recv(from 1"]),
    ]:
        start = time.monotonic()
        with pytest.raises(AssertionError) as failed:
            run_threads(fn, 2, timeout=20, comm_timeout=8)
        took = time.monotonic() - start
        text = str(failed.value)
        assert all(w in text for w in words), (words, text[:600])
        assert took < 6, f"{fn.__name__}: named after {took:.1f}s"
