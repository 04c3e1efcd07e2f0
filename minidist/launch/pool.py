"""A pool of ranks: n processes of one backend, started once, that run one job after another.

The test harness runs each process-tier test as one job of a pool (minidist.testing.run_processes)
instead of starting its ranks afresh. Measured on the 2-core machine: a fresh 4-rank world costs
about 8 CPU-seconds besides the work (each rank 1.3-1.8 s to start Python and import torch and
minidist, 0.5 s to tear the interpreter down; MPI or Gloo init; mpiexec), while the work of most
process-tier tests takes 1-3 CPU-seconds in all.

What it is. Pool(n, backend, env) starts `python -m minidist.launch.pool FOLDER` as n ranks with
launch() (launcher.py), on a thread of this process: the same wrapper, watchdog, init() and
failure hook as any job's ranks. Each rank then serves jobs: the parent writes job{k}.pkl (fn,
args, the job's variables and working directory) and a line `k` into every rank's FIFO
(rank{r}.jobs); every rank runs fn(comm, *args) and leaves result{k}.rank{r}.pkl.

Why a job equals a fresh start:
- Its comm is new, split off the world for the job (a new MPI communicator, a new Gloo group):
  sequence numbers from 0, no message of another job can match, no plan trusted; its timeout is
  the one MINIDIST_TIMEOUT gives a fresh rank, and MINIDIST_DEBUG wraps it as init() would.
- What a process holds for every caller is put back before each job as the pool found it:
  torch's default generator, default dtype, threads, grad mode and deterministic flag; the
  environment (with the job's MINIDIST_TIMEOUT and MINIDIST_UNRECEIVED), the working directory,
  the warning filters.
- Modules are imported once (that is the saving) and keep their state: the rank functions are
  also the thread tier's, which run one after another in one process (and a job's ranks side
  by side), so they keep theirs in arguments and locals. The environment that imports read
  (MINIDIST_IMPL_*, MINIDIST_DEBUG, OMP_NUM_THREADS, PYTHONPATH) is part of the pool's key: a
  test run under another environment gets another pool (Pools).
- A job ends as a program ends: the final barrier, then the exit check of comm/leftovers.py
  (leftovers.check) on the comms alive. A job that left a message, or a thread still at work,
  retires the pool: its ranks end as any rank ends, and the launcher reads their reports, so the
  verdict and its words are a fresh start's.
- A job that fails ends the pool: the exception leaves the rank's loop, and the failure hook and
  the watchdog report it as for any rank. A job that outlives its timeout stops the pool (launch's
  stop), and the report names the ranks that had not finished, as launch's timeout does. The next
  job gets a new pool.
- A pool retires after JOBS jobs, and a Gloo pool once its ranks hold more than GROUPS groups:
  each job leaves its communicators behind, from 2 to 43 a job in the suite, measured (mpi4py
  frees none, and MPICH holds at most 2048 per process; a Gloo group cannot be destroyed
  without its name, which counts the groups held, being given to a later group whose
  rendezvous would then read the old one's addresses; and it keeps a thread that wakes every
  10 ms: 43 groups cost an idle rank 4% of a core).
Measured over the process tier's 43 pooled tests: 526 CPU-seconds started afresh, about 280 on
pools; 14 mpi jobs on one 4-rank pool took 19 CPU-seconds in all, the same 14 on gloo 55 (four
pools: their groups).
"""

from __future__ import annotations

import gc
import os
import pickle
import sys
import threading
import time
import warnings

import torch

from minidist.comm import leftovers
from minidist.comm.checked import CheckedComm
from minidist.comm.deadlock import thread_frames
from minidist.comm.protocol import DEFAULT_TIMEOUT
from minidist.launch import processes
from minidist.launch.init import init
from minidist.launch.launcher import launch
from minidist.launch.watchdog import Outcome

PREFIX = "minidist-pool-"  # a pool's folder, in the temporary folder: jobs, results, FIFOs
JOBS = 16  # jobs a pool serves before it retires (43 communicators a job at most: 688 of 2048)
# Gloo groups a rank may hold after a job: each keeps a thread that wakes every 10 ms (gloo's
# tcp loop), about 0.1% of a core a group and rank while the pool waits for its next job
GROUPS = 24
WAIT_THREADS = 1.0  # seconds a job's threads get to end after it (a dropped executor's worker)
POLL = 0.005  # seconds between two looks for the ranks' results
_POOL_WORKER = os.path.join("concurrent", "futures", "thread.py")  # a thread pool's worker loop


class Pool:
    """n ranks of `backend`, started by launch() on a thread of this process, serving jobs."""

    def __init__(self, n: int, backend: str, env: dict):
        self.n = n
        self.backend = backend
        self.folder, self.lock = processes.job_folder(prefix=PREFIX)
        self.jobs = 0
        self.fifos = []
        for r in range(n):
            path = os.path.join(self.folder, f"rank{r}.jobs")
            os.mkfifo(path)
            # read-write: opens at once, and a rank's read waits (never ends) between jobs
            self.fifos.append(os.open(path, os.O_RDWR))
        self.telling = threading.Lock()  # the FIFOs: written to, or closed, by one thread
        self.stop = threading.Event()
        self.ended = threading.Event()
        self.outcome = None
        argv = ["-m", "minidist.launch.pool", self.folder]
        # the launch lives on this thread: the ranks die with it (processes.start, Linux)
        self.thread = threading.Thread(
            target=self._launch, args=(argv, env), name=f"minidist-pool-{backend}", daemon=True
        )
        self.thread.start()

    def _launch(self, argv: list[str], env: dict) -> None:
        try:
            how = dict(env=env, done_marker=self._done, stop=self.stop)
            self.outcome = launch(argv, self.n, self.backend, **how)
        except BaseException as e:  # told to the job that waits, as its failure
            self.outcome = Outcome(1, None, f"the pool's launch failed: {e!r}\n")
        finally:
            self.ended.set()

    def _result(self, k: int, r: int) -> str:
        return os.path.join(self.folder, f"result{k}.rank{r}.pkl")

    def _done(self, r: int) -> bool:
        """Whether rank r has finished the current job (the launcher's done_marker)."""
        return os.path.exists(self._result(self.jobs - 1, r))

    @property
    def alive(self) -> bool:
        return not self.ended.is_set() and self.jobs < JOBS

    def run(self, fn, args: tuple, timeout: float, variables: dict) -> list:
        """fn(comm, *args) on every rank, as one job; the per-rank results in rank order.
        variables: the job's MINIDIST_TIMEOUT, and MINIDIST_UNRECEIVED where it allows. Raises
        AssertionError naming the backend and world size with the launcher's report, as
        testing.run_processes does, if a rank fails, the job leaves messages unreceived, or it
        outlives `timeout` seconds."""
        k = self.jobs
        self.jobs += 1
        path = os.path.join(self.folder, f"job{k}.pkl")
        processes.write_whole(path, pickle.dumps((fn, args, variables, os.getcwd())))
        with self.telling:
            for fd in self.fifos:
                os.write(fd, f"{k}\n".encode())
        deadline = time.monotonic() + timeout
        done = lambda: all(os.path.exists(self._result(k, r)) for r in range(self.n))  # noqa: E731
        while not done() and not self.ended.wait(POLL):
            if time.monotonic() > deadline:
                self.stop.set()  # the launcher names the ranks not done, and stops them all
                break
        if not done():
            self.close()
            raise AssertionError(f"{self.backend} x {self.n}: {self.outcome.report()}")
        results = []
        for r in range(self.n):
            with open(self._result(k, r), "rb") as f:
                results.append(pickle.load(f))
            os.remove(self._result(k, r))
        os.remove(path)
        if all(reuse for _, reuse in results) and not self.ended.is_set():
            return [result for result, _ in results]
        self.close()  # a job left something behind: the ranks' own end decides, as a fresh one's
        if self.outcome.returncode != 0:
            raise AssertionError(f"{self.backend} x {self.n}: {self.outcome.report()}")
        return [result for result, _ in results]

    def close(self, wait: bool = True, kill: bool = False) -> None:
        """Tell every rank to end after its job (they run their exit checks as any rank does;
        kill: stop them now, as a timeout does); with wait, wait for the launch to end and
        remove the pool's folder, else a thread does. Any number of times, from any thread."""
        if kill:
            self.stop.set()
        with self.telling:
            for fd in self.fifos:
                os.write(fd, b"stop\n")
        if wait:
            self._finish()
        else:
            threading.Thread(target=self._finish, name="minidist-pool-close", daemon=True).start()

    def _finish(self) -> None:
        self.thread.join()
        with self.telling:
            for fd in self.fifos:
                os.close(fd)
            self.fifos = []
            if self.lock is not None:
                processes.release_folder(self.folder, self.lock)
                self.lock = None


class Pools:
    """The pools of this process, one per (backend, world size, environment), holding at most
    max_ranks ranks in all (each holds about 0.25 GB between jobs): to make room, the pool whose
    kind has run the fewest jobs goes first (of equals the smaller, then the least recently
    used), so the 4-rank pools most tests share are not pushed out by the 2- and 3-rank ones a
    few tests use. Worlds of more than max_world ranks (rare) run without a pool, for the same
    reason."""

    def __init__(self, max_ranks: int = 12, max_world: int = 4):
        self.max_ranks = max_ranks
        self.max_world = max_world
        self.pools: dict[tuple, Pool] = {}  # least recently used first
        self.used: dict[tuple, int] = {}  # key -> jobs run, over all its pools
        self.closing: list[Pool] = []

    def run(self, fn, n: int, backend: str, args: tuple, timeout: float, variables: dict):
        """Pool.run on the pool for (backend, n) in this environment, started if needed."""
        env = {"PYTHONPATH": _path(), "MINIDIST_TIMEOUT": str(DEFAULT_TIMEOUT)}
        key = (backend, n, frozenset(_environment(env).items()))
        pool = self.pools.pop(key, None)
        if pool is not None and not pool.alive:
            self._retire(pool)
            pool = None
        if pool is None:
            while self.pools and sum(p.n for p in self.pools.values()) + n > self.max_ranks:
                # the kind that ran the fewest jobs; of equals the smaller, then the first
                fewest = min(self.pools, key=lambda k: (self.used[k], self.pools[k].n))
                self._retire(self.pools.pop(fewest))
            pool = Pool(n, backend, env)
        self.pools[key] = pool  # the most recently used, last
        self.used[key] = self.used.get(key, 0) + 1
        try:
            return pool.run(fn, args, timeout, variables)
        except BaseException:  # a failed job ended the pool; an interrupt stops it
            self.pools.pop(key, None)
            self._retire(pool, kill=True)
            raise

    def _retire(self, pool: Pool, kill: bool = False) -> None:
        pool.close(wait=False, kill=kill)
        self.closing.append(pool)

    def close(self) -> None:
        """Close every pool and wait until their ranks have ended and their folders are gone."""
        for pool in self.pools.values():
            pool.close(wait=False)
        self.closing += self.pools.values()
        self.pools = {}
        for pool in self.closing:
            pool.close()
        self.closing = []


def _path() -> str:
    """This process's import path, for the ranks: they must import what fn's module imports."""
    return os.pathsep.join(os.path.abspath(p or ".") for p in sys.path if os.path.isdir(p or "."))


def _environment(env: dict) -> dict:
    """The environment a pool's ranks start with, but for what changes from test to test."""
    return {k: v for k, v in (os.environ | env).items() if k != "PYTEST_CURRENT_TEST"}


# ---- in each rank ----------------------------------------------------------------------------


class _Process:
    """What a process holds for every caller, taken when the pool starts, put back per job."""

    def __init__(self):
        self.rng = torch.random.get_rng_state()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.grad = torch.is_grad_enabled()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.filters = list(warnings.filters)

    def restore(self, variables: dict, cwd: str) -> None:
        torch.random.set_rng_state(self.rng)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_grad_enabled(self.grad)
        torch.use_deterministic_algorithms(self.deterministic)
        os.environ.clear()
        os.environ.update(self.environ | variables)
        os.chdir(cwd)
        warnings.filters[:] = self.filters


def serve(folder: str) -> None:
    """The body of each rank of a pool: init once, then run the jobs the parent sends, each on a
    comm of its own, until told to stop, a job fails (its exception ends this rank), or a job
    leaves something behind (this rank ends, and its exit check reports it)."""
    world = init(debug=False)
    debug = os.environ.get("MINIDIST_DEBUG", "") not in ("", "0")
    process = _Process()
    gc.freeze()  # what the imports made is never garbage: each job's collections skip it
    with open(os.path.join(folder, f"rank{world.rank}.jobs")) as jobs:
        while True:
            line = jobs.readline().strip()
            if line in ("", "stop"):  # told to stop, or the parent is gone
                return
            k = int(line)
            with open(os.path.join(folder, f"job{k}.pkl"), "rb") as f:
                fn, args, variables, cwd = pickle.load(f)
            process.restore(variables, cwd)
            world.timeout = float(process.environ["MINIDIST_TIMEOUT"])
            threads = set(threading.enumerate())
            comm = world.split(0)  # the job's own: nothing of another job reaches it
            comm.timeout = float(os.environ["MINIDIST_TIMEOUT"])
            job = CheckedComm(comm) if debug else comm
            result = fn(job, *args)
            # every rank finishes its work before any leaves (a leaving rank can close links)
            job.barrier()
            del fn, args, job
            left = leftovers.check() is not None  # as at exit; the job's comm still counts
            del comm
            reuse = not left and not _running(threads) and _groups(world) <= GROUPS
            gc.freeze()
            path = os.path.join(folder, f"result{k}.rank{world.rank}.pkl")
            processes.write_whole(path, pickle.dumps((result, reuse)))
            if not reuse:
                return  # the exit check runs as the rank ends, under the job's variables


def _groups(world) -> int:
    """The torch.distributed process groups this rank holds (mpi: none)."""
    if world.backend == "mpi":
        return 0
    from minidist.comm import torchdist

    return torchdist._groups_made()


def _running(before: set) -> list[threading.Thread]:
    """The threads a job started that are still at work WAIT_THREADS seconds after it. A thread
    pool's worker waiting for work is not: it holds nothing of the job, and a fresh process that
    ran the same code would hold it too (torch starts one for good: _prefetch_executor)."""
    end = time.monotonic() + WAIT_THREADS
    started = [t for t in threading.enumerate() if t not in before]
    for t in started:
        t.join(max(0.0, end - time.monotonic()))
    frames = thread_frames()
    return [t for t in started if t.is_alive() and not _idle_worker(frames.get(t.ident))]


def _idle_worker(frame) -> bool:
    """Whether a thread's innermost frame is a thread pool worker's loop itself: it waits in
    the queue's get (C code) for work; at work, the work's own frames would be innermost."""
    if frame is None:
        return False
    code = frame.f_code
    return code.co_name == "_worker" and code.co_filename.endswith(_POOL_WORKER)


if __name__ == "__main__":
    serve(sys.argv[1])
