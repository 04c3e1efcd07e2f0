"""`minidist run`: start the ranks of a job on this machine, watch them, and stop them all when
one fails or hangs. The rank side, `minidist.init()`, is launch/init.py.

`minidist run -n N [--backend mpi|gloo|nccl|threads] script.py args` starts N ranks: mpi hands
over to `mpiexec`; gloo and nccl spawn N processes with the torchrun variables (every rank with
OMP_NUM_THREADS = cores // N unless set: the ranks' torch threads must not fight over the
cores); threads runs N copies of the script as threads of this process (launch/thread_ranks.py).
When a rank fails the others are stopped within seconds, the failing rank and its traceback are
reported, and the exit code is the failing rank's; a hung rank is named with its stack (the
watchdog, launch/watchdog.py).

The rendezvous store of gloo and nccl is served by this launcher, as torchrun's agent serves
it: a TCPStore bound to a port the OS chooses as it binds (port 0), whose number the ranks get
as MASTER_PORT, with TORCHELASTIC_USE_AGENT_STORE=True so that every rank, rank 0 too, joins it
as a client. No port is ever released between being chosen and being bound. (Choosing a free
port, releasing it and letting rank 0 bind it seconds later lets anything take it in between:
another job's store, or the local end of any TCP connection, which the OS draws from the same
range. Then rank 0 fails with "Address already in use".) mpi has no such gap: mpiexec binds its
own sockets as the OS chooses their ports and hands each rank an open connection (PMI_FD).
Lesson: lessons/01_processes_p2p/ (launch), lessons/03_debugging_hangs/ (the watchdog).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import runpy
import shutil
import signal
import sys
import time

from minidist.comm.protocol import DEFAULT_TIMEOUT
from minidist.comm.threads import ThreadsWorld
from minidist.launch import processes
from minidist.launch.init import BACKENDS, init, thread_rank
from minidist.launch.thread_ranks import ThreadRun, run_thread_ranks
from minidist.launch.watchdog import Lifelines, Outcome, Watch, job_timeout

PROCESS_BACKENDS = tuple(b for b in BACKENDS if b != "threads")  # launch starts processes
# rank 0 takes the launcher's standard input first (processes.take_stdin: mpi passes it down)
WRAPPER = (
    "import sys; from minidist.launch.processes import take_stdin; take_stdin(); "
    "from minidist.launch.watchdog import rank_main; rank_main(sys.argv[1:])"
)
# seconds the ranks of a job that succeeded get to leave (MPI_Finalize, mpiexec's last output):
# MPICH's finalize waits forever for a message sent but never received (a worker a parameter
# server dropped), and every rank has already reported exit code 0
EXIT_GRACE = 10.0
THREADS_GRACE = 2.0  # seconds a thread-rank may run on after another failed, before it is hung


def mpiexec() -> str:
    """The mpiexec installed beside this Python (the MPICH wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.path.exists(here) else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpiexec found: pip install mpich (or use --backend gloo)")
    return found


def serve_store(n: int, timeout: float):
    """The rendezvous store of a job of n torch.distributed ranks, served by this process on
    127.0.0.1 at a port the OS chooses as it binds (.port): the ranks join it as clients.
    Its server runs on a thread of torch's until the store is freed."""
    import torch.distributed as dist

    wait = datetime.timedelta(seconds=timeout + 30)  # the ranks' own timeouts fire first
    # wait_for_workers=False: return at once; the ranks connect when they have started
    return dist.TCPStore("127.0.0.1", 0, n, True, wait, wait_for_workers=False)


def launch(
    argv: list[str],
    n: int,
    backend: str,
    env: dict | None = None,
    timeout: float | None = None,
    done_marker=None,
    linger: float | None = None,
    stop=None,
) -> Outcome:
    """Run `python argv...` as n ranks over mpi, gloo or nccl; stop all when one fails or hangs.

    Each rank runs under the watchdog's wrapper (launch/watchdog.py), which tells this launcher
    when it ends and with which code, and dumps its stack on request. gloo and nccl ranks meet
    at the store this launcher serves (serve_store). timeout: seconds for the whole job (None:
    no limit); a rank still running MINIDIST_TIMEOUT seconds after another finished is stopped
    as hung (linger: other seconds, e.g. inf where rank 0 works on alone on purpose).
    done_marker(rank) -> bool, when given, tells which ranks finished their work, so that a
    timeout names only the others. stop: a threading.Event; once another thread sets it, the
    job is stopped as if its timeout had passed (launch/pool.py runs one job after another on
    ranks it started once, each job with its own timeout).
    """
    if n < 1:
        raise ValueError(f"-n {n}: the number of ranks must be at least 1")
    if backend not in PROCESS_BACKENDS:
        raise ValueError(
            f"backend={backend!r}: launch starts processes for {', '.join(PROCESS_BACKENDS)}"
        )
    failures, lock = processes.job_folder()  # removed in the finally, or by a later launch
    base = dict(os.environ, **(env or {}), MINIDIST_BACKEND=backend)
    base["MINIDIST_FAILURE_DIR"] = failures
    base.setdefault("PYTHONUNBUFFERED", "1")
    # torch's default is a thread per core in each rank: n ranks oversubscribe the cores n
    # times, and on the busy 2-core machine a 1 MiB copy with 2 threads took 16 ms, with one
    # 0.07 ms. torchrun sets 1; here a share of the cores each, unless the user has chosen
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    wrapped = [sys.executable, "-c", WRAPPER, *argv]
    procs = []
    store = None
    lifelines = Lifelines(failures, n) if hasattr(os, "mkfifo") else None
    deadline = None if timeout is None else time.monotonic() + timeout
    old = processes.exit_on_sigterm()
    try:
        if backend == "mpi":
            # we stop the job ourselves: mpiexec's own cleanup would SIGKILL every rank within
            # a millisecond of the first death, leaving no trace of which rank died first
            cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(n), *wrapped]
            procs.append(processes.start(cmd, base, stdin="pass"))  # for rank 0 alone
        else:
            store = serve_store(n, job_timeout(base))
            for r in range(n):
                rank_env = dict(base, **_torch_variables(r, n, store.port))
                stdin = "inherit" if r == 0 else "none"  # rank 0 alone reads the input
                procs.append(processes.start(wrapped, rank_env, stdin))
        linger = job_timeout(base) if linger is None else linger
        watch = Watch(procs, n, backend, failures, linger, deadline, lifelines, stop)
        outcome = watch.run() or Outcome(0)
        if outcome.timed_out and done_marker is not None:
            outcome.still_running = [r for r in outcome.still_running if not done_marker(r)]
        if outcome.returncode == 0:  # every rank ended: let them (and mpiexec's output) finish
            processes.wait(procs, min(EXIT_GRACE, job_timeout(base)))
            outcome = _unreceived(failures, n) or outcome  # what the ranks found at their exit
        return outcome
    finally:
        processes.stop(procs)  # also on SIGTERM or Ctrl-C: no rank outlives the launcher
        del store  # its server stops: every rank is stopped
        if lifelines is not None:
            lifelines.close()
        processes.release_folder(failures, lock)
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _torch_variables(rank: int, n: int, port: int) -> dict[str, str]:
    """torchrun's variables for one rank of n on this machine, the store served at port by
    this launcher (TORCHELASTIC_*: plain torch.distributed scripts join it as a client too)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(n),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(n),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }


def _unreceived(folder: str, n: int) -> Outcome | None:
    """The ranks' reports of messages never received, found at their exit (comm/leftovers.py),
    blaming the first that found any; None if none did."""
    texts = {}
    for r in range(n):
        path = os.path.join(folder, f"rank{r}.unreceived")
        if os.path.exists(path):
            with open(path) as f:
                texts[r] = f.read()
    if not texts:
        return None
    how = "found messages never received at its exit"
    return Outcome(1, min(texts), "".join(texts.values()), how=how)


def start_ranks(module: str, argv: list[str], n: int, backend: str, command: str, **how) -> int:
    """The parent of a command (`minidist train`, `minidist bench ...`): run n ranks of
    `python -m module argv...` (threads: the module's file as n threads) and wait; 0, or the
    failing rank's exit code after printing `command: <the watchdog's report>` to stderr.
    how: env and linger for launch; timeout (the threads world's) and linger for run_threads."""
    if backend == "threads":
        script = importlib.util.find_spec(module).origin
        keep = {k: v for k, v in how.items() if k in ("timeout", "linger")}
        outcome = run_threads([script, *argv], n, **keep)
    else:
        keep = {k: v for k, v in how.items() if k in ("env", "linger")}
        outcome = launch(["-m", module, *argv], n, backend, **keep)
    if outcome.returncode != 0:
        print(f"{command}: {outcome.report()}", file=sys.stderr, end="")
    return outcome.returncode


def demo_init(script: str, n: int = 4):
    """init() for a script that should show several ranks even when started plainly.

    Started with plain `python script.py` (a threads world of one), run the script again as n
    thread-ranks of this process and exit with their outcome; under minidist run, mpiexec,
    torchrun or srun, return this rank's comm as init() does. Lesson demos start this way.
    """
    comm = init()
    if comm.backend == "threads" and comm.world_size == 1:
        outcome = run_threads([script, *sys.argv[1:]], n)
        if outcome.returncode != 0:
            print(outcome.report(), file=sys.stderr, end="")
        sys.exit(outcome.returncode)
    return comm


def run_threads(
    argv: list[str],
    n: int,
    timeout: float = DEFAULT_TIMEOUT,
    linger: float | None = None,
    sends: str = "buffered",
) -> Outcome:
    """Run the script `argv[0]` as n threads of this process, each with its own threads comm
    (its init() returns it), on the runner of launch/thread_ranks.py.

    The watchdog's rules, for threads: a failing rank aborts the world (the others wake with
    PeerFailed); a rank still running THREADS_GRACE s after another failed, or `linger` s
    (default: timeout) after another finished, is named hung with its stack. A thread cannot be
    killed: it is left behind (a daemon thread, it ends with the process). The world sees more
    than a watchdog: a deadlock, or a rank waiting for one that returned, fails at once naming
    the calls (comm/deadlock.py); a message no receive took fails the job at the end.
    sends: the world's ("buffered", or "rendezvous" as MPI_Ssend: comm/threads.py)."""
    world = ThreadsWorld(n, timeout, sends)

    def script(comm) -> None:
        thread_rank.comm = comm  # what init() returns in this thread
        runpy.run_path(argv[0], run_name="__main__")

    def abort_words(r: int, error: BaseException) -> str:
        return f"rank {r} exited" if isinstance(error, SystemExit) else f"rank {r} failed"

    old_argv = sys.argv
    sys.argv = list(argv)
    after_finish = timeout if linger is None else linger
    try:
        run = run_thread_ranks(
            script,
            world,
            after_failure=THREADS_GRACE,
            after_finish=after_finish,
            abort_words=abort_words,
        )
    finally:
        sys.argv = old_argv
    outcome = _threads_outcome(run)
    left = world.unreceived() if outcome.returncode == 0 else []
    if left:  # every rank ended well, yet a message was lost: a later run could take it
        lines = "".join(f"  {line}\n" for line in left)
        return Outcome(1, None, f"{len(left)} message(s) sent but never received:\n{lines}")
    return outcome


def _exit(error: BaseException, tb: str) -> tuple[int, str]:
    """(exit code, words) of a thread-rank's failure: sys.exit(3) has a code and no traceback."""
    if not isinstance(error, SystemExit):
        return 1, tb
    code = error.code if isinstance(error.code, int) else 1
    return code, f"(it exited with code {error.code}: sys.exit, no traceback)\n"


def _threads_outcome(run: ThreadRun) -> Outcome:
    """Blame as the watchdog does: an own failure, then a hung rank, then a timeout."""
    errors = {r: _exit(*run.errors[r]) for r in run.errors}  # rank -> (exit code, words)
    ended = run.ended
    own = [r for r, (_, tb) in errors.items() if "PeerFailed" not in tb and "CommTimeout" not in tb]
    if own:
        # a deadlock is every rank's at once: name the lowest, the same on every run
        first = min(own, key=lambda r: (0, r) if "Deadlock" in errors[r][1] else (-1, ended[r]))
        return Outcome(errors[first][0], first, errors[first][1])
    hung = run.running
    if hung:
        waited = sorted(r for r, (_, tb) in errors.items() if "CommTimeout" in tb)
        why = f"rank(s) {waited} timed out waiting" if waited else "the others finished"
        text = f"hung: still running after {why}; ranks still running: {hung}\nits stack:\n"
        return Outcome(1, hung[0], text + run.stack(hung[0]), how="hung")
    if not errors:
        return Outcome(0)
    first = min(errors, key=lambda r: ("PeerFailed" in errors[r][1], ended[r]))
    return Outcome(errors[first][0], first, errors[first][1])
