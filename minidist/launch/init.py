"""`minidist.init()`: inside a rank, find out how this process was started and return the
world comm; and the failure hook that ends the whole job when this rank dies.

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

The rendezvous store of torch.distributed ranks: served by the launcher where one does
(`minidist run` and torchrun serve it and say so, TORCHELASTIC_USE_AGENT_STORE=True: every rank
joins it as a client), else by rank 0 on MASTER_PORT (srun, ranks started by hand).
Under `minidist run` the launcher's watchdog ends the job when a rank fails (launch/watchdog.py);
under the other launchers init() gives the comm a roll of the ranks that ended (a wait on one
fails naming it), and torch.distributed ranks a StoreJob that ends the whole job when one
fails (comm/exits.py). The parent side, `minidist run`, is launch/launcher.py.
Lesson: lessons/01_processes_p2p/ (which backend started me?), lessons/03_debugging_hangs/.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback

from minidist.comm.checked import CheckedComm
from minidist.comm.protocol import DEFAULT_TIMEOUT, CommTimeout, PeerFailed
from minidist.comm.threads import ThreadsWorld
from minidist.launch.processes import write_whole
from minidist.launch.watchdog import FolderRoll

BACKENDS = ("threads", "mpi", "gloo", "nccl")
thread_rank = threading.local()  # .comm: a thread-rank's, set by `minidist run --backend threads`


def detect_backend(env=os.environ) -> str:
    """The backend the environment implies (see the table in the module docstring)."""
    if env.get("MINIDIST_BACKEND"):
        return env["MINIDIST_BACKEND"]
    if getattr(thread_rank, "comm", None) is not None:
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
        rank = int(env["RANK"])
        world = int(env["WORLD_SIZE"])
    else:
        rank = int(env["SLURM_PROCID"])
        world = int(env["SLURM_NTASKS"])
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
        comm = getattr(thread_rank, "comm", None) or ThreadsWorld(1, timeout).comm(0)
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
        # torchrun's agent, or minidist run, serves the store on MASTER_PORT and says so
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
            # at once whole: a launcher that read it half written took an empty file for a
            # rank that failed on its own (a rank that timed out, blamed for the hang)
            write_whole(os.path.join(folder, f"rank{comm.rank}.{suffix}"), text.encode())
        if folder and isinstance(value, CommTimeout):
            time.sleep(5)  # stay: the launcher takes the stack of the rank it waited for first
        elif comm.backend == "mpi" and comm.world_size > 1 and not folder:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)  # no launcher watches: stop the job ourselves
        os._exit(1)  # do not wait in atexit handlers for peers that will never answer

    sys.excepthook = hook  # (under minidist run, the watchdog's wrapper left this rank's pid)
