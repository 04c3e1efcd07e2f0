"""The multi-rank test harness every test and every lab uses.

    results = run_ranks(fn, 4, "threads", x)     # fn(comm, x) on 4 ranks; a list, one per rank
    results = run_ranks(fn, 4, "mpi", x)         # the same over 4 real MPI processes
    results = run_ranks(fn, 4, "gloo", x)        # ... or 4 Gloo processes

`fn` gets the rank's comm first. On threads the world is the strict one (sends complete only when
their receive is posted, as MPI_Ssend): an ordering that can deadlock on any MPI fails at once
with `Deadlock` naming the cycle, and a message no receive took fails the run. Over processes
`fn` must be a module-level function (it is sent by name) and its arguments and result must
pickle; the ranks are a pool's (launch/pool.py), started once per backend, world size and
environment in each test process, each run a job on a comm of its own. A rank that raises
fails the whole run with that
rank's traceback; a run that outlives `timeout` fails naming the ranks still running, instead of
hanging the suite. Where MINIDIST_TIMEOUT is set (lab grading sets it low), no comm waits longer,
and no threads run lasts more than RUN_PAST_COMM_TIMEOUT longer (ranks that loop forever).

Thread-ranks share torch's global random generator: build data and weights from a
torch.Generator(seed), never torch.manual_seed, or ranks race for the same random numbers.

Inside ranks, never assert on one rank alone: the others would wait forever for it. Compute a
verdict on every rank and combine it first (`verdict`), so all ranks pass or fail together.
`compare` builds the per-tensor report (tensor, rank, max difference) the verdict carries.

Property tests over processes start the processes once and run the same property *inside*
every rank: on a few fixed hard cases (`in_subworlds(..., explicit=...)`; the threads tier
draws the wide sweeps), and where cases are drawn, with hypothesis under `RANK_SETTINGS`
(derandomized, no database, no deadline): every rank draws the same cases and, because
verdicts are combined before any assert, sees the same outcomes, so even shrinking stays in
step across ranks.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import sys
import tempfile
import threading

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minidist.comm.protocol import OPS, CommTimeout, Deadlock, PeerFailed
from minidist.launch.launcher import launch
from minidist.launch.pool import Pools
from minidist.launch.processes import write_whole
from minidist.launch.thread_ranks import run_thread_ranks

PROCESS_BACKENDS = ("mpi", "gloo")
GRACE = 1.0  # seconds run_threads waits for the other ranks once one has failed
# where MINIDIST_TIMEOUT is set (grading), a threads run lasts at most 2 s more: a rank that
# waits that long has failed by then (GRACE included), so only ranks that never stop computing
# or waiting outside the comm meet the cap (the longest correct graded run takes about 3 s)
RUN_PAST_COMM_TIMEOUT = 2.0

# hypothesis inside ranks: the same cases on every rank, and nothing that depends on timing
RANK_SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=list(HealthCheck),
)


def rank_settings(max_examples: int = 20) -> settings:
    """RANK_SETTINGS with a number of examples (hypothesis allows one settings decorator)."""
    return settings(RANK_SETTINGS, max_examples=max_examples)


def subworlds(comm) -> dict:
    """{k: the comm of ranks 0..k-1} for k = 1..world_size (ranks >= k get a comm of the rest,
    unused). Collective: world_size splits, made once so examples need none."""
    return {k: comm.split(int(comm.rank < k)) for k in range(1, comm.world_size + 1)}


def in_subworlds(comm, check, cases, max_examples: int, world_of=None, explicit=()) -> int:
    """Fixed cases, then hypothesis, inside every rank: for each case, check(sub, case) on the
    sub-world of the first k ranks, k = world_of(case) (default: the case is (k, case), k drawn
    from 1..world_size, and check gets the case alone); the other ranks sit it out. `explicit`:
    cases run first, in order (the process tier's few hard ones); then max_examples drawn from
    `cases` (0: none). The number of cases run, the same everywhere.

    check must combine its verdict over sub before asserting (verdict, check_all), so every
    rank of the sub-world fails together and hypothesis stays in step across ranks."""
    subs, count = {}, [0]
    if world_of is None:
        cases, world_of = st.tuples(st.integers(1, comm.world_size), cases), lambda c: c[0]
        run = lambda sub, drawn: check(sub, drawn[1])  # noqa: E731
    else:
        run = check

    def one(case) -> None:
        count[0] += 1
        k = world_of(case)
        if k not in subs:  # collective, the same on every rank: they see the same cases
            subs[k] = comm.split(int(comm.rank < k))  # made once, when first needed (gloo: slow)
        if comm.rank < k:
            run(subs[k], case)
        comm.barrier()  # the ranks outside wait, so the next case starts together

    for case in explicit:
        one(case)
    if max_examples > 0:
        rank_settings(max_examples)(given(cases)(one))()
    return count[0]


def run_ranks(
    fn, world_size: int, backend: str, *args, timeout: float = 120.0, allow_unreceived=False
) -> list:
    """fn(comm, *args) on every rank of a new world; the per-rank results in rank order.
    allow_unreceived: see run_threads (processes: see run_processes)."""
    if backend == "threads":
        return run_threads(
            fn, world_size, *args, timeout=timeout, allow_unreceived=allow_unreceived
        )
    if backend in PROCESS_BACKENDS or backend == "nccl":
        allow = dict(allow_unreceived=allow_unreceived)
        return run_processes(fn, world_size, backend, *args, timeout=timeout, **allow)
    raise ValueError(f"backend={backend!r} is not 'threads', 'mpi', 'gloo' or 'nccl'")


def run_threads(
    fn,
    world_size: int,
    *args,
    timeout: float = 60.0,
    comm_timeout=None,
    sends="rendezvous",
    allow_unreceived=False,
) -> list:
    """Run fn(comm, *args) in world_size threads; raise with the first failure, a deadlock, a
    hang, or a message no receive took.

    sends: "rendezvous" (default: a send completes when its receive is posted, as MPI_Ssend, so
    an ordering that can deadlock on any MPI deadlocks here, named at once) or "buffered".
    allow_unreceived: True for a program that abandons messages on purpose (a drill that goes
    on after a deadlock, a server that drops a worker mid-request); otherwise they fail it."""
    threads_backend = impl("comm.threads")  # a learner's lab 01 stands in when graded
    comm_timeout = _capped(comm_timeout or max(timeout - 5, timeout / 2))
    if os.environ.get("MINIDIST_TIMEOUT"):  # grading: ranks that loop forever fail in seconds
        timeout = min(timeout, float(os.environ["MINIDIST_TIMEOUT"]) + RUN_PAST_COMM_TIMEOUT)
    world = threads_backend.ThreadsWorld(world_size, comm_timeout, sends)
    # the abort wakes every rank in the comm; one stuck elsewhere never: GRACE s, then given up
    run = run_thread_ranks(fn, world, *args, limit=timeout, after_failure=GRACE)
    errors = run.errors
    running = run.running
    if running and not errors:
        world.abort("the harness timed out")
        raise AssertionError(f"timed out after {timeout:g}s; ranks still running: {running}")
    if errors:
        # report a rank that failed on its own, not one woken by the abort of another, and
        # among those one that raised over one that timed out waiting (often for it)
        own = [r for r, (e, _) in errors.items() if not isinstance(e, PeerFailed)]
        raised = [r for r in own if not isinstance(errors[r][0], CommTimeout)]
        r = min(raised or own or errors)
        e, tb = errors[r]
        if isinstance(e, AssertionError) and len(errors) == world_size:
            raise e  # a combined verdict: every rank failed with the same message
        stuck = f"(ranks {running} still running {GRACE:g}s later)\n" if running else ""
        if isinstance(e, Deadlock):  # the detector's words are the whole story: first
            raise AssertionError(f"{e}\n(rank {r} of {world_size}):\n{tb}{stuck}") from e
        raise AssertionError(f"rank {r} of {world_size} failed:\n{tb}{stuck}") from e
    left = [] if allow_unreceived else world.unreceived()
    if left:
        lines = "\n".join(f"  {line}" for line in left)
        raise AssertionError(f"{len(left)} message(s) sent but never received:\n{lines}")
    return run.results


def run_processes(
    fn, world_size: int, backend: str, *args, timeout: float = 120.0, allow_unreceived=False
) -> list:
    """Run fn(comm, *args) in world_size real processes over mpi or gloo, as one job of a pool
    of ranks started once for this backend, world size and environment (launch/pool.py: why
    a job there equals a fresh start), or, for nccl, a world larger than POOLS.max_world or
    under MINIDIST_POOL=0, in processes started for it alone. A message no receive took fails
    the run (comm/leftovers.py), unless allow_unreceived (MINIDIST_UNRECEIVED=allow: a program
    that abandons messages on purpose)."""
    variables = {"MINIDIST_TIMEOUT": str(_capped(max(timeout - 10, timeout / 2)))}
    variables |= {"MINIDIST_UNRECEIVED": "allow"} if allow_unreceived else {}
    pooled = backend in PROCESS_BACKENDS and world_size <= POOLS.max_world
    if pooled and os.environ.get("MINIDIST_POOL", "1") != "0":
        return POOLS.run(fn, world_size, backend, args, timeout, variables)
    with tempfile.TemporaryDirectory(prefix="minidist-test-") as folder:
        with open(os.path.join(folder, "job.pkl"), "wb") as f:
            pickle.dump((fn, args), f)
        path = os.pathsep.join(
            os.path.abspath(p or ".") for p in sys.path if os.path.isdir(p or ".")
        )
        env = {"PYTHONPATH": path, **variables}
        done = lambda r: os.path.exists(os.path.join(folder, f"rank{r}.pkl"))  # noqa: E731
        argv = ["-m", "minidist.testing", folder]
        outcome = launch(argv, world_size, backend, env=env, timeout=timeout, done_marker=done)
        if outcome.returncode != 0:
            raise AssertionError(f"{backend} x {world_size}: {outcome.report()}")
        results = []
        for r in range(world_size):
            with open(os.path.join(folder, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


# the pools of this process (one per pytest worker); the suite closes them at its end
POOLS = Pools()


def _capped(comm_timeout: float) -> float:
    """The comm timeout a test asks for, at most MINIDIST_TIMEOUT seconds where that is set:
    grading sets it low, so a lab that deadlocks fails in seconds, not in a minute."""
    cap = os.environ.get("MINIDIST_TIMEOUT")
    return min(comm_timeout, float(cap)) if cap else comm_timeout


def _worker(folder: str) -> None:
    """The body of one rank of run_processes: init, run the job, leave the result."""
    from minidist.launch.init import init

    comm = init()
    with open(os.path.join(folder, "job.pkl"), "rb") as f:
        fn, args = pickle.load(f)
    result = fn(comm, *args)
    # every rank finishes its work before any leaves (a leaving rank can close links)
    comm.barrier()
    write_whole(os.path.join(folder, f"rank{comm.rank}.pkl"), pickle.dumps(result))


def impl(name: str):
    """The module under test: `minidist.<name>`, or a learner's lab standing in for it.

    `make lab L=NN` sets MINIDIST_IMPL_<NAME> (dots as underscores, e.g. MINIDIST_IMPL_COLLECTIVES
    or MINIDIST_IMPL_COMM_THREADS) to the lesson's lab.py, so the same tests grade it. Call this
    inside the test (inside the rank function for process tests: the variable travels with the
    environment), never at import time.
    """
    path = os.environ.get("MINIDIST_IMPL_" + name.upper().replace(".", "_"))
    if not path:
        return importlib.import_module(f"minidist.{name}")
    key = f"minidist_lab_{name.replace('.', '_')}"
    with _impl_lock:  # thread-ranks call this at once: none may see a half-loaded module
        if key not in sys.modules:
            spec = importlib.util.spec_from_file_location(key, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module  # before running it: dataclasses look their module up
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[key]
                raise
    return sys.modules[key]


_impl_lock = threading.Lock()


# ---- verdicts and reports ----------------------------------------------------------------


def verdict(comm, ok: bool, message: str = "") -> None:
    """Combine a pass/fail across ranks; if any rank failed, raise on every rank.

    The AssertionError names each failing rank with its message. Costs two collectives.
    """
    flags = torch.empty(comm.world_size, dtype=torch.int64, device=_device(comm))
    comm.all_gather(flags, torch.tensor([int(bool(ok))], device=_device(comm)))
    failing = [r for r, f in enumerate(flags.tolist()) if not f]
    if not failing:
        return
    text = torch.zeros(4096, dtype=torch.uint8)
    raw = message.encode()[:4096]
    text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else text[:0]
    texts = torch.empty(comm.world_size * 4096, dtype=torch.uint8, device=_device(comm))
    comm.all_gather(texts, text.to(_device(comm)))
    rows = texts.view(comm.world_size, 4096).cpu()
    lines = [
        f"rank {r}: " + bytes(rows[r].tolist()).rstrip(b"\0").decode(errors="replace")
        for r in failing
    ]
    raise AssertionError(f"{len(failing)} of {comm.world_size} ranks failed\n" + "\n".join(lines))


def _device(comm) -> torch.device:
    return getattr(comm, "device", torch.device("cpu"))


def compare(name: str, actual: torch.Tensor, expected: torch.Tensor, rtol=0.0, atol=0.0) -> str:
    """'' if close, else a line naming the tensor and its largest difference.

    rtol = atol = 0 asks for exact equality (integer-valued data, same reduction order).
    """
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return (
            f"{name}: got shape {tuple(actual.shape)} {actual.dtype}, "
            f"expected {tuple(expected.shape)} {expected.dtype}"
        )
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.dtype == torch.bool:
        a, e = a.to(torch.int8), e.to(torch.int8)
    if rtol == 0 and atol == 0:
        if torch.equal(a, e):
            return ""
    elif torch.allclose(a.double(), e.double(), rtol=rtol, atol=atol, equal_nan=True):
        return ""
    diff = (a.double() - e.double()).abs()
    worst = diff.nan_to_num(float("inf")).max().item() if diff.numel() else 0.0
    return f"{name}: max |difference| {worst:.3g} (rtol={rtol:g}, atol={atol:g})"


def check_all(comm, pairs: dict, rtol: float = 0.0, atol: float = 0.0, context: str = "") -> None:
    """compare() every (actual, expected) pair by name, then combine the verdict across ranks."""
    problems = [compare(name, a, e, rtol, atol) for name, (a, e) in pairs.items()]
    problems = [p for p in problems if p]
    verdict(comm, not problems, (context + ": " if context else "") + "; ".join(problems))


# ---- shared hypothesis strategies --------------------------------------------------------

ops = st.sampled_from(OPS)
# every dtype the comms carry: the floats training uses, the integers, bool
DTYPES = (
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
)
all_dtypes = st.sampled_from(DTYPES)
float_dtypes = st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16])
seeds = st.integers(0, 2**31 - 1)


def world_sizes(max_size: int = 8) -> st.SearchStrategy[int]:
    return st.integers(1, max_size)


def shapes(max_dims: int = 3, max_side: int = 9) -> st.SearchStrategy[tuple[int, ...]]:
    """Awkward shapes: 0-d, empty, sides of 1, odd sides."""
    return st.lists(st.integers(0, max_side), min_size=0, max_size=max_dims).map(tuple)


def reduce_expected(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of all ranks' tensors: exact in float64 (small integers), then one cast."""
    wide = torch.stack([x.to(torch.float64) for x in xs])  # (p, ...)
    if op in ("sum", "avg"):
        out = wide.sum(0)
    elif wide.numel() == 0:
        out = wide.sum(0)  # amax/amin refuse empty inputs; the result is empty anyway
    else:
        out = wide.amax(0) if op == "max" else wide.amin(0)
    if xs[0].dtype == torch.bool:
        return out.bool()  # sum and max: any rank True; min: every rank True
    out = out.to(xs[0].dtype)  # exact: small integers fit every dtype
    return out / len(xs) if op == "avg" else out  # "avg": one division of the exact sum


def integer_valued(shape, dtype: torch.dtype, seed: int, rank: int = 0, low=-8, high=8):
    """A tensor of small integers in `dtype`: sums of a few are exact in every dtype.

    bool gets True/False, unsigned dtypes non-negative values; different per rank.
    """
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8 or dtype == torch.int8:
        low, high = (0, 8) if dtype == torch.uint8 else (-4, 4)
    return torch.randint(low, high, shape, generator=g).to(dtype)


if __name__ == "__main__":
    _worker(sys.argv[1])
