"""The pool of ranks the process tier runs on (minidist/launch/pool.py): a job on it sees what a
fresh start would, and fails as a fresh start would."""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest
import torch

from minidist.testing import run_processes


def what_a_rank_sees(comm) -> dict:
    """The process-wide state a rank function could read, and who runs it."""
    return {
        "pid": os.getpid(),
        "rank": comm.rank,
        "seq": comm.seq,
        "timeout": comm.timeout,
        "random": torch.rand(3).tolist(),  # torch's default generator
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "cwd": os.getcwd(),
        "variable": os.environ.get("MINIDIST_POOL_TEST"),
        "filters": len(warnings.filters),
    }


def changes_what_it_can(comm) -> int:
    """A job that changes all of it, and leaves its comm used."""
    torch.manual_seed(1)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    os.chdir("/")
    os.environ["MINIDIST_POOL_TEST"] = "left behind"
    warnings.simplefilter("ignore")
    comm.barrier()
    return os.getpid()


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_job_sees_what_a_fresh_rank_sees(backend, monkeypatch):
    """Three jobs on one pool (a variable of this test's own: a pool of its own): the third sees
    what the first saw, though the second changed it all; timeouts are each job's own."""
    monkeypatch.setenv("MINIDIST_POOL_TEST", backend)
    before = run_processes(what_a_rank_sees, 2, backend, timeout=60)
    pids = run_processes(changes_what_it_can, 2, backend, timeout=60)
    after = run_processes(what_a_rank_sees, 2, backend, timeout=90)
    assert pids == [seen["pid"] for seen in before] == [seen["pid"] for seen in after]  # reused
    for r in range(2):
        assert before[r]["seq"] == 0 and before[r]["timeout"] == 50.0, before[r]
        assert after[r] == dict(before[r], timeout=80.0), (r, before[r], after[r])


def leaves_a_message(comm) -> None:
    comm.send(torch.ones(2), comm.world_size - 1, tag=3)  # no receive ever takes it


def fails_on_the_last_rank(comm) -> int:
    if comm.rank == comm.world_size - 1:
        raise ValueError("boom on the last rank")
    return os.getpid()


def rank_1_sleeps(comm) -> None:
    if comm.rank == 1:
        time.sleep(60)


def leaves_a_thread_at_work(comm) -> int:
    threading.Thread(target=time.sleep, args=(10,), daemon=True).start()
    return os.getpid()


def pid(comm) -> int:
    return os.getpid()


@pytest.mark.processes
def test_a_failing_job_reads_as_in_a_fresh_start_and_the_next_job_gets_new_ranks():
    """mpi: a rank that hangs (2 ranks), a message left unreceived and a rank that raises (1 rank:
    fewer to start) fail the run with the launcher's words, as a fresh start's ranks would (the
    same text but for the harness's own frames, compared with MINIDIST_POOL=0 once), the hang
    within seconds of its comm timeout; the job after each failure, or after a job that left a
    thread at work, runs on ranks started anew."""
    said = {}
    pids = []
    jobs = ((rank_1_sleeps, 2, 12), (leaves_a_message, 1, 60), (fails_on_the_last_rank, 1, 60))
    for job, n, timeout in jobs:
        pids.append(run_processes(pid, n, "mpi", timeout=60))  # a pool started, if none was
        start = time.monotonic()
        with pytest.raises(AssertionError) as e:
            run_processes(job, n, "mpi", timeout=timeout)
        said[job.__name__] = (str(e.value), time.monotonic() - start)
    pids.append(run_processes(pid, 1, "mpi", timeout=60))
    pids.append(run_processes(leaves_a_thread_at_work, 1, "mpi", timeout=60))  # passes, on the
    pids.append(run_processes(pid, 1, "mpi", timeout=60))  # same rank, and retires it
    assert len({tuple(p) for p in pids}) == len(pids) - 1 and pids[-3] == pids[-2], pids
    text, seconds = said["rank_1_sleeps"]
    assert text.startswith("mpi x 2: rank 1 hung (exit code 1):"), text
    # the comm's timeout, 6 s, then the watchdog's look (2 s at most) and the stacks: not 12 s
    assert "CommTimeout: rank 0 of 2 (mpi): barrier #1 timed out after 6s" in text, text
    assert seconds < 12, f"a hang took {seconds:.0f} s to fail"
    text, _ = said["leaves_a_message"]
    assert text.startswith("mpi x 1: rank 0 found messages never received at its exit"), text
    assert "\n  rank 0 -> rank 0, tag 3: 2 x torch.float32\n" in text, text
    text, _ = said["fails_on_the_last_rank"]
    assert text.startswith("mpi x 1: rank 0 failed (exit code 1):\nTraceback"), text
    assert "\nValueError: boom on the last rank\n" in text, text
