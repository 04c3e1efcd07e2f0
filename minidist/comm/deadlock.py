"""Deadlock detection for the threads world: a wait-for graph over every thread-rank.

The threads world sees every rank, so it need not wait for a timeout to know that a program is
stuck. Each rank that blocks (in a send that waits for its receive, a receive, a collective)
records here what it waits in and for whom. Two situations can never resolve:
- every live rank is blocked and none of their conditions holds: nothing in flight can wake
  any of them. `Deadlock` is raised on every rank at once, naming each rank's call and the
  wait-for cycle: `rank 0 in send(to 1) -> rank 1 in send(to 0) -> rank 0`;
- a rank waits for a rank that has finished (returned while a message or a collective it
  owes is still awaited): `rank 1 returned while rank 0 waits for it in recv(from 1)`.
No timeout involved: the check runs whenever a rank blocks, and again each time it wakes
without its condition holding (a send, a posted receive or a rank's end wakes every waiter).
A rank that spins instead of blocking (polling `is_completed`), or waits outside the comm
(a sleep, a lock of its own), counts as running: those still end by the comm's timeout.

Ranks are numbered in the root world (the one the harness made); a split world maps its own
ranks to those. One condition guards the whole family of worlds, so the graph is read in one
consistent state.

    graph = WaitForGraph(4)        # made by ThreadsWorld(4); its splits share it
    graph.finish(rank)             # the harness, when a rank's function returns
"""

from __future__ import annotations

import gc
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .protocol import Deadlock

_COMM_DIR = os.path.dirname(os.path.abspath(__file__))
# seconds every rank must look stuck, nothing changing, before the detector names a deadlock
CONFIRM = 0.5
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"])


@dataclass
class Blocked:
    """What one blocked thread waits in: its rank's call in words ('recv(from 1, tag 0, 8
    float32)'), its condition, the root ranks that could satisfy it, and a note for the report
    ('; waiting in ring_all_reduce(sum); rank 1 sent this rank ... from ring_all_gather')."""

    call: Callable[[], str]
    ready: Callable[[], bool]
    peers: Callable[[], list[int]]
    note: Callable[[], str] = lambda: ""


class WaitForGraph:
    """The blocked and finished ranks of one family of thread worlds, and the detector.

    A rank is usually one thread, but may be several (a parameter server receives on helper
    threads while its main thread answers): a rank counts as blocked only when every live
    thread known to act for it is blocked: the thread that made its comm, and every thread
    that has called an operation on it. A rank runs until shown blocked, and has ended only
    when the harness says so: the detector may miss a deadlock (the timeout then catches it),
    never invent one."""

    def __init__(self, world_size: int, backend_file: str = __file__):
        self.world_size = world_size
        self.backend_file = os.path.abspath(backend_file)  # its frames are not the caller
        self.cond = threading.Condition()
        self.blocked: dict[threading.Thread, tuple[int, Blocked]] = {}  # thread -> rank, call
        self.threads: dict[int, set[threading.Thread]] = {}  # root rank -> threads acting for it
        self.finished: dict[int, str] = {}  # root rank -> how it ended ("returned")
        self.deadlock: str | None = None  # once found, every thread in it raises it
        self.in_deadlock: set[threading.Thread] = set()  # the threads yet to raise it
        self.changes = 0  # bumped by every new thread, block, unblock and end
        self.suspected: tuple[int, float] | None = None  # (changes, when) all looked stuck

    def seen(self, rank: int) -> None:
        """Remember that this thread acts for `rank` (every operation calls this: a set add)."""
        known = self.threads.setdefault(rank, set())
        me = threading.current_thread()
        if me not in known:
            known.add(me)
            self.changes += 1

    def finish(self, rank: int, how: str = "returned") -> None:
        """`rank` has ended without error: a rank that waits for it can never be served."""
        with self.cond:
            self.finished[rank] = how
            self.changes += 1
            self.cond.notify_all()

    def check(self, rank: int, blocked: Blocked) -> None:
        """Called (holding cond) by a thread of `rank`, blocked and not ready: raise `Deadlock`
        if it can never wake, else record it as blocked and return."""
        me = threading.current_thread()
        self.seen(rank)
        if self.blocked.get(me, (None, None))[1] is not blocked:
            self.blocked[me] = (rank, blocked)
            self.changes += 1
        if me in self.in_deadlock:
            found = self.deadlock
            self._leave_deadlock(me)
            raise Deadlock(found)
        gone = [p for p in blocked.peers() if self._ended(p)]
        if gone:
            peer = gone[0]
            how = self.finished[peer]
            where = self._where(threading.current_thread())
            raise Deadlock(f"rank {peer} {how} while rank {rank} waits for it in {where}")
        live = [r for r in range(self.world_size) if not self._ended(r)]
        if not all(self._stuck(r) for r in live):
            self.suspected = None
            return
        if not self._confirmed():
            return  # the caller waits (at most 0.5 s) and checks again
        if all(self._stuck(r) for r in live):
            self.deadlock = self._describe(live)
            self.in_deadlock = {t for t in self.blocked if t is not me and t.is_alive()}
            found = self.deadlock
            if not self.in_deadlock:
                self.deadlock = None
            self.cond.notify_all()  # every other blocked thread raises it too
            raise Deadlock(found)

    def _confirmed(self) -> bool:
        """Whether every rank has looked stuck, with nothing changed, for CONFIRM seconds. A
        thread a rank has started but that has not made its first call yet (a parameter
        server's receiver, just created) is not known to act for it: it gets that long to show
        itself, so the detector never names a deadlock that is not one."""
        now = time.monotonic()
        if self.suspected is None or self.suspected[0] != self.changes:
            self.suspected = (self.changes, now)
            return False
        return now - self.suspected[1] >= CONFIRM

    def unblock(self) -> None:
        """This thread is running again (holding cond). One named in a deadlock may leave its
        wait without raising it: the others caught theirs and came to what it waited for
        before it woke (lesson 03's bug 4, rank 1 in the all-gather of the reports). The
        deadlock is over for it too: its next wait must not raise a deadlock that has passed."""
        me = threading.current_thread()
        if self.blocked.pop(me, None) is not None:
            self.changes += 1
        self._leave_deadlock(me)

    def _leave_deadlock(self, thread: threading.Thread) -> None:
        """`thread` has raised the deadlock, or no longer waits in it."""
        self.in_deadlock.discard(thread)
        if not self.in_deadlock:  # all have raised: a program that catches it goes on
            self.deadlock = None

    def _ended(self, rank: int) -> bool:
        """The harness said so (finish). Not guessed from threads: a rank's helper threads may
        all have ended while its main thread works on."""
        return rank in self.finished

    def _stuck(self, rank: int) -> bool:
        """Every live thread of `rank` is blocked and none of their conditions holds."""
        threads = [t for t in self.threads.get(rank, ()) if t.is_alive()]
        if not threads:
            return False  # not known to act yet: it may be running
        for t in threads:  # one yet to raise an earlier deadlock is about to run again
            if t not in self.blocked or t in self.in_deadlock or self.blocked[t][1].ready():
                return False
        return True

    def _calls(self, rank: int) -> list[threading.Thread]:
        """The blocked threads of `rank`."""
        return [t for t, (r, _) in self.blocked.items() if r == rank and t.is_alive()]

    def _where(self, thread: threading.Thread) -> str:
        """'recv(from 1, tag 0, 8 float32) in ring_all_reduce (collectives/algorithms.py:120)', and
        the call's note."""
        caller = _caller(thread, self.backend_file)
        blocked = self.blocked[thread][1]
        return blocked.call() + (f" in {caller}" if caller else "") + blocked.note()

    def _describe(self, live: list[int]) -> str:
        """The deadlock in words: the wait-for cycle, then every blocked rank's call."""
        waits_for = {
            r: [p for t in self._calls(r) for p in self.blocked[t][1].peers() if p in live]
            for r in live
        }
        cycle = _cycle(waits_for)
        lines = [f"deadlock: all {len(live)} live ranks wait and none can proceed"]
        if cycle:
            steps = [f"rank {r} in {self.blocked[self._calls(r)[0]][1].call()}" for r in cycle]
            lines.append("wait-for cycle: " + " -> ".join(steps) + f" -> rank {cycle[0]}")
        lines += [f"  rank {r} waits in {self._where(t)}" for r in live for t in self._calls(r)]
        ended = [f"rank {r} {how}" for r, how in sorted(self.finished.items())]
        if ended:
            lines.append("  already ended: " + ", ".join(ended))
        return "\n".join(lines)


def _cycle(waits_for: dict[int, list[int]]) -> list[int]:
    """A cycle of the wait-for graph ([] if none): from the lowest rank, follow the first edge
    until a rank repeats (every blocked rank waits for at least one other, so one does)."""
    if not waits_for:
        return []
    path, at = [], min(waits_for)
    while at not in path:
        path.append(at)
        if not waits_for.get(at):
            return []
        at = waits_for[at][0]
    return path[path.index(at) :]


_frames_lock = threading.Lock()


def thread_frames() -> dict:
    """sys._current_frames() (thread id -> its innermost frame), with the garbage collector held
    off while it runs: on CPython 3.11 a collection that starts inside it can deadlock the
    whole interpreter (it holds the runtime's lock while it allocates, and a deallocation during
    the collection takes that lock again: python/cpython#106883). One caller at a time, so that
    no caller turns the collector back on under another."""
    with _frames_lock:
        collecting = gc.isenabled()
        gc.disable()
        try:
            return sys._current_frames()
        finally:
            if collecting:
                gc.enable()


def _caller(thread: threading.Thread, backend_file: str) -> str:
    """The innermost function outside minidist/comm (and the backend's file: a learner's lab
    01 lives elsewhere) on the thread's stack: the collective or lab function the blocked call
    was made from ('' if none)."""
    frame = thread_frames().get(thread.ident)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        inside = os.path.dirname(path) == _COMM_DIR or path == backend_file
        if not inside and not path.startswith(_STDLIB):
            name = os.path.basename(path)
            return f"{frame.f_code.co_name} ({name}:{frame.f_lineno})"
        frame = frame.f_back
    return ""
