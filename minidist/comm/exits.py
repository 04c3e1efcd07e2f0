"""Ranks that end: who has left a job, and a failure that ends the whole job.

A rank waiting for a peer that has ended would wait until its timeout (mpi: nothing tells it)
or fail with Gloo's bare "Connection closed by peer", naming nobody. And under a launcher that
stops no one (Slurm's srun, ranks started by hand), one failed or timed-out rank leaves the
others waiting until the allocation runs out. Three pieces:

- A *roll*: `roll.ended(ranks) -> [Ended]`, the ranks (of the world) among `ranks` that have
  ended, earliest first, each with its exit code. A comm consults its roll where it waits
  (`comm.roll`, set by `minidist.init()`): a wait on a rank that has ended fails within a
  second (mpi: looked at every 0.1 s while waiting; gloo: when the closed connection wakes it),
  and `left_words` names the rank:
      rank 0 of 3 (mpi): all_reduce(op=sum) #2 failed: rank 1 ended (exit code 0) while this
      rank waited for it
  Under `minidist run` the roll is the launcher's folder (watchdog.FolderRoll: each rank's
  wrapper writes its exit code there the moment its script ends); for torch.distributed ranks
  started otherwise (torchrun, srun, by hand) it is the rendezvous store (StoreJob). MPI ranks
  started by mpiexec have neither: a peer that left is found at the timeout.
- `StoreJob`, for torch.distributed ranks that no `minidist run` watches: the store tells every
  rank when one fails, and the whole job ends within a second of it:
    1. a failing rank (an uncaught exception; a timeout is one) writes `failed` in the store;
    2. every rank watches that key (a daemon thread on a connection of its own, one query every
       0.1 s); when it appears, the rank leaves its state there (its main thread's stack, and
       whether it is waiting inside minidist's comm), prints one line and ends, exit code 1;
    3. a rank that timed out reads those states first and names the rank that was *not*
       waiting in the comm: hung, with its stack, as the launcher's watchdog does.
  A rank ending cleanly writes `ended/<rank>` on its way out (the store's roll). Rank 0, when
  it serves the store, stays until every rank has ended, so no rank loses the store mid-job:
  a rank still running `linger` seconds after rank 0 finished is named hung the same way.
  Costs: one TCP connection and ten small store queries a second per rank; nothing on the
  comm's own path.
- `MPIJob`, for MPI ranks that no `minidist run` watches: a failing rank ends the job with
  MPI_Abort (launch/launcher.py's failure hook), and one that timed out first asks the others for
  their state over a communicator of their own, naming the hung rank the same way.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from .deadlock import thread_frames

_COMM_DIR = os.path.dirname(os.path.abspath(__file__))
LOOK_EVERY = 0.1  # seconds between two looks at the roll (mpi waits) or at the store's keys
HEAR_WITHIN = 2.0  # seconds a failing rank waits for the others' states and for them to hear


@dataclass(frozen=True)
class Ended:
    """A rank of the world that has ended: its exit code (None: not known), when (time.time()),
    and how, in words ('' or 'failed: ValueError: boom')."""

    rank: int
    code: int | None
    when: float
    how: str = ""

    def words(self) -> str:
        """'rank 1 ended (exit code 0)', or '(exit code 1: failed: ValueError: boom)'."""
        code = "not known" if self.code is None else str(self.code)
        how = f": {self.how}" if self.how else ""
        return f"rank {self.rank} ended (exit code {code}{how})"


def left_words(roll, ranks: list[int]) -> str:
    """'rank 1 ended (exit code 0) while this rank waited for it': the first of `ranks` (world
    ranks) that the roll has seen end; '' when none has, or there is no roll (None)."""
    ended = [] if roll is None else roll.ended(ranks)
    if not ended:
        return ""
    more = f" ({len(ended) - 1} more since)" if len(ended) > 1 else ""
    return f"{ended[0].words()} while this rank waited for it{more}"


def in_comm(frame) -> bool:
    """Whether a thread whose innermost frame is `frame` is inside minidist's comm (waiting
    for its peers, not the rank that stopped making progress)."""
    while frame is not None:
        if os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _COMM_DIR:
            return True
        frame = frame.f_back
    return False


def main_stack() -> tuple[bool, str]:
    """(in the comm?, the stack) of this process's main thread, read from another thread."""
    frame = thread_frames().get(threading.main_thread().ident)
    if frame is None:
        return False, "(the main thread has ended)\n"
    return in_comm(frame), "".join(traceback.format_stack(frame))


def hung_rank(others, states: dict, suspects: list[int], silent: str) -> tuple[int, str] | None:
    """(rank, stack) of the rank among `others` that is not waiting inside the comm, by the
    states {rank: (waiting?, stack)} they gave (one that gave none: not waiting; its stack
    `silent`), the suspects first (the peers a timeout names); None if every one waits."""
    hung = [r for r in others if not states.get(r, (False, ""))[0]]
    if not hung:
        return None
    r = min(hung, key=lambda r: (r not in suspects, r))
    return r, states[r][1] if r in states else silent


def hung_words(hung: tuple[int, str], rank: int) -> str:
    """'rank 1 hung: no progress while rank 0 waited for it', then its stack."""
    r, stack = hung
    return f"rank {r} hung: no progress while rank {rank} waited for it\nits stack:\n{stack}"


class StoreJob:
    """The job as its torch.distributed rendezvous store sees it: a roll of the ranks that
    ended, and a failure told to every rank (the module docstring has the protocol).

    Keys, under `prefix` (one namespace per attempt: torchrun restarts a job on one store):
        ended/<r>   r's exit code, when, how    set as r ends, cleanly or failing
        failed      'rank 2: ValueError: boom'  the first failure; every watcher ends its rank
        state/<r>   r's main thread's stack     written by r's watcher when `failed` appears
        heard       how many watchers have      the host of the store serves until all have
        reported    the failing rank has read the states
    store: a TCPStore client, cloned twice (the main thread's queries and the watcher's must
    not share a connection). host: the rank that serves the store (0), or None where a launcher
    serves it (torchrun's agent, `minidist run`): the host's end would end the store, so it stays
    until the others no longer need it. linger: seconds the host waits at its end for the
    others to end.
    """

    def __init__(self, store, rank: int, world_size: int, host: int | None, prefix: str, linger):
        self.store = store.clone()
        self.rank, self.world_size = rank, world_size
        self.host = host
        self.serves = rank == host  # this rank hosts the store
        self.prefix, self.linger = prefix, linger
        self.failing = False  # this rank is reporting its own failure: its watcher stands down
        self.stopped = threading.Event()
        self.watcher = threading.Thread(
            target=self._watch, args=(store.clone(),), name="minidist-job", daemon=True
        )
        self.watcher.start()

    def _key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    # the roll

    def ended(self, ranks, store=None) -> list[Ended]:
        """The ranks among `ranks` that wrote `ended/<rank>`, earliest first. A store that no
        longer answers had its host end: the host rank, if a rank serves it (named as ended);
        where a launcher serves it, the launcher, which stops every rank anyway."""
        store = self.store if store is None else store
        found = []
        try:
            for r in ranks:
                key = self._key(f"ended/{r}")
                if store.check([key]):
                    found.append(_parse(r, store.get(key).decode()))
        except RuntimeError:  # torch's DistNetworkError: the store's host is gone
            if self.host is None or self.serves or self.host not in ranks:
                return []
            return [Ended(self.host, None, time.time(), "the store it served is gone")]
        return sorted(found, key=lambda e: e.when)

    def _running(self, store) -> list[int]:
        """The ranks, this one included, that have not said they ended."""
        gone = {e.rank for e in self.ended(range(self.world_size), store)}
        return [r for r in range(self.world_size) if r not in gone]

    def _announce(self, code: int | None, how: str) -> None:
        value = f"{'' if code is None else code}\t{time.time()}\t{how}"
        self.store.set(self._key(f"ended/{self.rank}"), value)

    # this rank's end: cleanly (at exit) or failing (init's failure hook)

    def close(self) -> None:
        """At exit (registered by init_process_group): say this rank ended. The host of the
        store then waits for the others: at most `linger` s, after which the ones still running
        are hung (one is named with its stack) and this process ends with exit code 1."""
        self.stopped.set()
        self.watcher.join()
        try:
            # Python keeps the exit code to itself: a clean return, or any sys.exit
            self._announce(None, "returned or called sys.exit")
            late = self._wait_for_the_others() if self.serves else []
            if not late:
                return
            why = f"still running {self.linger:g}s after rank {self.rank} finished"
            hung = self._hung(f"rank(s) {late} {why}", late)
        except RuntimeError:  # the store's host ended first: nobody is left to tell
            return
        if hung is not None:
            r, stack = hung
            sys.stderr.write(
                f"[rank {self.rank}] rank {r} hung: {why}; rank(s) still running: "
                f"{late}\nits stack:\n{stack}"
            )
        sys.stderr.flush()
        os._exit(1)

    def _wait_for_the_others(self) -> list[int]:
        """Wait (at most linger s) until every other rank has ended; the ranks still running
        then. [] too if one failed meanwhile: its report says why, once the rest have heard."""
        end = time.monotonic() + self.linger
        while True:
            running = self._running(self.store)
            if self.store.check([self._key("failed")]):
                self._serve_until_heard(self.store)
                return []
            if not running or time.monotonic() > end:
                return running
            time.sleep(LOOK_EVERY)

    def fail(self, words: str, timed_out: bool) -> str:
        """This rank failed (words: its error's last line): tell every rank, which ends the
        job. After a timeout, also find the rank it waited for: the returned text names it
        with its stack ('' if none is found). Called by init's failure hook, which then ends
        this process."""
        self.failing = True
        try:
            self._announce(1, words)
            if not timed_out:
                self.store.compare_set(self._key("failed"), "", f"rank {self.rank}: {words}")
                self.store.set(self._key("reported"), "1")
                self._serve_until_heard(self.store)
                return ""
            suspects = [int(p) for p in re.findall(r"with peer (\d+)", words)]
            hung = self._hung(f"rank {self.rank}: {words}", suspects)
        except RuntimeError:  # the store's host is gone: the others learn it from their comm
            return ""
        return "" if hung is None else hung_words(hung, self.rank)

    def _hung(self, failure: str, suspects: list[int]) -> tuple[int, str] | None:
        """Write `failed` (every other rank's watcher leaves its state), read the states, write
        `reported`. The rank that is not waiting inside the comm, with its stack (suspects
        first: the peers the failure names); None if every other rank waits or has ended."""
        self.store.compare_set(self._key("failed"), "", failure)
        states = self._states()
        running = self._running(self.store)
        self.store.set(self._key("reported"), "1")
        self._serve_until_heard(self.store)
        # a running rank without a state: its watcher could not run (the main thread holds
        # the GIL in native code): hung too
        silent = "(no answer: its main thread holds the GIL)\n"
        return hung_rank([r for r in running if r != self.rank], states, suspects, silent)

    def _states(self) -> dict[int, tuple[bool, str]]:
        """{rank: (waiting in the comm?, its main thread's stack)} of the other ranks still
        running, as their watchers wrote them (at most HEAR_WITHIN s for all of them)."""
        end = time.monotonic() + HEAR_WITHIN
        states: dict[int, tuple[bool, str]] = {}
        while True:
            for r in range(self.world_size):
                key = self._key(f"state/{r}")
                if r != self.rank and r not in states and self.store.check([key]):
                    waiting, stack = self.store.get(key).decode().split("\n", 1)
                    states[r] = (waiting == "1", stack)
            silent = [r for r in self._running(self.store) if r != self.rank and r not in states]
            if not silent or time.monotonic() > end:
                return states
            time.sleep(LOOK_EVERY / 2)

    def _serve_until_heard(self, store) -> None:
        """On the host of the store only (the others lose it when this process ends): wait, at
        most 2 * HEAR_WITHIN s, until the failure is reported and every rank still running
        has heard of it."""
        end = time.monotonic() + 2 * HEAR_WITHIN
        while self.serves and time.monotonic() < end:
            told = store.check([self._key("reported")])
            if told and store.add(self._key("heard"), 0) >= len(self._running(store)):
                return
            time.sleep(LOOK_EVERY / 2)

    # every rank: the watcher

    def _watch(self, store) -> None:
        """Until this rank ends: look for `failed`; when it appears, leave this rank's state,
        say so, and end the process (exit code 1)."""
        failed = self._key("failed")
        while not self.stopped.wait(LOOK_EVERY):
            try:
                if not store.check([failed]):
                    continue
                failure = store.get(failed).decode()
            except RuntimeError:  # the store's host ended: nothing more will come
                return
            if self.failing:  # this rank's own failure: its hook reports and ends it
                return
            self._stop(store, failure)

    def _stop(self, store, failure: str) -> None:
        waiting, stack = main_stack()
        try:
            store.set(self._key(f"state/{self.rank}"), f"{int(waiting)}\n{stack}")
            store.add(self._key("heard"), 1)
            sys.stderr.write(f"[rank {self.rank}] stopped: the job failed: {failure}\n")
            sys.stderr.flush()
            self._serve_until_heard(store)
        except RuntimeError:  # the store's host ended: the failure is reported
            pass
        os._exit(1)


def _parse(rank: int, value: str) -> Ended:
    code, when, how = value.split("\t", 2)
    return Ended(rank, int(code) if code else None, float(when), how)


class MPIJob:
    """A timed-out MPI rank that no `minidist run` watches (mpiexec by hand, srun, another
    MPI's launcher) names the rank it waited for, as StoreJob does, before its failure hook
    ends the job with MPI_Abort. MPI has no store: the ranks talk over a communicator of their
    own (a duplicate of COMM_WORLD, so no message of the program's can match theirs):
        the rank that timed out sends `ASK` to every other rank and reads their `STATE`s
        (at most HEAR_WITHIN s);
        every rank answers from a daemon thread that probes for `ASK` every 0.1 s (mpi4py runs
        MPI with MPI_THREAD_MULTIPLE: the main thread may be inside MPI meanwhile).
    A rank that gave no answer has ended, or holds the GIL in native code. Costs: a Comm_dup at
    init, ten probes a second per rank.
    """

    ASK, STATE = 1, 2

    def __init__(self, world):
        self.comm = world.Dup()
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        self.answers = []  # (request, bytes) of the answers sent: MPI reads them until done
        self.stopped = threading.Event()
        self.watcher = threading.Thread(target=self._answer, name="minidist-job", daemon=True)
        self.watcher.start()

    def _answer(self) -> None:
        """Until this rank ends: answer every ASK with this rank's state."""
        from mpi4py import MPI

        status = MPI.Status()
        while not self.stopped.wait(LOOK_EVERY):
            if not self.comm.Iprobe(MPI.ANY_SOURCE, self.ASK, status):
                continue
            asker = status.Get_source()
            self.comm.Recv(bytearray(1), asker, self.ASK)
            waiting, stack = main_stack()
            state = f"{int(waiting)}\n{stack}".encode()
            self.answers.append((self.comm.Isend(state, asker, self.STATE), state))

    def close(self) -> None:
        """At exit (registered by init), before MPI_Finalize: stop answering."""
        self.stopped.set()
        self.watcher.join()

    def fail(self, words: str, timed_out: bool) -> str:
        """After a timeout, the rank it waited for, with its stack ('' if every other rank
        waits in the comm too); '' for any other failure (MPI_Abort follows at once)."""
        if not timed_out:
            return ""
        from mpi4py import MPI

        # its watcher keeps answering: another rank that timed out too asks this one, whose
        # main thread, here, counts as waiting in the comm (exits.py is part of it)
        others = [r for r in range(self.world_size) if r != self.rank]
        # kept, never waited for: a rank that has ended never takes its ASK; MPI_Abort follows
        self.asks = [self.comm.Isend(bytearray(1), r, self.ASK) for r in others]
        states: dict[int, tuple[bool, str]] = {}
        status = MPI.Status()
        end = time.monotonic() + HEAR_WITHIN
        while len(states) < len(others) and time.monotonic() < end:
            if not self.comm.Iprobe(MPI.ANY_SOURCE, self.STATE, status):
                time.sleep(0.01)
                continue
            state = bytearray(status.Get_count(MPI.BYTE))
            self.comm.Recv(state, status.Get_source(), self.STATE)
            waiting, stack = state.decode().split("\n", 1)
            states[status.Get_source()] = (waiting == "1", stack)
        suspects = [int(p) for p in re.findall(r"with peer (\d+)", words)]
        silent = "(no answer: it has ended, or its main thread holds the GIL)\n"
        hung = hung_rank(others, states, suspects, silent)
        return "" if hung is None else hung_words(hung, self.rank)
