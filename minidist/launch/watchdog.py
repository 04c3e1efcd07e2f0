"""The launcher's watchdog: which rank ended, failed or hung, told within seconds, with its stack.

`minidist run` starts every rank as `python -c WRAPPER script.py args` (or `... -m module
args`), WRAPPER calling rank_main below. That small wrapper, in each rank, before the script runs:
  - leaves rank{r}.pid in the launcher's folder (MINIDIST_FAILURE_DIR): mpiexec hides its
    children from us, so the launcher finds them by pid;
  - opens rank{r}.alive, a FIFO the launcher reads, and holds it open: the kernel closes it
    when the process ends, however it ends, so the launcher hears the order ranks died in
    (mpiexec runs with -disable-auto-cleanup: the launcher, not mpiexec, stops the rest);
  - registers faulthandler on SIGUSR2, writing every thread's stack into rank{r}.stack: the
    launcher asks a rank it believes hung for its stack (SIGUSR1 is ignored: mpiexec sends it
    to tell survivors of a failure, and its default action would kill them);
  - runs the script; when it ends, writes rank{r}.exit with its exit code (sys.exit(3): 3) at
    once, before MPI's finalize can make the process linger; a traceback before init()
    (a missing module, an init failure) goes into rank{r}.txt, as init's failure hook does.

The launcher polls every 20 ms, backing off to 250 ms while nothing changes (waking at once when
a lifeline closes), and stops the whole job when:
    a rank exits with a code != 0, dies by a signal, or leaves a traceback   -> that rank
    ranks time out waiting (CommTimeout) for a peer still running            -> the peer: hung
        (unless its stack shows it waiting in a comm too: then the rank that timed out)
    a rank still runs `timeout` seconds after another finished cleanly       -> it: hung
    ranks fail naming a peer that ended with exit code 0 while they waited   -> it: left early
and names the rank that caused it, in this order: the earliest of those that failed on their
own or ended without a word (killed), a rank that left early, a hung rank (with its stack), a
rank that timed out, a rank that only saw a peer fail (PeerFailed). Earliest by evidence: when
a rank wrote its words (the file's time), or, for one that left none, the last moment its
lifeline was seen open; never when the launcher happened to look. The job's exit code is the
blamed rank's (1 for one that left early). The words also serve the ranks: FolderRoll reads
them for a comm that waits on a rank that has ended (comm/exits.py).
Lesson: lessons/03_debugging_hangs/ (the watchdog).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import re
import runpy
import select
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field

from minidist.comm.exits import Ended
from minidist.comm.protocol import DEFAULT_TIMEOUT
from minidist.launch.processes import write_whole

RANK_VARIABLES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
STACK_SIGNAL = signal.SIGUSR2
# mpiexec, run with -disable-auto-cleanup, tells surviving ranks of a failure by SIGUSR1; the
# launcher handles failures, and SIGUSR1's default action would kill a rank as it exits cleanly
MPI_NOTICE = signal.SIGUSR1
POLL = 0.02  # seconds between two looks at the ranks, while they change
POLL_QUIET = 0.25  # ... and at most, while nothing changes (a long job: 4 looks a second)


def job_timeout(env=os.environ) -> float:
    """Seconds a rank may run on after a peer finished: MINIDIST_TIMEOUT, else the comm's."""
    return float(env.get("MINIDIST_TIMEOUT") or DEFAULT_TIMEOUT)


@dataclass
class Outcome:
    """How a launch ended: exit code, the rank blamed, why, and its traceback or stack."""

    returncode: int
    failed_rank: int | None = None
    traceback: str = ""
    still_running: list[int] = field(default_factory=list)
    timed_out: bool = False
    how: str = "failed"
    rank_code: int | None = None  # the blamed rank's own exit code, where not the job's

    def report(self) -> str:
        if self.timed_out:
            return f"timed out; ranks still running: {self.still_running}"
        if self.failed_rank is None:
            return self.traceback or f"failed with exit code {self.returncode}"
        tb = self.traceback or "(no traceback recorded: see the rank's output above)\n"
        code = self.returncode if self.rank_code is None else self.rank_code
        return f"rank {self.failed_rank} {self.how} (exit code {code}):\n{tb}"


# ---- inside each rank ----------------------------------------------------------------------


def _write(folder: str, name: str, text: str) -> None:
    # at once whole: the launcher never reads half a file
    write_whole(os.path.join(folder, name), text.encode())


def rank_main(argv: list[str]) -> None:
    """Run `script args` or `-m module args` as this rank, reporting to the launcher."""
    folder = os.environ["MINIDIST_FAILURE_DIR"]
    rank = next(int(os.environ[v]) for v in RANK_VARIABLES if v in os.environ)
    # registered first, so it runs last of what runs at exit (after the comms' own checks and
    # closes, which collect garbage themselves): the interpreter's teardown then skips the
    # collections over what the imports made (torch: 0.4 of 0.5 CPU-seconds a rank)
    atexit.register(gc.freeze)
    stack = open(os.path.join(folder, f"rank{rank}.stack"), "w")  # noqa: SIM115 (open for the life of the process)
    faulthandler.register(STACK_SIGNAL, file=stack, all_threads=True)
    signal.signal(MPI_NOTICE, signal.SIG_IGN)
    _write(folder, f"rank{rank}.pid", str(os.getpid()))  # after: SIGUSR2 would kill it before
    _hold_lifeline(folder, rank)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        if sys.excepthook is not sys.__excepthook__:
            sys.excepthook(type(e), e, e.__traceback__)  # init's hook: reports, ends the rank
        text = traceback.format_exc()
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        _write(folder, f"rank{rank}.txt", text)
        code = 1
    _write(folder, f"rank{rank}.exit", str(code))
    sys.stderr.flush()
    sys.exit(code)


def _hold_lifeline(folder: str, rank: int) -> None:
    """Open rank{r}.alive, the launcher's FIFO, for writing and never close it: the kernel closes
    it when this process ends, however it ends (SIGKILL too), and the launcher hears it."""
    path = os.path.join(folder, f"rank{rank}.alive")
    try:
        os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no FIFO (a platform without them) or no reader: the launcher polls
        pass


class FolderRoll:
    """The roll (comm/exits.py) of a `minidist run` job: the ranks that have ended, read from
    what they left in the launcher's folder: rank{r}.exit (the exit code the wrapper wrote the
    moment the script ended), or rank{r}.txt / .after (a failure: code 1). A comm that waits
    for one of them fails naming it, instead of waiting for its timeout."""

    def __init__(self, folder: str):
        self.folder = folder

    def ended(self, ranks: list[int]) -> list[Ended]:
        """The ranks among `ranks` that have ended, earliest first."""
        found = []
        for r in ranks:
            for suffix in ("exit", "txt", "after"):
                path = os.path.join(self.folder, f"rank{r}.{suffix}")
                try:
                    when = os.stat(path).st_mtime
                except FileNotFoundError:
                    continue
                code = int(_read(path)) if suffix == "exit" else 1
                found.append(Ended(r, code, when, "" if suffix == "exit" else "failed"))
                break
        return sorted(found, key=lambda e: e.when)


# ---- in the launcher -----------------------------------------------------------------------


@dataclass
class Rank:
    """The launcher's view of one rank."""

    rank: int
    pid: int | None = None
    code: int | None = None  # its exit code; None while running, or when it died unseen
    ended: float | None = None  # when we saw it end (time.monotonic())
    words: str = ""  # "exit", "txt", "after": what it left; "" ended without a word
    # when it ended, by the evidence (time.time()): when it wrote its words, or for a rank
    # that left none the earliest moment its lifeline may have closed; never when we looked
    when: float = float("inf")


class Lifelines:
    """One FIFO per rank, read here, held open for writing by the rank: its end wakes us at
    once, in the order the ranks die. Polling every 20 ms cannot order deaths that close: a rank
    killed by SIGKILL and the peer that dies of it a few ms later look simultaneous."""

    def __init__(self, folder: str, n: int):
        self.order: dict[int, int] = {}  # rank -> 0 for the first to die, 1, ...
        # rank -> the last time.time() its lifeline was seen open: it died after that moment
        # (and before we heard it); the earliest it may have died
        self.alive_at: dict[int, float] = {}
        self.looked = time.time()  # when the lifelines were last looked at
        self._poll = select.poll()
        self._fds: dict[int, int] = {}
        for r in range(n):
            path = os.path.join(folder, f"rank{r}.alive")
            os.mkfifo(path)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # HUP only after a writer came
            self._fds[fd] = r
            self._poll.register(fd, select.POLLIN | select.POLLHUP)

    def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`, waking as soon as a rank ends; record who ended."""
        before = self.looked
        events = self._poll.poll(seconds * 1000)
        self.looked = time.time()
        for fd, _ in events:
            self._poll.unregister(fd)
            os.close(fd)
            r = self._fds.pop(fd)
            self.order[r] = len(self.order)
            self.alive_at[r] = before

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


class Watch:
    """Poll a launch's ranks (procs: one per rank, or mpiexec alone) until it ends, or until
    `stop` (a threading.Event another thread may set) is set: then as if the deadline passed."""

    def __init__(self, procs, n, backend, folder, timeout, deadline, lifelines=None, stop=None):
        self.procs = procs
        self.backend = backend
        self.folder = folder
        self.ranks = [Rank(r) for r in range(n)]
        self.timeout, self.deadline = timeout, deadline
        self.lifelines = lifelines
        self.stop = stop

    def _pause(self, seconds: float = POLL) -> None:
        if self.lifelines is None:
            time.sleep(seconds)
        else:
            self.lifelines.wait(seconds)

    def _died(self, r: Rank) -> float:
        """r's place in the order of deaths the lifelines heard (inf: not heard)."""
        order = {} if self.lifelines is None else self.lifelines.order
        return order.get(r.rank, float("inf"))

    def poll(self) -> None:
        """Update every rank: ended? with which code? what did it leave?"""
        if self.lifelines is not None:
            # record every lifeline closed since the last pause first: a rank killed since
            # then, found dead below by its pid, must count from when it was last seen alive,
            # not from now (else a peer failing of it a moment later would look first)
            self.lifelines.wait(0)
        now = time.monotonic()
        for r in self.ranks:
            if r.ended is not None:
                continue
            if r.pid is None and os.path.exists(self._path(r, "pid")):
                r.pid = int(_read(self._path(r, "pid")))
            for suffix in ("txt", "after", "exit"):  # a traceback says more than its code
                if os.path.exists(self._path(r, suffix)):
                    r.ended, r.words = now, suffix
                    r.code = int(_read(self._path(r, "exit"))) if suffix == "exit" else 1
                    r.when = os.stat(self._path(r, suffix)).st_mtime  # written as it ended
                    break
            else:
                gone = self._gone(r)
                if gone is not None:
                    r.ended, r.code = now, gone[0]
                    heard = {} if self.lifelines is None else self.lifelines.alive_at
                    r.when = heard.get(r.rank, time.time())

    def _gone(self, r: Rank) -> tuple[int | None] | None:
        """(exit code or None) if r's process has ended without a word; None if it runs."""
        heard = self._died(r) < float("inf")
        if self.backend != "mpi":
            try:  # its lifeline closes a moment before the process can be waited for
                code = self.procs[r.rank].wait(0.5) if heard else self.procs[r.rank].poll()
            except subprocess.TimeoutExpired:
                code = None
            return None if code is None else (code,)
        if r.pid is not None and (heard or not _alive(r.pid)):
            return (None,)
        if self.procs[0].poll() is not None:  # mpiexec ended: so did every rank
            return (None,)
        return None

    def _path(self, r: Rank, suffix: str) -> str:
        return os.path.join(self.folder, f"rank{r.rank}.{suffix}")

    def run(self) -> Outcome | None:
        """Wait until the job ends (None: all ranks exited 0) or must be stopped (an Outcome,
        the stacks of live ranks collected first)."""
        first_clean = None
        pause = POLL
        seen = len(self.ranks)
        while True:
            self.poll()
            failed = [r for r in self.ranks if r.ended is not None and r.code != 0]
            running = [r for r in self.ranks if r.ended is None]
            # a quiet job is looked at less and less often (a lifeline still wakes us at once)
            pause = POLL if len(running) != seen else min(2 * pause, POLL_QUIET)
            seen = len(running)
            if failed:
                return self._failed()
            if not running:
                return None
            if first_clean is None and len(running) < len(self.ranks):
                first_clean = time.monotonic()
            if first_clean is not None and time.monotonic() - first_clean > self.timeout:
                return self._lingering(running)
            late = self.deadline is not None and time.monotonic() > self.deadline
            if late or (self.stop is not None and self.stop.is_set()):
                return Outcome(1, still_running=[r.rank for r in running], timed_out=True)
            self._pause(pause)

    def stacks(self, ranks: list[Rank]) -> dict[int, str]:
        """Ask each rank for every thread's stack (faulthandler) and read what it wrote."""
        asked = [r for r in ranks if r.pid is not None and _alive(r.pid)]
        for r in asked:
            os.kill(r.pid, STACK_SIGNAL)
        end = time.monotonic() + 1.0
        seen: dict[int, str] = {}
        found: dict[int, str] = {}
        while time.monotonic() < end and len(found) < len(asked):
            time.sleep(0.05)
            for r in asked:
                text = _read(self._path(r, "stack"))
                if text and seen.get(r.rank) == text:  # written, and no longer growing
                    found[r.rank] = text
                seen[r.rank] = text
        return found

    def _lingering(self, running: list[Rank]) -> Outcome:
        done = min((r for r in self.ranks if r.ended is not None), key=lambda r: r.ended)
        stacks = self.stacks(running)
        names = [r.rank for r in running]
        why = (
            f"hung: still running {time.monotonic() - done.ended:.1f}s after rank {done.rank} "
            f"finished (timeout {self.timeout:g}s); ranks still running: {names}\n"
        )
        return Outcome(1, names[0], why + _stack_text(stacks.get(names[0], "")), how="hung")

    def _failed(self) -> Outcome:
        """A rank failed: give the cause 2 s to report (a rank failing *because* a peer died
        may come first); with none (only timeouts), take the live ranks' stacks (a rank that
        timed out waits 5 s to be stopped, so the one it waited for is still alive); blame."""
        end = time.monotonic() + 2
        while True:
            # a death heard only now happened before we saw the words that brought us here
            # (a rank writes its words alive): record it before anyone is blamed
            self._pause(0)
            self.poll()
            done = all(r.ended is not None for r in self.ranks)
            if self._causes() or done or time.monotonic() > end:
                break
            self._pause()
        live = [r for r in self.ranks if r.ended is None]
        return self._blame(live, {} if self._causes() else self.stacks(live))

    def _causes(self) -> list[Rank]:
        """Ranks that failed on their own: a code != 0 of their own, a traceback (not a
        timeout), or an end without a word (killed)."""
        found = []
        for r in self.ranks:
            if r.ended is None or r.code == 0 or r.words == "after":
                continue
            text = _read(self._path(r, "txt")) if r.words == "txt" else ""
            if "CommTimeout" not in text:
                found.append(r)
        # blame from evidence, not from when we looked: a rank killed (no words) while we
        # were busy reading another's words counts from the last moment it was seen alive,
        # so a peer that failed *because* it died cannot come first
        return sorted(found, key=lambda r: (r.when, r.words != "", self._died(r)))

    def _blame(self, live: list[Rank], stacks: dict[int, str]) -> Outcome:
        causes = self._causes()
        if causes:
            r = causes[0]
            return Outcome(_exit_code(r.code), r.rank, self._own_words(r))
        left = self._left_early(r"rank (\d+) ended \(")  # the comm named it, from the roll
        if left is not None:
            return left
        waited = [r for r in self.ranks if r.words == "txt"]  # all timeouts now
        if waited:
            texts = {r.rank: _read(self._path(r, "txt")) for r in waited}
            peers = {int(p) for t in texts.values() for p in re.findall(r"with peer (\d+)", t)}
            silent = [r for r in live if not _in_comm(stacks.get(r.rank, ""))]
            hung = [r for r in silent if r.rank in peers] or silent
            if hung:
                names = ", ".join(str(r.rank) for r in waited)
                last = texts[waited[0].rank].strip().splitlines()[-1]
                why = f"hung: no progress while rank(s) {names} waited for it: {last}\n"
                return Outcome(
                    1, hung[0].rank, why + _stack_text(stacks.get(hung[0].rank, "")), how="hung"
                )
            left = self._left_early(r"with peer (\d+)")  # the peer a timed-out rank waited for
            return left or Outcome(1, waited[0].rank, texts[waited[0].rank])
        after = sorted((r for r in self.ranks if r.words == "after"), key=lambda r: r.when)
        if after:
            return Outcome(1, after[0].rank, _read(self._path(after[0], "after")))
        return Outcome(1)

    def _left_early(self, names: str) -> Outcome | None:
        """A rank that exited 0 while another still waited for it, named (the regex `names`)
        in the waiting rank's error: it left early, and the job fails (exit code 1)."""
        failed = [r for r in self.ranks if r.words in ("txt", "after")]
        for waiting in sorted(failed, key=lambda r: r.when):
            text = _read(self._path(waiting, waiting.words))
            named = {int(n) for n in re.findall(names, text)}
            gone = [r for r in self.ranks if r.rank in named and r.words == "exit" and r.code == 0]
            if gone:
                r = min(gone, key=lambda r: r.when)
                why = f"it ended (exit code 0) while rank {waiting.rank} still waited for it:\n"
                return Outcome(1, r.rank, why + text, how="left early", rank_code=0)
        return None

    def _own_words(self, r: Rank) -> str:
        if r.words == "txt":
            return _read(self._path(r, "txt"))
        if r.words == "exit":
            return f"(it exited with code {r.code}: sys.exit, no traceback)\n"
        if r.code is not None and r.code < 0:
            return f"(no traceback: killed by signal {-r.code})\n"
        return "(no traceback: it ended without one: killed?)\n"


def _in_comm(stack: str) -> bool:
    """Whether a faulthandler dump shows the main thread (the one that took the signal)
    inside minidist's comm: waiting too, so not the rank that stopped making progress."""
    main = stack.split("Current thread", 1)[-1].split("\n\n", 1)[0]
    return f"{os.sep}minidist{os.sep}comm{os.sep}" in main


def _stack_text(stack: str) -> str:
    return f"its stack (faulthandler):\n{stack}" if stack else "(its stack could not be taken)\n"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _exit_code(code: int | None) -> int:
    if code is None:
        return 1  # an mpi rank that vanished: mpiexec keeps its code to itself
    return 128 - code if code < 0 else code  # killed by signal s: 128 + s, as shells report
