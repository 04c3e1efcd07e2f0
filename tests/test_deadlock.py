"""The strict threads world and its deadlock detector (minidist/comm/threads.py, deadlock.py).

Under sends="rendezvous" a send completes only when its receive is posted (MPI_Ssend): any
ordering that can deadlock on some MPI deadlocks here, at every size, and the world names it at
once, without a timeout: every test here runs with a comm timeout of 30 s and must end in well
under one. A program correct under rendezvous passes under buffered sends too.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from minidist.comm.deadlock import Blocked, WaitForGraph
from minidist.comm.protocol import Deadlock
from minidist.comm.threads import ThreadsWorld
from minidist.pipeline import schedules as sch
from minidist.testing import impl, run_threads

FAST = dict(timeout=20, comm_timeout=30)  # the detector must fire long before either


def ring_send_first(comm, numel: int) -> float:
    """Every rank sends to the next, then receives from the previous: the classic deadlock."""
    x = torch.ones(numel)
    comm.send(x, (comm.rank + 1) % comm.world_size)
    comm.recv(x, (comm.rank - 1) % comm.world_size)
    return x.sum().item()


def ring_posted_first(comm, numel: int) -> float:
    """The same ring, correct: post the receive, send, then wait."""
    x, got = torch.ones(numel), torch.zeros(numel)
    receiving = comm.irecv(got, (comm.rank - 1) % comm.world_size)
    comm.send(x, (comm.rank + 1) % comm.world_size)
    receiving.wait()
    return got.sum().item()


@pytest.mark.threads
@pytest.mark.parametrize("numel", [1, 1 << 20])  # on MPI only the large one deadlocks
def test_send_first_ring_deadlocks_at_every_size_named_at_once(numel):
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_threads(ring_send_first, 3, numel, **FAST)
    assert time.monotonic() - start < 5
    text = str(failed.value)
    assert text.startswith("deadlock: all 3 live ranks wait and none can proceed"), text
    shape = f"{numel} float32"
    cycle = (
        f"wait-for cycle: rank 0 in send(to 1, tag 0, {shape}) -> rank 1 in send(to 2, tag 0, "
        f"{shape}) -> rank 2 in send(to 0, tag 0, {shape}) -> rank 0"
    )
    assert cycle in text, text
    assert (
        f"rank 1 waits in send(to 2, tag 0, {shape}) in ring_send_first (test_deadlock.py:" in text
    )


@pytest.mark.threads
def test_buffered_sends_let_the_send_first_ring_pass():
    assert run_threads(ring_send_first, 3, 8, sends="buffered", **FAST) == [8.0] * 3


@pytest.mark.threads
@pytest.mark.parametrize("sends", ["rendezvous", "buffered"])
@pytest.mark.parametrize("p", [1, 2, 5])
def test_a_receive_posted_first_matches_a_rendezvous_send(sends, p):
    assert run_threads(ring_posted_first, p, 8, sends=sends, **FAST) == [8.0] * p


def isend_waits_for_the_receive(comm) -> list[bool]:
    """A non-blocking send under rendezvous is complete only once the receive is posted."""
    seen = []
    if comm.rank == 0:
        work = comm.isend(torch.ones(2), 1)
        seen.append(work.is_completed())  # rank 1 posts nothing before the barrier
        comm.barrier()
        comm.barrier()
        seen.append(work.is_completed())  # posted between the barriers
        work.wait()
    else:
        comm.barrier()
        receiving = comm.irecv(torch.zeros(2), 0)
        comm.barrier()
        receiving.wait()
    return seen


@pytest.mark.threads
def test_a_nonblocking_send_completes_when_its_receive_is_posted():
    assert run_threads(isend_waits_for_the_receive, 2, **FAST)[0] == [False, True]


def returns_early(comm, where: str) -> None:
    if comm.rank == 1:
        return  # rank 1 leaves: nothing it owes will come
    if where == "recv":
        comm.recv(torch.zeros(3), 1)
    elif where == "send":
        comm.send(torch.zeros(3), 1)
    else:
        comm.all_reduce(torch.zeros(3))


@pytest.mark.threads
@pytest.mark.parametrize(
    "where, call",
    [
        ("recv", "recv(from 1, tag 0, 3 float32)"),
        ("send", "send(to 1, tag 0, 3 float32)"),
        ("all_reduce", "all_reduce #1 (waiting for ranks [1])"),
    ],
)
def test_a_rank_that_returned_is_named_by_the_rank_waiting_for_it(where, call):
    with pytest.raises(AssertionError) as failed:
        run_threads(returns_early, 2, where, **FAST)
    text = str(failed.value)
    assert text.startswith(f"rank 1 returned while rank 0 waits for it in {call}"), text


def leaves_a_message(comm) -> None:
    if comm.rank == 0:
        comm.isend(torch.ones(2, 3, dtype=torch.float64), 1, tag=5)  # never waited, never taken


@pytest.mark.threads
def test_a_message_no_receive_took_fails_the_run_naming_it():
    with pytest.raises(AssertionError) as failed:
        run_threads(leaves_a_message, 2, sends="buffered", **FAST)
    text = str(failed.value)
    assert "1 message(s) sent but never received" in text
    assert "rank 0 -> rank 1, tag 5: (2, 3) torch.float64" in text


def stale_message(comm) -> float:
    """Phase 1 sends 1.0 that rank 1 forgets to receive; phase 2's receive would take it."""
    x = torch.zeros(1)
    if comm.rank == 0:
        comm.send(torch.ones(1), 1)  # phase 1
        comm.send(torch.full((1,), 2.0), 1)  # phase 2
    else:
        comm.recv(x, 0)  # phase 2 only: under buffered sends this takes phase 1's 1.0
    return x.item()


@pytest.mark.threads
def test_a_message_left_from_an_earlier_phase_is_never_silent():
    with pytest.raises(AssertionError, match=r"rank 1 returned while rank 0 waits for it in send"):
        run_threads(stale_message, 2, **FAST)  # rendezvous: the second send is never matched
    with pytest.raises(AssertionError, match=r"rank 0 -> rank 1, tag 0: \(1,\) torch.float32"):
        run_threads(stale_message, 2, sends="buffered", **FAST)  # the 2.0 is left behind


def deadlock_in_a_split(comm) -> None:
    """Ranks 2 and 3 form a pair (ranks 0 and 1 of it) and both receive first."""
    pair = comm.split(comm.rank // 2)
    if comm.rank >= 2:
        pair.recv(torch.zeros(1), 1 - pair.rank)
    else:
        comm.barrier()  # waits for ranks 2 and 3, which never come


@pytest.mark.threads
def test_a_deadlock_across_split_worlds_is_named_in_the_ranks_of_the_world():
    with pytest.raises(AssertionError) as failed:
        run_threads(deadlock_in_a_split, 4, **FAST)
    text = str(failed.value)
    assert "rank 2 waits in recv(from 3, tag 0, 1 float32)" in text, text
    assert "rank 3 waits in recv(from 2, tag 0, 1 float32)" in text, text
    assert "rank 0 waits in barrier #2 (waiting for ranks [2, 3])" in text, text


def busy_elsewhere(comm) -> str:
    """Rank 1 works (a sleep: not in the comm) while rank 0 waits: no deadlock to see."""
    comm.timeout = 30
    if comm.rank == 1:
        time.sleep(0.5)
        comm.send(torch.ones(1), 0)
    else:
        comm.recv(torch.zeros(1), 1)
    return "ok"


@pytest.mark.threads
def test_a_rank_busy_outside_the_comm_is_never_called_deadlocked():
    assert run_threads(busy_elsewhere, 2, **FAST) == ["ok", "ok"]


def helper_thread_rank(comm) -> str:
    """Rank 0 receives on a helper thread while its main thread, outside the comm, decides
    when to answer (as the parameter server does): rank 0 is never all blocked."""
    import threading

    if comm.rank == 0:
        got = torch.zeros(1)
        helper = threading.Thread(target=comm.recv, args=(got, 1))
        helper.start()
        helper.join()
        time.sleep(0.2)  # rank 1 waits for the reply; rank 0's helper has ended
        comm.send(got + 1, 1)
    else:
        comm.send(torch.ones(1), 0)
        reply = comm.recv(torch.zeros(1), 0)
        assert reply.item() == 2.0
    return "ok"


@pytest.mark.threads
def test_a_rank_with_a_helper_thread_is_not_taken_for_deadlocked():
    assert run_threads(helper_thread_rank, 2, **FAST) == ["ok", "ok"]


def caught_and_continued(comm) -> list[str]:
    """A drill: a deadlock caught on every rank, then a correct exchange on a fresh comm."""
    seen = []
    for attempt in ("send first", "posted first"):
        sub = comm.split(0)
        try:
            fn = ring_send_first if attempt == "send first" else ring_posted_first
            fn(sub, 4)
            seen.append("ok")
        except Deadlock:
            seen.append("deadlock")
    return seen


@pytest.mark.threads
def test_a_program_that_catches_the_deadlock_can_go_on():
    got = run_threads(caught_and_continued, 3, allow_unreceived=True, **FAST)
    assert got == [["deadlock", "ok"]] * 3


def stages_wait_for_each_other(comm) -> None:
    """Two pipeline stages, stage 0's program asking for microbatch 0's gradient before it
    sends microbatch 0's activation: each stage waits for the other."""
    pipe = impl("pipeline.stage")
    torch.manual_seed(0)  # both ranks build the same layers; no rank draws during the run
    layers = [nn.Linear(2, 2, dtype=torch.float64) for _ in range(2)]
    stage = pipe.PipelineStage([layers[comm.rank]], comm, nn.functional.mse_loss)
    program = sch.build_schedules("1f1b", 2, 1)[comm.rank]
    if comm.rank == 0:  # [F0, send act 0, recv grad 0, B0] -> the receive before the send
        program = [op for op in program if op.kind != sch.SEND_ACT]
        at = next(i for i, op in enumerate(program) if op.kind == sch.RECV_GRAD)
        program.insert(at + 1, sch.Op(sch.SEND_ACT, 0))
    x = [torch.zeros(2, 2, dtype=torch.float64)]
    stage.run(program, x if comm.rank == 0 else None, [torch.zeros(2, 2, dtype=torch.float64)])


@pytest.mark.threads
def test_a_pipeline_program_whose_stages_wait_for_each_other_is_named():
    with pytest.raises(AssertionError) as failed:
        run_threads(stages_wait_for_each_other, 2, **FAST)
    text = str(failed.value)
    assert text.startswith("deadlock: all 2 live ranks wait and none can proceed"), text
    assert "rank 0 waits in recv(from 1, tag " in text and "rank 1 waits in recv(from 0" in text


@pytest.mark.pure
def test_sends_must_be_named():
    with pytest.raises(ValueError, match="sends='eager' is not one of"):
        ThreadsWorld(2, sends="eager")


@pytest.mark.threads
def test_a_thread_freed_before_it_raises_a_deadlock_does_not_raise_it_later():
    """Lesson 03's bug 4: rank 1 waits in an all-gather while rank 0 waits for it elsewhere.
    Rank 0 finds the deadlock and raises it; before rank 1 wakes to raise it too, rank 0 comes
    to the all-gather, so rank 1's wait ends without an error. Rank 1's next wait, on a correct
    exchange, must not raise the deadlock that has passed (it once did, on a busy machine)."""
    graph = WaitForGraph(2)
    gathered = threading.Event()  # rank 0 has come to rank 1's all-gather
    blocked, detected = threading.Event(), threading.Event()
    seen = {}

    def wait_for_rank_0(ready) -> Blocked:
        return Blocked(lambda: "all_gather #8", ready, lambda: [0])

    def rank_1():
        with graph.cond:
            graph.check(1, wait_for_rank_0(gathered.is_set))
        blocked.set()
        detected.wait(10)  # rank 1 sleeps through the detection, and wakes freed
        with graph.cond:
            graph.unblock()
            try:  # its next wait: rank 0 is running, so it is no deadlock
                graph.check(1, wait_for_rank_0(lambda: False))
                seen[1] = "waits"
            except Deadlock as e:
                seen[1] = f"Deadlock: {e}"
            graph.unblock()

    def rank_0():
        blocked.wait(10)
        waits_for_1 = Blocked(lambda: "all_reduce #1", lambda: False, lambda: [1])
        for _ in range(3):  # stuck, then confirmed CONFIRM seconds later
            try:
                with graph.cond:
                    graph.check(0, waits_for_1)
                time.sleep(0.6)
            except Deadlock:
                seen[0] = "Deadlock"
                break
        with graph.cond:
            graph.unblock()
        gathered.set()
        detected.set()
        time.sleep(0.5)  # running while rank 1 waits again

    threads = [threading.Thread(target=rank_0), threading.Thread(target=rank_1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {0: "Deadlock", 1: "waits"}, seen
