"""Starting ranks: `minidist.init()` inside a script, and `minidist run` outside it.

Inside a script, `comm = minidist.init()` finds out how the process was started and returns the
world comm:

    started by                        detected through                     backend
    mpiexec / mpirun (MPICH, Open MPI)  PMI_RANK, OMPI_COMM_WORLD_RANK, ...  mpi
    torchrun, minidist run -b gloo      RANK, WORLD_SIZE, MASTER_ADDR/PORT   gloo (nccl on GPUs)
    srun (Slurm)                        SLURM_PROCID, SLURM_NTASKS           gloo (nccl on GPUs)
    minidist run --backend threads      a thread-local comm from the launcher  threads
    plain `python script.py`            nothing                              threads, world 1

MINIDIST_BACKEND (set by `minidist run`) overrides the guess. Beyond one machine use the engine
you already have; the script does not change:

    mpiexec -f hosts -n 16 python train.py
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host0:29500 train.py
    srun -N 2 --ntasks-per-node 8 --kill-on-bad-exit=1 python train.py   # MASTER_ADDR: first node

Outside, `minidist run -n N [--backend mpi|gloo|threads] script.py args` starts N ranks on this
machine: mpi hands over to `mpiexec`, gloo spawns N processes with the torchrun variables on a
free port (every rank with OMP_NUM_THREADS = cores // N unless set: the ranks' torch threads
must not fight over the cores), threads runs N copies of the script as threads of this process.
When a rank fails the others are stopped within seconds, the failing rank and its traceback are
reported, and the exit code is the failing rank's; a hung rank is named with its stack (the
watchdog, launch/watchdog.py). Under the other launchers, init() gives the comm a roll of the ranks
that ended (a wait on one fails naming it), and torch.distributed ranks a StoreJob that ends
the whole job when one fails (comm/exits.py).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

from minidist.comm.checked import CheckedComm
from minidist.comm.protocol import DEFAULT_TIMEOUT, CommTimeout, PeerFailed
from minidist.comm.threads import ThreadsWorld
from minidist.launch import processes
from minidist.launch.watchdog import FolderRoll, Lifelines, Outcome, Watch, job_timeout

BACKENDS = ("threads", "mpi", "gloo", "nccl")
# rank 0 takes the launcher's standard input first (processes.take_stdin: mpi passes it down)
WRAPPER = (
    "import sys; from minidist.launch.processes import take_stdin; take_stdin(); "
    "from minidist.launch.watchdog import rank_main; rank_main(sys.argv[1:])"
)
# seconds the ranks of a job that succeeded get to leave (MPI_Finalize, mpiexec's last output):
# MPICH's finalize waits forever for a message sent but never received (a worker a parameter
# server dropped), and every rank has already reported exit code 0
EXIT_GRACE = 10.0
_local = threading.local()  # the comm of a thread started by `minidist run --backend threads`


def detect_backend(env=os.environ) -> str:
    """The backend the environment implies (see the table in the module docstring)."""
    if env.get("MINIDIST_BACKEND"):
        return env["MINIDIST_BACKEND"]
    if getattr(_local, "comm", None) is not None:
        return "threads"
    mpi_vars = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")
    if any(v in env for v in mpi_vars):
        return "mpi"
    if ("RANK" in env and "WORLD_SIZE" in env) or int(env.get("SLURM_NTASKS", "1")) > 1:
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
    return "threads"


def _torch_env(env=os.environ) -> tuple[int, int, str, int]:
    """(rank, world_size, master addr, master port) from torchrun's or Slurm's variables."""
    if "RANK" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    else:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    addr = env.get("MASTER_ADDR") or _first_slurm_host(env) or "127.0.0.1"
    port = env.get("MASTER_PORT")
    if not port and "SLURM_JOB_ID" in env:  # every rank of one job computes the same port
        port = 29500 + int(env["SLURM_JOB_ID"]) % 1000
    if not port and world > 1:  # a fixed default would make two such jobs meet at one store
        raise ValueError(
            f"MASTER_PORT is not set: the {world} ranks need a free port to meet at on "
            f"MASTER_ADDR={addr}, the same for every rank and for no other job "
            f"(minidist run and torchrun choose one)"
        )
    return rank, world, addr, int(port or 0)  # 0, a world of one: any free port


def _first_slurm_host(env) -> str | None:
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodes or not shutil.which("scontrol"):
        return None
    out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True)
    return out.stdout.split()[0] if out.returncode == 0 and out.stdout.strip() else None


def init(backend: str | None = None, timeout: float | None = None, debug: bool | None = None):
    """Return the world comm of this process (or thread), however it was started.

    backend: override the detection ("threads", "mpi", "gloo", "nccl").
    timeout: seconds every blocking operation may wait (MINIDIST_TIMEOUT, default 60).
    debug: wrap the comm in CheckedComm (MINIDIST_DEBUG=1), which turns mismatched collectives
    and messages into errors naming the ranks.
    """
    backend = backend or detect_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    asked = timeout or os.environ.get("MINIDIST_TIMEOUT")
    timeout = float(asked or DEFAULT_TIMEOUT)
    if debug is None:
        debug = os.environ.get("MINIDIST_DEBUG", "") not in ("", "0")
    folder = os.environ.get("MINIDIST_FAILURE_DIR")  # set by minidist run: its watchdog's
    if backend == "threads":
        comm = getattr(_local, "comm", None) or ThreadsWorld(1, timeout).comm(0)
        if asked:  # a thread-rank of minidist run honours a timeout of its own too
            comm.timeout = timeout
    elif backend == "mpi":
        from minidist.comm.exits import MPIJob
        from minidist.comm.mpi import MPIComm

        comm = MPIComm(timeout=timeout)
        if not folder and comm.world_size > 1 and _thread_multiple():
            # no minidist run watches: a rank that times out asks the others who hangs
            comm.job = MPIJob(comm.mpi_comm)
            atexit.register(comm.job.close)  # runs before MPI_Finalize (mpi4py's, at exit)
    else:
        from minidist.comm import torchdist

        rank, world, addr, port = _torch_env()
        local_rank = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or rank
        # torchrun's agent serves the store on MASTER_PORT itself and tells its workers so
        agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        # where no minidist run watches, the store ends the job when a rank fails; a job
        # torchrun restarts meets the same store again, with new keys
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        comm = torchdist.init_process_group(
            backend,
            rank,
            world,
            addr,
            port,
            timeout,
            int(local_rank),
            agent_serves,
            watch=not folder,
            attempt=attempt,
        )
    if backend != "threads":
        if folder:  # the ranks' exit codes, as the wrapper leaves them for the launcher
            comm.roll = FolderRoll(folder)
        _install_failure_hook(comm)
    return CheckedComm(comm) if debug else comm


def _thread_multiple() -> bool:
    """Whether MPI lets a second thread call it while the main thread does (MPIJob's watcher
    needs it; mpi4py asks for it, and MPICH from pip grants it)."""
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


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


def _install_failure_hook(comm) -> None:
    """On an uncaught exception: print it tagged with the rank, leave it where `minidist run`
    finds it, and end the whole job so no rank waits for the dead one: under `minidist run`
    its watchdog does; otherwise MPI aborts, and torch.distributed ranks hear it through the
    store (comm.job, exits.StoreJob), a timed-out rank naming the rank it waited for."""

    def hook(kind, value, tb):
        text = "".join(traceback.format_exception(kind, value, tb))
        if isinstance(value, PeerFailed):  # a consequence: one line, the cause is reported
            shown = f"{kind.__name__}: {value}"
        else:
            shown = text
        job = getattr(comm, "job", None)  # torch.distributed, no minidist run: the store's
        if job is not None:  # tell every rank; a timeout also finds the hung rank
            words = f"{kind.__name__}: {value}".splitlines()[0]
            shown += job.fail(words, isinstance(value, CommTimeout))
        sys.stderr.write("".join(f"[rank {comm.rank}] {line}\n" for line in shown.splitlines()))
        sys.stderr.flush()
        folder = os.environ.get("MINIDIST_FAILURE_DIR")
        if folder:  # a PeerFailed is a consequence of another rank's failure: mark it so
            suffix = "after" if isinstance(value, PeerFailed) else "txt"
            with open(os.path.join(folder, f"rank{comm.rank}.{suffix}"), "w") as f:
                f.write(text)
        if folder and isinstance(value, CommTimeout):
            time.sleep(5)  # stay: the launcher takes the stack of the rank it waited for first
        elif comm.backend == "mpi" and comm.world_size > 1 and not folder:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)  # no launcher watches: stop the job ourselves
        os._exit(1)  # do not wait in atexit handlers for peers that will never answer

    sys.excepthook = hook  # (under minidist run, the watchdog's wrapper left this rank's pid)


# ---- the launcher ------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mpiexec() -> str:
    """The mpiexec installed beside this Python (the MPICH wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.path.exists(here) else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpiexec found: pip install mpich (or use --backend gloo)")
    return found


def launch(
    argv: list[str],
    n: int,
    backend: str,
    env: dict | None = None,
    timeout: float | None = None,
    done_marker=None,
    linger: float | None = None,
) -> Outcome:
    """Run `python argv...` as n ranks over mpi or gloo; stop all when one fails or hangs.

    Each rank runs under the watchdog's wrapper (launch/watchdog.py), which tells this launcher when
    it ends and with which code, and dumps its stack on request. timeout: seconds for the whole
    job (None: no limit); a rank still running MINIDIST_TIMEOUT seconds after another finished
    is stopped as hung (linger: other seconds, e.g. inf where rank 0 works on alone on purpose).
    done_marker(rank) -> bool, when given, tells which ranks finished their work, so that a
    timeout names only the others.
    """
    if n < 1:
        raise ValueError(f"-n {n}: the number of ranks must be at least 1")
    if backend not in ("mpi", "gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: launch starts processes for 'mpi', 'gloo', 'nccl'")
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
            port = free_port()
            for r in range(n):
                rank_env = dict(base, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r))
                rank_env.update(LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1")
                stdin = "inherit" if r == 0 else "none"  # rank 0 alone reads the input
                procs.append(processes.start(wrapped, dict(rank_env, MASTER_PORT=str(port)), stdin))
        linger = job_timeout(base) if linger is None else linger
        watch = Watch(procs, n, backend, failures, linger, deadline, lifelines)
        outcome = watch.run() or Outcome(0)
        if outcome.timed_out and done_marker is not None:
            outcome.still_running = [r for r in outcome.still_running if not done_marker(r)]
        if outcome.returncode == 0:  # every rank ended: let them (and mpiexec's output) finish
            processes.wait(procs, min(EXIT_GRACE, job_timeout(base)))
            outcome = _unreceived(failures, n) or outcome  # what the ranks found at their exit
        return outcome
    finally:
        processes.stop(procs)  # also on SIGTERM or Ctrl-C: no rank outlives the launcher
        if lifelines is not None:
            lifelines.close()
        processes.release_folder(failures, lock)
        if old is not None:
            signal.signal(signal.SIGTERM, old)


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


def run_threads(
    argv: list[str],
    n: int,
    timeout: float = DEFAULT_TIMEOUT,
    linger: float | None = None,
    sends: str = "buffered",
) -> Outcome:
    """Run the script `argv[0]` as n threads of this process, each with its own threads comm.

    The watchdog's rules, for threads: a failing rank aborts the world (the others wake with
    PeerFailed); a rank still running 2 s after another failed, or `linger` s (default:
    timeout) after another finished, is named hung with its stack. A thread cannot be killed:
    it is left behind (a daemon thread, it ends with the process). The world sees more than a
    watchdog: a deadlock, or a rank waiting for one that returned, fails at once naming the
    calls (comm/deadlock.py); a message no receive took fails the job at the end.
    sends: the world's ("buffered", or "rendezvous" as MPI_Ssend: comm/threads.py)."""
    world = ThreadsWorld(n, timeout, sends)
    errors: dict[int, tuple[int, str]] = {}  # rank -> (exit code, traceback)
    finished: dict[int, float] = {}  # rank -> when its thread ended

    def rank_main(r: int) -> None:
        _local.comm = world.comm(r)
        try:
            runpy.run_path(argv[0], run_name="__main__")
            world.finish(r)
        except SystemExit as e:
            if e.code not in (None, 0):
                code = e.code if isinstance(e.code, int) else 1
                errors[r] = (code, f"(it exited with code {e.code}: sys.exit, no traceback)\n")
                world.abort(f"rank {r} exited")
            else:
                world.finish(r, "exited with code 0")
        except BaseException:
            errors[r] = (1, traceback.format_exc())
            world.abort(f"rank {r} failed")  # wake the others instead of letting them hang
        finished[r] = time.monotonic()

    old_argv = sys.argv
    sys.argv = list(argv)
    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(n)]
    try:
        for t in threads:
            t.start()
        hung = _join(threads, errors, finished, timeout if linger is None else linger)
    finally:
        sys.argv = old_argv
    outcome = _threads_outcome(threads, errors, finished, hung)
    left = world.unreceived() if outcome.returncode == 0 else []
    if left:  # every rank ended well, yet a message was lost: a later run could take it
        lines = "".join(f"  {line}\n" for line in left)
        return Outcome(1, None, f"{len(left)} message(s) sent but never received:\n{lines}")
    return outcome


def _join(threads, errors: dict, finished: dict, timeout: float) -> list[int]:
    """Wait for the thread-ranks; the ranks given up on as hung ([] when all ended)."""
    while True:
        alive = [r for r, t in enumerate(threads) if t.is_alive()]
        if not alive:
            return []
        now = time.monotonic()
        failed = [finished[r] for r in errors if r in finished]
        clean = [at for r, at in finished.items() if r not in errors]
        if (failed and now - min(failed) > 2) or (clean and now - min(clean) > timeout):
            return alive
        threads[alive[0]].join(0.02)


def _threads_outcome(threads, errors: dict, finished: dict, hung: list[int]) -> Outcome:
    """Blame as the watchdog does: an own failure, then a hung rank, then a timeout."""
    own = [r for r, (_, tb) in errors.items() if "PeerFailed" not in tb and "CommTimeout" not in tb]
    if own:
        # a deadlock is every rank's at once: name the lowest, the same on every run
        first = min(own, key=lambda r: (0, r) if "Deadlock" in errors[r][1] else (-1, finished[r]))
        return Outcome(errors[first][0], first, errors[first][1])
    if hung:
        frame = sys._current_frames().get(threads[hung[0]].ident)
        stack = "".join(traceback.format_stack(frame)) if frame else "(no stack)\n"
        waited = sorted(r for r, (_, tb) in errors.items() if "CommTimeout" in tb)
        why = f"rank(s) {waited} timed out waiting" if waited else "the others finished"
        text = f"hung: still running after {why}; ranks still running: {hung}\nits stack:\n"
        return Outcome(1, hung[0], text + stack, how="hung")
    if not errors:
        return Outcome(0)
    first = min(errors, key=lambda r: ("PeerFailed" in errors[r][1], finished[r]))
    return Outcome(errors[first][0], first, errors[first][1])
