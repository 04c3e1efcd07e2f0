"""Grading a lab: the lesson's tests against a learner's file, reported task by task.

A task's checks are the tests its row of the lesson README's lab table names (`test_...` in
backticks), plus the hidden tests (tests/hidden/test_labNN*.py, in the instructor's copy only)
whose name starts with `test_NN_k_`. A test is a check of one task at most; a check passes when
every case of that test passes. Points (POLICY, instructor/grading.md): each task is worth the
points labs_table gives it, its checks share them equally, and a task earns its points times
the share of its checks that pass, rounded down to a tenth. Every task is reported, whatever the
others do, with the first failing check's message on one line: the exception's own words (a
deadlock's cycle, a timeout's rank and operation); a check that fails on another region's
`NotImplementedError` says which.

Grading runs derandomized without shrinking (the `grade` profile of tests/conftest.py), with
MINIDIST_TIMEOUT=3 (no comm waits longer: a rank stuck while the others wait fails in seconds;
a deadlock fails at once, named by the threads world's detector) and, for code that loops
outside the ranks, PURE_LIMIT seconds per example. Every module outside the lab is the
reference (other labs' MINIDIST_IMPL_* are cleared). It refuses a file changed outside its lab
regions, or whose regions import the reference module. The last grade of each lesson's own lab
(not of a --file) is kept in out/grades/NN.json, which `status` reads.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import os
import re
import signal
import sys
import time

import labs_cut
from labs_table import LABS

TIMEOUT = "3"  # seconds a graded comm may wait: a correct lab waits milliseconds
PURE_LIMIT = 12.0  # seconds an example may run outside the ranks (the longest takes about 3)
TEST = re.compile(r"`(test_\w+)`")
ROW = re.compile(r"^\|\s*(?:Lab )?(\d\d\.\d+)\b")
GRADES = os.path.join(labs_cut.ROOT, "out", "grades")  # the last grade of each lab, for `status`
POLICY = (
    "a task's checks share its points: it earns points x checks passed / checks, rounded down "
    "to a tenth, all of them only when every check passes; after a check that hangs (times "
    "out) the task's later checks are not run and earn nothing"
)


def tasks(lesson: str) -> dict[str, list[str]]:
    """{task id: the test functions that check it}, from the README's lab table and hidden tests."""
    readme = os.path.join(labs_cut.ROOT, LABS[lesson]["folder"], "README.md")
    found: dict[str, list[str]] = {}
    for line in open(readme).read().splitlines():
        row = ROW.match(line)
        if row and row[1].startswith(lesson + "."):
            found[row[1]] = TEST.findall(line.rsplit("|", 2)[1])
    for path in hidden(lesson):
        for name in re.findall(r"^def (test_\w+)", open(path).read(), re.M):
            rid = re.match(r"test_(\d\d)_(\d+)_", name)
            if rid and f"{rid[1]}.{rid[2]}" in found:
                found[f"{rid[1]}.{rid[2]}"].append(name)
    return found


def points(lesson: str) -> dict[str, float]:
    """{task id: what it is worth}, from labs_table (10 a lab)."""
    return LABS[lesson]["points"]


def earned(worth: float, passed: int, checks: int) -> float:
    """POLICY: worth x passed / checks, rounded down to a tenth; all of it only if all pass."""
    if checks and passed == checks:
        return worth
    return math.floor(10 * worth * passed / checks + 1e-9) / 10 if checks else 0.0


def hidden(lesson: str) -> list[str]:
    """The instructor's hidden test files for the lab (none in a student's copy)."""
    return sorted(
        glob.glob(os.path.join(labs_cut.ROOT, "tests", "hidden", f"test_lab{lesson}*.py"))
    )


class Outcomes:
    """A pytest plugin: per test function, whether every case passed, and the first failure.
    only: the test functions to run (None: all). task_of: each check's task; once a check
    hangs (fails on a timeout), its task's later checks are skipped: each could hang as long,
    and a whole lab that hangs must still grade in a minute (POLICY)."""

    def __init__(self, only: set[str] | None = None, task_of: dict[str, str] | None = None):
        self.passed: dict[str, bool] = {}
        self.failure: dict[str, str] = {}
        self.ran = 0
        self.only = only
        self.task_of = task_of or {}
        self.hung: dict[str, str] = {}  # task -> its check that hung

    def pytest_collection_modifyitems(self, config, items) -> None:
        if self.only is None:
            return
        keep = [item for item in items if item.name.split("[")[0] in self.only]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep

    def pytest_runtest_setup(self, item) -> None:
        import pytest

        name = item.name.split("[")[0]
        if self.passed.get(name) is False:  # one failing case fails it
            pytest.skip("this check has already failed: its other cases need not run")
        task = self.task_of.get(name)
        if task in self.hung and self.hung[task] != name:
            pytest.skip(f"{self.hung[task]} hung: the later checks of {task} are not run")

    def pytest_runtest_logreport(self, report) -> None:
        name = report.nodeid.split("::")[-1].split("[")[0]
        self.ran += report.when == "call"
        if report.when == "call" or report.failed:
            self.passed[name] = self.passed.get(name, True) and not report.failed
        if report.failed and name not in self.failure:
            self.failure[name] = report.longreprtext
            crash = getattr(report.longrepr, "reprcrash", None)
            self.failure[name + ":crash"] = crash.message if crash else ""
            said = self.failure[name + ":crash"] or self.failure[name]
            if name in self.task_of and TIMED_OUT.search(said.split("Failing test case")[0]):
                self.hung.setdefault(self.task_of[name], name)


class Hang(Exception):
    """An example that ran past PURE_LIMIT outside the ranks (a loop that never ends)."""


class Limit:
    """A pytest plugin: each example (each hypothesis example, or the whole test) fails with
    Hang after PURE_LIMIT seconds, unless it is inside the multi-rank harness, whose own
    timeouts (the comm's, MINIDIST_TIMEOUT, and the run's) end it. SIGALRM: main thread only."""

    def _expired(self, signum, frame) -> None:
        while frame is not None:
            code = frame.f_code
            if code.co_name in ("run_threads", "run_processes") and code.co_filename.endswith(
                os.path.join("minidist", "testing.py")
            ):
                signal.setitimer(signal.ITIMER_REAL, PURE_LIMIT)  # the harness times it
                return
            frame = frame.f_back
        raise Hang(
            f"still running after {PURE_LIMIT:g}s outside the ranks: a loop that never ends?"
        )

    def _arm(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, PURE_LIMIT)

    def pytest_runtest_call(self, item):
        given = getattr(item.obj, "hypothesis", None)
        inner = given.inner_test if given is not None else None
        if inner is not None:
            failed: dict[str, Exception] = {}

            def each_example(*args, **kwargs):
                key = repr((args, sorted(kwargs.items())))
                if key in failed:  # hypothesis runs a failing example again to report it: the
                    raise failed[key]  # same failure, without a hang's seconds a second time
                self._arm()  # a fresh limit for every example
                try:
                    return inner(*args, **kwargs)
                except Exception as e:
                    if not type(e).__module__.startswith("hypothesis"):
                        failed[key] = e
                    raise

            given.inner_test = each_example
        before = signal.signal(signal.SIGALRM, self._expired)
        self._arm()
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
            if inner is not None:
                given.inner_test = inner

    pytest_runtest_call.hookwrapper = True  # type: ignore[attr-defined]


TIMED_OUT = re.compile(r"timed out after \d|still running after \d")  # a comm's, a run's, Hang
# what run_threads and verdict say, and which of it takes two lines to say
HARNESS_SAYS = r"deadlock|timed out|rank \d+ \w+ while|\d+ of \d+ ranks|\d+ message\(s\) sent"
TWO_LINES = r"deadlock|\d+ of \d+ ranks failed$|\d+ message\(s\) sent but never received"
HARNESS = re.compile(r"^(?:AssertionError: )?rank (\d+) of (\d+) failed:$")


def _final_exception(lines: list[str]) -> list[str]:
    """The last exception of a traceback's lines: its `Type: message` line and the lines of
    its message (the frames are indented, the exception starts at the margin)."""
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    rest = lines[frames[-1] + 1 :] if frames else lines
    while rest and rest[0].startswith("    "):  # the frame's code and its ^^^^ marks
        rest = rest[1:]
    return [line for line in rest if line.strip()]


def one_line(text: str, crash: str, task: str, limit: int = 220) -> str:
    """A failure's text as one line: the unfilled region it hit, else the exception's own
    message: a rank's exception (named `rank r of p: ...`), a deadlock's first two lines (what
    happened, the wait-for cycle), a timeout's rank and operation, an assertion's words."""
    # the stub's own exception, not any "Lab NN.k: " (a test's docstring in the traceback)
    hit = re.search(r"NotImplementedError(?:: |\(\s*[\"'])Lab (\d\d\.\d+): ", text)
    if hit:
        return f"unfilled Lab {hit[1]}" + (f" (blocks {task})" if task not in ("", hit[1]) else "")
    lines = [re.sub(r"^E   ?", "", line).rstrip() for line in (crash or text).splitlines()]
    for end, line in enumerate(lines):  # hypothesis's report of the case comes after
        if line.startswith(("Failing test case:", "Falsifying example")):
            lines = lines[:end]
            break
    lines = [line for line in lines if line.strip()]
    if not lines:
        return "failed"
    rank = HARNESS.match(lines[0].strip())
    if rank and len(lines) > 1:
        own = _final_exception(lines[1:])
        head = re.sub(r"^[\w.]*\.(?=\w+(?:Error|Timeout|Deadlock|PeerFailed)\b)", "", own[0])
        says = head.split(": ", 1)[-1] if ": " in head else ""
        named = says.startswith(f"rank {rank[1]} of {rank[2]}") or says.startswith("deadlock")
        kept = [head if named else f"rank {rank[1]} of {rank[2]}: {head}"]
        if "Deadlock" in head and len(own) > 1:
            kept.append(own[1].strip())  # the wait-for cycle
        line = " / ".join(kept)
    else:
        first = lines[0].strip()
        if re.match(rf"AssertionError: ({HARNESS_SAYS})", first):
            first = first.removeprefix("AssertionError: ")  # the harness's own words
        kept = [first]
        if re.match(TWO_LINES, first) and len(lines) > 1:
            kept.append(lines[1].strip())  # the cycle; the first failing rank; the first message
        line = " / ".join(kept)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def clear_other_labs(lesson: str) -> None:
    """Every module outside the lab is the reference: drop other labs' MINIDIST_IMPL_*."""
    mine = {labs_cut.env_var(lesson, k) for k in range(len(labs_cut.parts(lesson)))}
    for key in [k for k in os.environ if k.startswith("MINIDIST_IMPL_") and k not in mine]:
        del os.environ[key]


def run_tests(
    lesson: str, paths: list[str], extra: list[str], verbose: bool, only: set[str] | None = None
) -> Outcomes:
    """The lesson's tests (and its hidden ones) in this process, against the files at `paths`
    (one per part of the lab: lab.py, then lab_train.py, ...); only: these test functions."""
    import pytest

    clear_other_labs(lesson)
    for part, path in enumerate(paths):
        os.environ[labs_cut.env_var(lesson, part)] = path
    os.environ.update({"MINIDIST_HYPOTHESIS": "grade", "MINIDIST_TIMEOUT": TIMEOUT})
    task_of = {test: task for task, tests in tasks(lesson).items() for test in tests}
    outcomes = Outcomes(only, task_of)
    quiet = ["--tb=short", "-q"] if verbose else ["-p", "no:terminal"]
    args = [*LABS[lesson]["grade"], *hidden(lesson), *quiet, "-p", "no:cacheprovider"]
    old = os.getcwd()
    os.chdir(labs_cut.ROOT)
    try:
        pytest.main([*args, "-o", "addopts=", *extra], [outcomes, Limit()])
    finally:
        os.chdir(old)
    return outcomes


def score(lesson: str, outcomes: Outcomes, only: set[str] | None = None) -> dict:
    """The grade: per task its checks, points earned, verdict and first failure's message.
    only: grade these tasks alone (the others are left out)."""
    rows, named = [], set()
    worth = points(lesson)
    for task, tests in tasks(lesson).items():
        named |= set(tests)
        if only is not None and task not in only:
            continue
        checks = []
        hung = outcomes.hung.get(task)
        for test in tests:
            passed = outcomes.passed.get(test)
            message = "not run" if passed is None else ""
            if passed is None and hung and test != hung:
                message = f"not run: {hung} hung first"
            if passed is False:
                message = one_line(outcomes.failure[test], outcomes.failure[test + ":crash"], task)
            checks.append({"test": test, "passed": bool(passed), "message": message})
        n_passed = sum(c["passed"] for c in checks)
        failing = [c for c in checks if not c["passed"]]
        failing.sort(key=lambda c: "(blocks" in c["message"])  # its own failures first
        first = f"{failing[0]['test']}: {failing[0]['message']}" if failing else ""
        rows.append(
            {
                "task": task,
                "points": worth[task],
                "earned": earned(worth[task], n_passed, len(checks)),
            }
            | {"passed": n_passed == len(checks), "checks_passed": n_passed}
            | {"message": first, "checks": checks}
        )
    others = [t for t, ok in outcomes.passed.items() if not ok and t not in named]
    other = [
        f"{t}: {one_line(outcomes.failure[t], outcomes.failure[t + ':crash'], '')}" for t in others
    ]
    return {
        "lesson": lesson,
        "policy": POLICY,
        "tasks": rows,
        "earned": round(sum(r["earned"] for r in rows), 1),
        "points": round(sum(r["points"] for r in rows), 1),
        "other_failures": other,
        "tests_run": outcomes.ran,
    }


def _pts(x: float) -> str:
    return f"{x:g}" if x == int(x) else f"{x:.1f}"


def table(result: dict) -> str:
    """The grade as the text table `make lab` prints."""
    lines = [f"{'task':<6} {'points':>9} {'checks':>7}  {'result':<7} first failing check"]
    lines.append("-" * 78)
    for row in result["tasks"]:
        verdict = "passed" if row["passed"] else "failed"
        got = f"{_pts(row['earned']):>4} / {_pts(row['points']):<2}"
        checks = f"{row['checks_passed']}/{len(row['checks'])}"
        lines.append(
            f"{row['task']:<6} {got:>9} {checks:>7}  {verdict:<7} {row['message']}".rstrip()
        )
    lines.append("-" * 78)
    got = f"{_pts(result['earned']):>4} / {_pts(result['points']):<2}"
    ran = f"{result['tests_run']} test cases run in {result['seconds']:.0f}s"
    lines.append(f"{'total':<6} {got:>9}          ({ran})")
    lines.append(f"points: {result['policy']}")
    lines += [f"also failing (no points): {other}" for other in result["other_failures"]]
    return "\n".join(lines)


def refusal(lesson: str, path: str, part: int = 0) -> str:
    """'' if the file may be graded, else why not: changed outside its regions, or borrowing."""
    try:
        diff = labs_cut.changed_outside(lesson, path, part)
    except labs_cut.LabError as e:
        return f"its lab markers are broken ({e}): put them back as generated"
    if diff:
        return f"it was changed outside its lab regions; only the regions may change:\n{diff}"
    _, inside = labs_cut.bodies(open(path).read(), lesson, path)
    module = "minidist." + labs_cut.parts(lesson)[part]["impl"]
    for rid, body in sorted(inside.items()):
        if re.search(rf"\b{re.escape(module)}\b|import_module|__import__", body):
            return f"region {rid} uses the reference {module}: write the code yourself"
    return ""


def grade(lesson: str, files: list[str] | None, extra: list[str], options: dict) -> int:
    """Grade the lab's files (default: the lesson's lab.py, lab_train.py, ...); print the
    table; 0 when every task passes, 1 when some fail, 3 when a file is refused. options:
    json (a path, '-': the JSON alone on stdout, the rest on stderr), junit, verbose, tasks
    (grade only these task ids), all (run the tests no task names too: their failures are
    listed, worth no points; by default only the checks run)."""
    n = len(labs_cut.parts(lesson))
    if files is not None and len(files) != n:
        print(f"lab {lesson}: --file takes {n} files, one per part, got {len(files)}")
        return 2
    only = set(options["tasks"]) if options.get("tasks") else None
    if only is not None and only - set(tasks(lesson)):
        print(
            f"lab {lesson} has no task {sorted(only - set(tasks(lesson)))}: {sorted(tasks(lesson))}"
        )
        return 2
    paths = [os.path.abspath(f) for f in files or [labs_cut.lab_path(lesson, k) for k in range(n)]]
    path = paths[0]
    shown = ", ".join(_shown(p) for p in paths)
    result = {"lesson": lesson, "file": shown, "sha256": _digest(path)}
    result["sha256s"] = [_digest(p) for p in paths]  # one per part
    result["refused"] = "; ".join(
        f"{_shown(p)}: {why}" if n > 1 else why
        for k, p in enumerate(paths)
        if (why := refusal(lesson, p, k))
    )
    if result["refused"]:
        print(f"lab {lesson}: {shown} is refused: {result['refused']}", file=sys.stderr)
        _report(result, options)
        return 3
    # with --json -, stdout carries the JSON alone: the table and pytest's words go to stderr
    out = sys.stderr if options.get("json") == "-" else sys.stdout
    with contextlib.redirect_stdout(out):
        print(f"lab {lesson}: grading {shown} (pytest {' '.join(LABS[lesson]['grade'])})")
        start = time.monotonic()
        if options.get("junit"):
            extra = [*extra, f"--junitxml={os.path.abspath(options['junit'])}"]
        graded = only or set(tasks(lesson))
        selected = {t for k in graded for t in tasks(lesson)[k]}  # the checks, unless --all
        selected = None if options.get("all") else selected
        outcomes = run_tests(lesson, paths, extra, options.get("verbose", False), selected)
        result |= score(lesson, outcomes, only) | {"seconds": round(time.monotonic() - start, 1)}
        result["other_labs"] = other_labs(lesson)
        result["date"] = time.strftime("%Y-%m-%d %H:%M")
        print(table(result))
        if result["other_labs"] and labs_cut.handout() is not None:
            print(
                f"these tests also load your labs {', '.join(result['other_labs'])}: a failure "
                "may be theirs (the instructor grades each lab against the reference of the rest)"
            )
    _report(result, options)
    if path == os.path.abspath(labs_cut.lab_path(lesson)) and only is None:  # the learner's own lab
        os.makedirs(GRADES, exist_ok=True)
        with open(os.path.join(GRADES, f"{lesson}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["tasks"] and all(r["passed"] for r in result["tasks"]) else 1


def other_labs(lesson: str) -> list[str]:
    """The other labs whose modules (minidist/...) the tests loaded: the reference in the
    instructor's copy; in a student's copy, the student's own code."""
    loaded = {
        os.path.abspath(m.__file__)
        for m in list(sys.modules.values())
        if getattr(m, "__file__", None)
    }
    return sorted(
        other
        for other in LABS
        if other != lesson
        if any(
            os.path.join(labs_cut.ROOT, lab["module"]) in loaded for lab in labs_cut.parts(other)
        )
    )


def _report(result: dict, options: dict) -> None:
    """Write the result as JSON where --json asked (a path, or '-' for stdout)."""
    target = options.get("json")
    if target == "-":
        print(json.dumps(result, indent=1))
    elif target:
        with open(target, "w") as f:
            json.dump(result, f, indent=1)


def _shown(path: str) -> str:
    return os.path.relpath(path, labs_cut.ROOT) if path.startswith(labs_cut.ROOT + os.sep) else path


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def status() -> str:
    """One line per lab: its file, regions still unfilled, changed outside, last grade."""
    lines = [f"{'lab':<4} {'file':<40} {'unfilled':<16} last grade"]
    for lesson, part in [(x, k) for x in LABS for k in range(len(labs_cut.parts(x)))]:
        path = labs_cut.lab_path(lesson, part)
        shown = os.path.relpath(path, labs_cut.ROOT)
        if not os.path.exists(path):
            lines.append(f"{lesson:<4} {shown:<40} missing")
            continue
        try:
            left = labs_cut.unfilled_regions(open(path).read(), lesson)
            left_text = ", ".join(left) or "none"
        except labs_cut.LabError:
            left_text = "markers broken"
        last = os.path.join(GRADES, f"{lesson}.json")
        graded = "never"
        if os.path.exists(last):
            g = json.load(open(last))
            got = f"{_pts(g['earned'])}/{_pts(g['points'])} {g['date']}"
            graded = "refused" if g.get("refused") else got
            if g.get("sha256s", [g.get("sha256")] * (part + 1))[part] != _digest(path):
                graded += " (file changed since)"
        lines.append(f"{lesson:<4} {shown:<40} {left_text:<16} {graded}")
    return "\n".join(lines)
