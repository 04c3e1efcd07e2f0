"""Ranks as threads: fn(comm, *args) on every rank of a ThreadsWorld, each rank a thread of this
process, and how each one ended.

The one runner of thread-ranks: `minidist run --backend threads` and the lesson demos
(launcher.run_threads: a script per thread), the test harness (minidist.testing.run_threads),
the simulated cluster (cluster/simulate.py) and the calibration of this machine
(cluster/calibrate.py) all start their ranks here, and each reads the same `ThreadRun` in its
own words: an Outcome for the launcher, an AssertionError naming the rank for the tests, the
first error raised again for the cluster.

The rules, the launcher's watchdog's (launch/watchdog.py) for threads:
- rank r runs fn(world.comm(r), *args) on a thread of its own. Returning (or sys.exit(0)) ends
  it cleanly, and the world is told (world.finish): a rank that waits for it fails at once with
  Deadlock, instead of at its timeout. Raising ends it failed, and the world is aborted
  (world.abort): every rank waiting in the comm wakes with PeerFailed instead of hanging.
- The runner waits until every rank has ended, or gives up: `limit` seconds after the start,
  `after_failure` seconds after the first rank failed (a rank stuck outside the comm never
  wakes), `after_finish` seconds after the first rank ended cleanly (a rank looping on alone).
  A thread cannot be killed: a rank given up on is left behind (a daemon thread, it ends with
  the process), and the caller says what that means (hung, timed out). Its stack stays
  readable (ThreadRun.stack).
The world is the caller's: its size, timeout and sends ("buffered", or "rendezvous" as
MPI_Ssend: comm/threads.py), or a learner's ThreadsWorld when a lab is graded.
Lesson: lessons/01_processes_p2p/ (threads as ranks), lessons/03_debugging_hangs/ (hangs).
"""

from __future__ import annotations

import math
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from minidist.comm.deadlock import thread_frames


@dataclass
class ThreadRun:
    """How the thread-ranks of one run ended."""

    results: list  # rank -> what fn returned (None where it raised, exited or still runs)
    errors: dict[int, tuple[BaseException, str]]  # rank -> (error, traceback), in the order
    # they happened: a rank that failed on its own comes before the ranks its abort woke
    ended: dict[int, float]  # rank -> when its thread ended (time.monotonic())
    running: list[int]  # the ranks still running when the runner gave up ([] when all ended)
    threads: list[threading.Thread]

    def stack(self, rank: int) -> str:
        """The stack of rank's thread now, as traceback prints it (one still running)."""
        frame = thread_frames().get(self.threads[rank].ident)
        return "".join(traceback.format_stack(frame)) if frame else "(no stack)\n"


def raised(rank: int, error: BaseException) -> str:
    """The words a failed rank aborts the world with: 'rank 1 raised ValueError'."""
    return f"rank {rank} raised {type(error).__name__}"


def run_thread_ranks(
    fn: Callable,
    world,
    *args,
    limit: float = math.inf,
    after_failure: float = math.inf,
    after_finish: float = math.inf,
    abort_words: Callable[[int, BaseException], str] = raised,
) -> ThreadRun:
    """Run fn(comm, *args) on every rank of `world`, a thread each, and wait (see the module
    docstring for the rules and the seconds after which it gives up). abort_words(rank, error):
    what a failing rank tells the others (their PeerFailed carries it)."""
    n = world.world_size
    results: list = [None] * n
    errors: dict[int, tuple[BaseException, str]] = {}
    ended: dict[int, float] = {}
    changed = threading.Condition()  # a rank ended: the waiting caller looks again

    def rank_main(r: int) -> None:
        try:
            results[r] = fn(world.comm(r), *args)
            world.finish(r)
        except SystemExit as e:
            if e.code not in (None, 0):
                errors[r] = (e, traceback.format_exc())
                world.abort(abort_words(r, e))
            else:  # a script's sys.exit(0): a clean end, as it is for a process
                world.finish(r, "exited with code 0")
        except BaseException as e:
            errors[r] = (e, traceback.format_exc())  # before the abort: the cause comes first
            world.abort(abort_words(r, e))  # wake the others instead of letting them hang
        with changed:
            ended[r] = time.monotonic()
            changed.notify_all()

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"rank {r}", daemon=True)
        for r in range(n)
    ]
    start = time.monotonic()
    for t in threads:
        t.start()
    with changed:
        while len(ended) < n:
            failed = min((ended[r] for r in errors if r in ended), default=math.inf)
            clean = min((at for r, at in ended.items() if r not in errors), default=math.inf)
            give_up = min(start + limit, failed + after_failure, clean + after_finish)
            left = give_up - time.monotonic()
            if left <= 0:
                break
            changed.wait(None if left == math.inf else left)
        running = [r for r in range(n) if r not in ended]
        return ThreadRun(results, dict(errors), dict(ended), running, threads)
