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
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint host0:29500 train.py
    srun -N 2 --ntasks-per-node 8 python train.py     # MASTER_ADDR: the first node

Outside, `minidist run -n N [--backend mpi|gloo|threads] script.py args` starts N ranks on this
machine: mpi hands over to `mpiexec`, gloo spawns N processes with the torchrun variables on a
free port, threads runs N copies of the script as threads of this process. When a rank fails the
others are stopped within seconds, the failing rank and its traceback are reported, and the exit
code is non-zero.
"""

from __future__ import annotations

import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

from .comm.checked import CheckedComm
from .comm.protocol import DEFAULT_TIMEOUT, PeerFailed
from .comm.threads import ThreadsWorld

BACKENDS = ("threads", "mpi", "gloo", "nccl")
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
    if backend == "threads":
        comm = getattr(_local, "comm", None) or ThreadsWorld(1, timeout).comm(0)
        if asked:  # a thread-rank of minidist run honours a timeout of its own too
            comm.timeout = timeout
    elif backend == "mpi":
        from .comm.mpi import MPIComm

        comm = MPIComm(timeout=timeout)
    else:
        from .comm import torchdist

        rank, world, addr, port = _torch_env()
        local_rank = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or rank
        comm = torchdist.init_process_group(
            backend, rank, world, addr, port, timeout, int(local_rank)
        )
    if backend != "threads":
        _install_failure_hook(comm)
    return CheckedComm(comm) if debug else comm


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
    finds it, and (MPI) abort the whole job so no rank waits for the dead one."""

    def hook(kind, value, tb):
        text = "".join(traceback.format_exception(kind, value, tb))
        if isinstance(value, PeerFailed):  # a consequence: one line, the cause is reported
            shown = f"{kind.__name__}: {value}"
        else:
            shown = text
        sys.stderr.write("".join(f"[rank {comm.rank}] {line}\n" for line in shown.splitlines()))
        sys.stderr.flush()
        folder = os.environ.get("MINIDIST_FAILURE_DIR")
        if folder:  # a PeerFailed is a consequence of another rank's failure: mark it so
            suffix = "after" if isinstance(value, PeerFailed) else "txt"
            with open(os.path.join(folder, f"rank{comm.rank}.{suffix}"), "w") as f:
                f.write(text)
        if comm.backend == "mpi" and comm.world_size > 1:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
        os._exit(1)  # do not wait in atexit handlers for peers that will never answer

    sys.excepthook = hook
    folder = os.environ.get("MINIDIST_FAILURE_DIR")
    if folder:  # so the launcher can tell which mpiexec child ended first
        path = os.path.join(folder, f"rank{comm.rank}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)  # atomic: the launcher never reads a half-written pid


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


@dataclass
class Outcome:
    """How a launch ended: exit codes, the first failing rank and its traceback."""

    returncode: int
    failed_rank: int | None = None
    traceback: str = ""
    still_running: list[int] = field(default_factory=list)
    timed_out: bool = False

    def report(self) -> str:
        if self.timed_out:
            return f"timed out; ranks still running: {self.still_running}"
        if self.failed_rank is None:
            return f"failed with exit code {self.returncode}"
        tb = self.traceback or "(no traceback recorded: see the rank's output above)\n"
        return f"rank {self.failed_rank} failed (exit code {self.returncode}):\n{tb}"


def launch(
    argv: list[str],
    n: int,
    backend: str,
    env: dict | None = None,
    timeout: float | None = None,
    done_marker=None,
) -> Outcome:
    """Run `python argv...` as n ranks over mpi or gloo; stop all when one fails.

    done_marker(rank) -> bool, when given, tells which ranks finished their work, so that a
    timeout can name the ones still running (mpiexec hides its processes from us).
    """
    if n < 1:
        raise ValueError(f"-n {n}: the number of ranks must be at least 1")
    if backend not in ("mpi", "gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: launch starts processes for 'mpi', 'gloo', 'nccl'")
    failures = tempfile.mkdtemp(prefix="minidist-")
    base = dict(os.environ, **(env or {}), MINIDIST_BACKEND=backend)
    base["MINIDIST_FAILURE_DIR"] = failures
    base.setdefault("PYTHONUNBUFFERED", "1")
    if backend == "mpi":
        cmd = [mpiexec(), "-n", str(n), sys.executable, *argv]
        procs = [_start(cmd, base)]
    else:
        port = free_port()
        procs = []
        for r in range(n):
            rank_env = dict(base, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r))
            rank_env.update(LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(_start([sys.executable, *argv], rank_env))
    try:
        return _watch(procs, n, backend, failures, timeout, done_marker)
    finally:
        shutil.rmtree(failures, ignore_errors=True)


def _start(cmd: list[str], env: dict) -> subprocess.Popen:
    """Start a rank (or mpiexec) in its own process group, so it can be stopped as a whole,
    and (on Linux) have it receive SIGTERM if this launcher dies: no orphaned ranks."""
    return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    # runs in the child between fork and exec: only a plain libc call, resolved beforehand
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _find_prctl():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None).prctl


_prctl = _find_prctl()


def _watch(procs, n, backend, failures, timeout, done_marker) -> Outcome:
    """Poll the processes; on the first failure (or the deadline) stop them all."""
    deadline = None if timeout is None else time.monotonic() + timeout
    ended: list[int] = []  # ranks whose process ended, in the order we saw it
    while True:
        codes = [p.poll() for p in procs]
        _note_ended(procs, codes, backend, failures, ended)
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if bad or all(c == 0 for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            _stop(procs)
            running = [r for r in range(n) if done_marker is None or not done_marker(r)]
            return Outcome(1, still_running=running, timed_out=True)
        time.sleep(0.02)
    if bad:  # a rank that failed *because* a peer died may exit first: let the cause report
        end = time.monotonic() + 2
        while time.monotonic() < end and not _listing(failures, ".txt"):
            if all(p.poll() is not None for p in procs):
                break
            time.sleep(0.02)
    _stop(procs)
    if not bad:
        return Outcome(0)
    return _blame(failures, ended, [p.returncode for p in procs], bad, backend)


def _note_ended(procs, codes, backend, failures, ended: list[int]) -> None:
    """Append newly ended ranks: from exit codes (gloo) or vanished pids (mpi: ranks are
    mpiexec's children, so each rank leaves its pid in the failures folder at init)."""
    if backend != "mpi":
        ended += [r for r, c in enumerate(codes) if c is not None and r not in ended]
        return
    for name in _listing(failures, ".pid"):
        rank = int(name[4:-4])
        if rank not in ended and not _alive(int(_read(failures, name))):
            ended.append(rank)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _blame(failures, ended, codes, bad, backend) -> Outcome:
    """Which rank failed first, on its own: a traceback of its own beats a rank that died
    without one (killed), which beats a rank that only saw its peer die (PeerFailed)."""
    code = _exit_code(codes[bad[0]])
    own = _listing(failures, ".txt")
    if own:
        first = min(own, key=lambda f: _mtime(failures, f))
        return Outcome(code, int(first[4:-4]), _read(failures, first))
    after = {int(f[4:-6]) for f in _listing(failures, ".after")}
    silent = [r for r in ended if r not in after and (backend == "mpi" or codes[r] != 0)]
    if silent:
        signal_no = -codes[silent[0]] if backend != "mpi" and codes[silent[0]] < 0 else None
        how = f"killed by signal {signal_no}" if signal_no else "it ended without one (killed?)"
        return Outcome(code, silent[0], f"(no traceback: {how})\n")
    if after:
        first = min(after, key=lambda r: _mtime(failures, f"rank{r}.after"))
        return Outcome(code, first, _read(failures, f"rank{first}.after"))
    return Outcome(code, bad[0] if backend != "mpi" else None)


def _listing(folder: str, suffix: str) -> list[str]:
    return [f for f in os.listdir(folder) if f.endswith(suffix)]


def _read(folder: str, name: str) -> str:
    with open(os.path.join(folder, name)) as f:
        return f.read()


def _mtime(folder: str, name: str) -> float:
    return os.path.getmtime(os.path.join(folder, name))


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal s: 128 + s, as shells report


def _stop(procs) -> None:
    """SIGTERM every process group still alive, SIGKILL after 3 s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    end = time.monotonic() + 3
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.02)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_threads(argv: list[str], n: int, timeout: float = DEFAULT_TIMEOUT) -> Outcome:
    """Run the script `argv[0]` as n threads of this process, each with its own threads comm."""
    world = ThreadsWorld(n, timeout)
    errors: dict[int, str] = {}

    def rank_main(r: int) -> None:
        _local.comm = world.comm(r)
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                errors[r] = f"SystemExit({e.code})\n"
                world.abort(f"rank {r} exited")
        except BaseException:
            errors[r] = traceback.format_exc()
            world.abort(f"rank {r} failed")  # wake the others instead of letting them hang

    old_argv = sys.argv
    sys.argv = list(argv)
    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.argv = old_argv
    if not errors:
        return Outcome(0)
    real = [r for r, tb in errors.items() if "PeerFailed" not in tb]  # not woken by an abort
    first = min(real) if real else min(errors)
    return Outcome(1, first, errors[first])
