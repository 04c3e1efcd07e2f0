"""Hidden checks of lab 08 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests: with staleness 0 a slow worker (0.15 s a gradient) holds the fast ones
in lockstep (a server that ignores the bound lets them read parameters missing the slow one's
gradients); a worker that leaves after one step does not hold the others back (a bound taken
over departed workers too waits for it forever); one worker over two servers is plain SGD
bitwise, every event logged with the version it was computed on and applied to (an update of
a copy leaves the served shard stale; a version logged after the update is off by one); a
silent worker is dropped by both servers for its silence, by the deadline, not by the world
noticing that its thread ended.
"""

from __future__ import annotations

import time

import pytest
import torch

from minidist.testing import impl, run_threads

F64 = torch.float64
D, LR = 4, 0.1


def grad_of(worker: int, delay: float = 0.0):
    """A least-squares gradient on the worker's own fixed rows, after `delay` seconds."""
    g = torch.Generator().manual_seed(80 + worker)
    x = torch.randn(3, D, generator=g, dtype=F64)
    y = torch.randn(3, generator=g, dtype=F64)

    def grad(w, step):
        time.sleep(delay)
        return x.T @ (x @ w - y) / 3

    return grad


def run(comm, n_servers: int, steps: list[int], staleness, delays: list[float], timeout=20.0):
    """Servers return (events, final shard, left, lost); workers their WorkerLog's pushes."""
    ps = impl("sgd.parameter_server")
    if comm.rank < n_servers:
        lo, hi = ps.shard_range(D, n_servers, comm.rank)
        w = torch.linspace(-1, 1, D, dtype=F64)[lo:hi].clone()
        log = ps.serve(comm, w, LR, n_servers, staleness, worker_timeout=timeout)
        events = [(e.worker, e.clock, e.pulled, e.version) for e in log.events]
        return events, log.params, dict(log.left), dict(log.lost)
    k = comm.rank - n_servers
    log = ps.work(comm, D, grad_of(k, delays[k]), steps[k], n_servers)
    return log.pushed


def lockstep(events: list) -> list[str]:
    """With staleness 0: each gradient of clock c was computed on every gradient of clocks
    < c, and on no other."""
    problems = []
    for k, c, pulled, _ in events:
        before = sum(1 for e in events if e[1] < c)
        if pulled != before:
            problems.append(f"worker {k}'s gradient #{c} read version {pulled}, not {before}")
    return problems


@pytest.mark.threads
def test_08_1_a_slow_worker_holds_the_fast_ones_in_lockstep():
    impl("sgd.parameter_server")  # loaded before the threads race to load it
    results = run_threads(run, 4, 1, [3, 3, 3], 0, [0.15, 0.0, 0.0], timeout=30, comm_timeout=3)
    events, _, left, lost = results[0]
    assert not lost and left == {0: 3, 1: 3, 2: 3}, (left, lost)
    assert not lockstep(events), lockstep(events)


@pytest.mark.threads
def test_08_1_a_worker_that_leaves_early_does_not_hold_the_rest():
    impl("sgd.parameter_server")
    results = run_threads(run, 4, 1, [1, 4, 4], 0, [0.0] * 3, timeout=30, comm_timeout=3)
    events, _, left, lost = results[0]
    assert not lost and left == {0: 1, 1: 4, 2: 4}, (left, lost)
    assert results[1:] == [1, 4, 4], results[1:]


@pytest.mark.threads
def test_08_2_one_worker_over_two_servers_is_plain_sgd_bitwise():
    impl("sgd.parameter_server")
    results = run_threads(run, 3, 2, [5], None, [0.0], timeout=30, comm_timeout=3)
    w = torch.linspace(-1, 1, D, dtype=F64)
    grad = grad_of(0)
    for step in range(5):
        w = w - LR * grad(w, step)
    final = torch.cat([results[0][1], results[1][1]])
    assert torch.equal(final, w), (final, w)
    for s in range(2):
        assert results[s][0] == [(0, c, c, c) for c in range(5)], results[s][0]


def silent_worker(comm) -> object:
    """Two servers, workers 0 and 1: worker 1 goes silent (alive, in its gradient) for 2 s
    after one step; the servers drop it after 1 s; worker 0 finishes its 3 steps."""
    ps = impl("sgd.parameter_server")
    if comm.rank < 2:
        lo, hi = ps.shard_range(D, 2, comm.rank)
        w = torch.zeros(D, dtype=F64)[lo:hi].clone()
        log = ps.serve(comm, w, LR, 2, None, worker_timeout=1.0)
        return dict(log.left), dict(log.lost)
    k = comm.rank - 2

    def grad(w, step):
        if k == 1 and step == 1:
            time.sleep(2.0)  # silent, but not blocked in the comm: only the clock can tell
            raise TimeoutError("this worker gave up")
        return torch.ones(D, dtype=F64)

    try:
        return ps.work(comm, D, grad, 3, 2).pushed
    except TimeoutError:
        return "gave up"


@pytest.mark.threads
def test_08_3_a_silent_worker_is_dropped_by_every_server_for_its_silence():
    impl("sgd.parameter_server")
    results = run_threads(silent_worker, 4, timeout=30, comm_timeout=5)
    for s in range(2):
        left, lost = results[s]
        assert left == {0: 3} and list(lost) == [1], (s, left, lost)
        assert "no whole request for" in lost[1], (s, lost)
    assert results[2:] == [3, "gave up"], results[2:]
