"""Running checks: the adapter's code inside every rank, on the strict threads world or on real
gloo and MPI processes; one Result per check and backend.

threads    one world per case, of case["p"] thread-ranks, sends="rendezvous" (a send completes
           when its receive is posted, as MPI_Ssend): an ordering that can deadlock on any MPI
           deadlocks here, named at once with its wait-for cycle; a message no receive took
           fails the case. The adapter must ask for COMM = "minidist".
gloo, mpi  one job of PROCESS_WORLD processes per capability (launch/launcher.py), started
           once; every case runs on the sub-world of its first p ranks (comm.split), each
           check's outputs written when it ends. A rank that raises, or hangs, stops the job:
           the check it was in fails with that rank's traceback, and a new job goes on with the
           checks after it.
A check stops at its first failing case; a call that raises NotImplementedError skips it.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass, field

from minidist.comm.protocol import Deadlock, PeerFailed
from minidist.comm.threads import ThreadsWorld
from minidist.conform.adapter import SERVES, Rank, comm_kind, load, missing
from minidist.conform.checks import Check, Problem, Unavailable, draw
from minidist.launch.launcher import launch
from minidist.launch.processes import write_whole
from minidist.launch.thread_ranks import run_thread_ranks

PROCESS_WORLD = 4  # processes per job: world sizes 1..4 by splitting
COMM_TIMEOUT = 10.0  # s: a correct case's every wait takes milliseconds
CASE_LIMIT = 60.0  # s a threads case may take in all, before its ranks are called hung
GRACE = 1.0  # s the other thread-ranks get to stop once one has failed


@dataclass
class Result:
    """How one check went on one backend."""

    capability: str
    check: str
    backend: str
    status: str  # "passed", "failed" or "skipped"
    examples: int = 0  # cases run
    seconds: float = 0.0
    world_size: int | None = None  # of the failing case
    example: dict | None = None  # the failing case, without "p"
    problem: str = ""  # failed: the first problem; skipped: why
    max_difference: float | None = None
    detail: str = ""  # every problem of the failing case, or the traceback
    about: str = ""

    @property
    def full_name(self) -> str:
        return f"{self.capability}.{self.check}"


@dataclass
class Verdict:
    """One case's verdict: ok, a skip (reason), or problems (and a traceback)."""

    problems: list[Problem] = field(default_factory=list)
    skipped: str = ""
    detail: str = ""


def result(check: Check, backend: str, status: str, **kw) -> Result:
    return Result(check.capability, check.name, backend, status, about=check.about, **kw)


def cannot(adapter, check: Check, backend: str) -> str:
    """'' if check can run for adapter on backend, else why it is skipped."""
    why = missing(adapter, check)
    if not why and comm_kind(adapter) not in SERVES[backend]:
        served = [b for b, kinds in SERVES.items() if comm_kind(adapter) in kinds]
        why = f"{backend} cannot give COMM = {comm_kind(adapter)!r} (--backend {served[0]})"
    return why


def judged(check: Check, case: dict, outputs: list) -> Verdict:
    """check.judge, with a judge that trips over malformed outputs turned into a problem."""
    try:
        return Verdict(check.judge(case, outputs))
    except Exception as e:  # an output of the wrong kind: the adapter's, not the kit's
        return Verdict([Problem(f"the outputs could not be judged: {type(e).__name__}: {e}")])


def close(check: Check, backend: str, cases: list, verdicts: list[Verdict], start: float):
    """The Result of a check from its cases' verdicts, in order (stopping at the first that is
    not a pass)."""
    for n, (case, v) in enumerate(zip(cases, verdicts, strict=False), start=1):
        seconds = time.monotonic() - start
        if v.skipped:
            return result(check, backend, "skipped", examples=n, seconds=seconds, problem=v.skipped)
        if v.problems:
            first = v.problems[0]
            return result(
                check,
                backend,
                "failed",
                examples=n,
                seconds=seconds,
                world_size=case["p"],
                example={k: x for k, x in case.items() if k != "p"},
                problem=first.text,
                max_difference=first.max_difference,
                detail="\n".join(p.text for p in v.problems)
                + ("\n" + v.detail if v.detail else ""),
            )
    return result(check, backend, "passed", examples=len(cases), seconds=time.monotonic() - start)


# ---- threads ---------------------------------------------------------------------------------


def _rank(comm, adapter, check: Check, case: dict):
    return check.run(Rank(adapter, comm), case)


def run_case_threads(adapter, check: Check, case: dict) -> Verdict:
    """One case on a strict threads world of case["p"] ranks."""
    world = ThreadsWorld(case["p"], COMM_TIMEOUT, "rendezvous")
    run = run_thread_ranks(
        _rank, world, adapter, check, case, limit=CASE_LIMIT, after_failure=GRACE
    )
    if run.errors:
        own = {r: e for r, e in run.errors.items() if not isinstance(e[0], PeerFailed)}
        r = min(own) if own else min(run.errors)
        error, tb = run.errors[r]
        if isinstance(error, NotImplementedError | Unavailable):
            return Verdict(skipped=f"{type(error).__name__}: {error}")
        words = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if isinstance(error, Deadlock):  # every rank's at once: which raised first is timing
            return Verdict([Problem(f"Deadlock: {words}")], detail=tb)
        return Verdict([Problem(f"rank {r} raised {type(error).__name__}: {words}")], detail=tb)
    if run.running:
        world.abort("the conformance kit gave up on this case")
        text = f"hung: ranks {run.running} still running after {CASE_LIMIT:g}s"
        return Verdict([Problem(text)], detail=run.stack(run.running[0]))
    left = world.unreceived()
    if left:
        text = f"{len(left)} message(s) sent but never received, e.g. {left[0]}"
        return Verdict([Problem(text)], detail="\n".join(left))
    return judged(check, case, run.results)


def run_threads(adapter, check: Check, examples: int) -> Result:
    start = time.monotonic()
    why = cannot(adapter, check, "threads")
    if why:
        return result(check, "threads", "skipped", problem=why)
    cases = draw(check, 8, examples)
    verdicts = []
    for case in cases:
        verdicts.append(run_case_threads(adapter, check, case))
        if verdicts[-1].skipped or verdicts[-1].problems:
            break
    return close(check, "threads", cases, verdicts, start)


# ---- processes -------------------------------------------------------------------------------


def run_processes(spec: str, adapter, checks: list[Check], backend: str, examples: int):
    """Every check of `checks` over backend's processes; a Result each, in order."""
    results: dict[str, Result] = {}
    todo = []
    for check in checks:
        why = cannot(adapter, check, backend)
        if why:
            results[check.full_name] = result(check, backend, "skipped", problem=why)
        else:
            todo.append((check, draw(check, PROCESS_WORLD, examples // 5)))
    while todo:
        start = time.monotonic()
        done, failure = _job(spec, todo, backend)
        seconds = (time.monotonic() - start) / len(todo)  # one job for them all: a share each
        for (check, cases), per_rank in zip(todo, done, strict=False):
            records = [[outs[i] for outs in per_rank] for i in range(len(cases))]  # case, rank
            verdicts = [
                _verdict(check, case, got) for case, got in zip(cases, records, strict=True)
            ]
            results[check.full_name] = close(check, backend, cases, verdicts, time.monotonic())
            results[check.full_name].seconds = seconds
        if failure is None:
            break
        # the check it stopped in (or, where every check had ended, the last: the job failed
        # on its way out, e.g. a message no receive took)
        check, cases = todo[min(len(done), len(todo) - 1)]
        words = failure.strip().splitlines()
        text = f"the {backend} job failed: {words[-1] if words else 'no traceback'}"
        results[check.full_name] = result(
            check, backend, "failed", seconds=seconds, problem=text, detail=failure
        )
        todo = todo[len(done) + 1 :]
    return [results[c.full_name] for c in checks]


def _verdict(check: Check, case: dict, outputs: list) -> Verdict:
    """A case's verdict from every rank's record: ("ok", outputs) or ("skip", why)."""
    outputs = outputs[: case["p"]]  # the ranks of its sub-world
    skips = [why for kind, why in outputs if kind == "skip"]
    if skips:
        return Verdict(skipped=skips[0])
    return judged(check, case, [out for _, out in outputs])


def _job(spec: str, todo: list, backend: str) -> tuple[list, str | None]:
    """Run todo's checks in one job; (per check done: per rank, its records; the failure
    report, or None)."""
    world = max(case["p"] for _, cases in todo for case in cases)
    with tempfile.TemporaryDirectory(prefix="minidist-conform-") as folder:
        with open(os.path.join(folder, "job.pkl"), "wb") as f:
            pickle.dump((spec, [(c.full_name, cases) for c, cases in todo]), f)
        path = os.pathsep.join(
            os.path.abspath(p or ".") for p in sys.path if os.path.isdir(p or ".")
        )
        env = {"PYTHONPATH": path, "MINIDIST_TIMEOUT": str(COMM_TIMEOUT)}
        argv = ["-m", "minidist.conform.runner", folder]
        outcome = launch(argv, world, backend, env=env, timeout=CASE_LIMIT * len(todo) + 60)
        done = []
        for i in range(len(todo)):
            names = [os.path.join(folder, f"check{i}.rank{r}.pkl") for r in range(world)]
            if not all(os.path.exists(n) for n in names):
                break
            done.append([_read(n) for n in names])
        failure = None if outcome.returncode == 0 else outcome.report()
        if failure is None and len(done) < len(todo):
            failure = "the job ended before every check had run"
        return done, failure


def _read(name: str):
    with open(name, "rb") as f:
        return pickle.load(f)


def rank_job(folder: str) -> None:
    """The body of one rank of a process job: every check's cases on sub-worlds, each check's
    records written as it ends (check{i}.rank{r}.pkl)."""
    # a rank's first torch optimizer imports torch._dynamo (seconds; 20 on a loaded CPU): every
    # rank pays for it here, at once, not inside a case of p=1 while the others wait at a barrier
    import torch._dynamo  # noqa: F401

    import minidist
    from minidist.conform.registry import checks_by_name

    comm = minidist.init()
    with open(os.path.join(folder, "job.pkl"), "rb") as f:
        spec, work = pickle.load(f)
    adapter = load(spec)
    by_name = checks_by_name()
    subs = {}
    for i, (name, cases) in enumerate(work):
        check = by_name[name]
        records = []
        for case in cases:
            k = case["p"]
            if k not in subs:  # collective: every rank sees the same cases
                subs[k] = comm.split(int(comm.rank < k))
            records.append(_case_in_rank(subs[k], adapter, check, case) if comm.rank < k else None)
            comm.barrier()  # the ranks outside wait, so the next case starts together
        name = os.path.join(folder, f"check{i}.rank{comm.rank}.pkl")
        write_whole(name, pickle.dumps(records))
    comm.barrier()  # every rank finishes its work before any leaves


def _case_in_rank(comm, adapter, check: Check, case: dict) -> tuple:
    try:
        return ("ok", check.run(Rank(adapter, comm), case))
    except (NotImplementedError, Unavailable) as e:
        return ("skip", f"{type(e).__name__}: {e}")
    except Exception as e:  # the job stops: the parent names this check, this rank, this case
        example = {k: v for k, v in case.items() if k != "p"}
        where = f"{check.full_name} p={case['p']} {example}"
        raise RuntimeError(f"rank {comm.rank}: {where}: {type(e).__name__}: {e}") from e


def conform(spec: str, checks: list[Check], backends: list[str], examples: int) -> list[Result]:
    """Every check on every backend, for the adapter `spec`; a Result each."""
    return conform_adapter(load(spec), checks, backends, examples, spec)


def conform_adapter(adapter, checks, backends, examples: int, spec: str | None = None) -> list:
    """conform() for an adapter object; over processes every rank loads it again from `spec`."""
    results = []
    for backend in backends:
        if backend == "threads":
            results += [run_threads(adapter, check, examples) for check in checks]
            continue
        if spec is None:
            raise ValueError(f"{backend}: every process loads the adapter: give its file or module")
        by_capability: dict[str, list[Check]] = {}
        for check in checks:
            by_capability.setdefault(check.capability, []).append(check)
        for group in by_capability.values():
            results += run_processes(spec, adapter, group, backend, examples)
    return results


if __name__ == "__main__":
    rank_job(sys.argv[1])
