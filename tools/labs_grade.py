"""Grading a lab: the lesson's tests against a learner's file, reported task by task.

A task's checks are the tests its row of the lesson README's lab table names (`test_...` in
backticks), plus the hidden tests (tests/hidden/test_labNN*.py, in the instructor's copy only)
whose name starts with `test_NN_k_`. Each check is one point; a check passes when every case of
that test passes. Every task is reported, whatever the others do, with the first failing check's
message on one line; a check that fails on another region's `NotImplementedError` says which.
Grading runs derandomized without shrinking (the `grade` profile of tests/conftest.py) and with
MINIDIST_TIMEOUT=10, so a lab that deadlocks fails in seconds, and it refuses a file changed
outside its lab regions, or whose regions import the reference module. The last grade of each
lesson's own lab (not of a --file) is kept in out/grades/NN.json, which `status` reads.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
import tempfile
import time

import labs

TIMEOUT = "10"  # seconds a graded comm may wait: a correct lab waits milliseconds
TEST = re.compile(r"`(test_\w+)`")
ROW = re.compile(r"^\|\s*(?:Lab )?(\d\d\.\d+)\b")
GRADES = os.path.join(labs.ROOT, "out", "grades")  # the last grade of each lab, for `status`


def tasks(lesson: str) -> dict[str, list[str]]:
    """{task id: the test functions that check it}, from the README's lab table and hidden tests."""
    readme = os.path.join(labs.ROOT, labs.LABS[lesson]["folder"], "README.md")
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


def hidden(lesson: str) -> list[str]:
    """The instructor's hidden test files for the lab (none in a student's copy)."""
    return sorted(glob.glob(os.path.join(labs.ROOT, "tests", "hidden", f"test_lab{lesson}*.py")))


class Outcomes:
    """A pytest plugin: per test function, whether every case passed, and the first failure."""

    def __init__(self):
        self.passed: dict[str, bool] = {}
        self.failure: dict[str, str] = {}
        self.ran = 0

    def pytest_runtest_logreport(self, report) -> None:
        name = report.nodeid.split("::")[-1].split("[")[0]
        self.ran += report.when == "call"
        if report.when == "call" or report.failed:
            self.passed[name] = self.passed.get(name, True) and not report.failed
        if report.failed and name not in self.failure:
            self.failure[name] = report.longreprtext
            crash = getattr(report.longrepr, "reprcrash", None)
            self.failure[name + ":crash"] = crash.message if crash else ""


def one_line(text: str, crash: str, task: str) -> str:
    """A failure's text as one line: the unfilled region it hit, else the exception itself."""
    hit = re.search(r"Lab (\d\d\.\d+): ", text)
    if hit:
        return f"unfilled Lab {hit[1]}" + (f" (blocks {task})" if task not in ("", hit[1]) else "")
    lines = [line.strip() for line in (crash or text).splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in lines):
        lines = [lines[0], lines[-1]]  # "rank 2 of 4 failed:", then the rank's exception
    line = " / ".join(lines[:2]) if lines else "failed"
    return line if len(line) <= 110 else line[:107] + "..."


def run_tests(lesson: str, paths: list[str], extra: list[str], verbose: bool) -> Outcomes:
    """The lesson's tests (and its hidden ones) in this process, against the files at `paths`
    (one per part of the lab: lab.py, then lab_train.py, ...)."""
    import pytest

    for part, path in enumerate(paths):
        os.environ[labs.env_var(lesson, part)] = path
    os.environ.update({"MINIDIST_HYPOTHESIS": "grade", "MINIDIST_TIMEOUT": TIMEOUT})
    outcomes = Outcomes()
    quiet = ["--tb=short", "-q"] if verbose else ["-p", "no:terminal"]
    args = [*labs.LABS[lesson]["grade"], *hidden(lesson), *quiet, "-p", "no:cacheprovider"]
    old = os.getcwd()
    os.chdir(labs.ROOT)
    try:
        pytest.main([*args, "-o", "addopts=", *extra], [outcomes])
    finally:
        os.chdir(old)
    return outcomes


def score(lesson: str, outcomes: Outcomes) -> dict:
    """The grade: per task its checks, points earned, verdict and first failure's message."""
    rows, named = [], set()
    for task, tests in tasks(lesson).items():
        checks = []
        for test in tests:
            named.add(test)
            passed = outcomes.passed.get(test)
            message = "" if passed else "not run" if passed is None else ""
            if passed is False:
                message = one_line(outcomes.failure[test], outcomes.failure[test + ":crash"], task)
            checks.append({"test": test, "passed": bool(passed), "message": message})
        earned = sum(c["passed"] for c in checks)
        failing = [c for c in checks if not c["passed"]]
        failing.sort(key=lambda c: "(blocks" in c["message"])  # its own failures first
        first = f"{failing[0]['test']}: {failing[0]['message']}" if failing else ""
        rows.append(
            {"task": task, "points": len(checks), "earned": earned, "passed": earned == len(checks)}
            | {"message": first, "checks": checks}
        )
    others = [t for t, ok in outcomes.passed.items() if not ok and t not in named]
    other = [
        f"{t}: {one_line(outcomes.failure[t], outcomes.failure[t + ':crash'], '')}" for t in others
    ]
    return {
        "lesson": lesson,
        "tasks": rows,
        "earned": sum(r["earned"] for r in rows),
        "points": sum(r["points"] for r in rows),
        "other_failures": other,
        "tests_run": outcomes.ran,
    }


def table(result: dict) -> str:
    """The grade as the text table `make lab` prints."""
    lines = [f"{'task':<6} {'points':>7}  {'result':<7} first failing check", "-" * 78]
    for row in result["tasks"]:
        verdict = "passed" if row["passed"] else "failed"
        points = f"{row['earned']:>2} / {row['points']:<2}"
        lines.append(f"{row['task']:<6} {points:>7}  {verdict:<7} {row['message']}".rstrip())
    lines.append("-" * 78)
    points = f"{result['earned']:>2} / {result['points']:<2}"
    ran = f"{result['tests_run']} test cases run in {result['seconds']:.0f}s"
    lines.append(f"{'total':<6} {points:>7}  ({ran})")
    lines += [f"also failing (no points): {other}" for other in result["other_failures"]]
    return "\n".join(lines)


def refusal(lesson: str, path: str, part: int = 0) -> str:
    """'' if the file may be graded, else why not: changed outside its regions, or borrowing."""
    try:
        diff = labs.changed_outside(lesson, path, part)
    except labs.LabError as e:
        return f"its lab markers are broken ({e}): put them back as generated"
    if diff:
        return f"it was changed outside its lab regions; only the regions may change:\n{diff}"
    _, inside = labs.bodies(open(path).read(), lesson, path)
    module = "minidist." + labs.parts(lesson)[part]["impl"]
    for rid, body in sorted(inside.items()):
        if re.search(rf"\b{re.escape(module)}\b|import_module|__import__", body):
            return f"region {rid} uses the reference {module}: write the code yourself"
    return ""


def grade(lesson: str, files: list[str] | None, extra: list[str], options: dict) -> int:
    """Grade the lab's files (default: the lesson's lab.py, lab_train.py, ...); print the
    table; 0 when every task passes, 1 when some fail, 3 when a file is refused. options:
    json, junit, verbose."""
    n = len(labs.parts(lesson))
    if files is not None and len(files) != n:
        print(f"lab {lesson}: --file takes {n} files, one per part, got {len(files)}")
        return 2
    paths = [os.path.abspath(f) for f in files or [labs.lab_path(lesson, k) for k in range(n)]]
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
    print(f"lab {lesson}: grading {shown} (pytest {' '.join(labs.LABS[lesson]['grade'])})")
    start = time.monotonic()
    if options.get("junit"):
        extra = [*extra, f"--junitxml={os.path.abspath(options['junit'])}"]
    outcomes = run_tests(lesson, paths, extra, options.get("verbose", False))
    result |= score(lesson, outcomes) | {"seconds": round(time.monotonic() - start, 1)}
    result["date"] = time.strftime("%Y-%m-%d %H:%M")
    print(table(result))
    _report(result, options)
    if path == os.path.abspath(labs.lab_path(lesson)):  # the learner's own lab: for `status`
        os.makedirs(GRADES, exist_ok=True)
        with open(os.path.join(GRADES, f"{lesson}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["earned"] == result["points"] and result["points"] else 1


def _report(result: dict, options: dict) -> None:
    """Write the result as JSON where --json asked (a path, or '-' for stdout)."""
    target = options.get("json")
    if target == "-":
        print(json.dumps(result, indent=1))
    elif target:
        with open(target, "w") as f:
            json.dump(result, f, indent=1)


def _shown(path: str) -> str:
    return os.path.relpath(path, labs.ROOT) if path.startswith(labs.ROOT + os.sep) else path


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def status() -> str:
    """One line per lab: its file, regions still unfilled, changed outside, last grade."""
    lines = [f"{'lab':<4} {'file':<40} {'unfilled':<16} last grade"]
    for lesson, part in [(x, k) for x in labs.LABS for k in range(len(labs.parts(x)))]:
        path = labs.lab_path(lesson, part)
        shown = os.path.relpath(path, labs.ROOT)
        if not os.path.exists(path):
            lines.append(f"{lesson:<4} {shown:<40} missing")
            continue
        try:
            left = labs.unfilled_regions(open(path).read(), lesson)
            left_text = ", ".join(left) or "none"
        except labs.LabError:
            left_text = "markers broken"
        last = os.path.join(GRADES, f"{lesson}.json")
        graded = "never"
        if os.path.exists(last):
            g = json.load(open(last))
            graded = "refused" if g.get("refused") else f"{g['earned']}/{g['points']} {g['date']}"
            if g.get("sha256s", [g.get("sha256")] * (part + 1))[part] != _digest(path):
                graded += " (file changed since)"
        lines.append(f"{lesson:<4} {shown:<40} {left_text:<16} {graded}")
    return "\n".join(lines)


def _probe(lesson: str, cut: set[str]) -> Outcomes:
    """Run the lesson's probe tests, in this process, against a lab with `cut` regions cut."""
    import pytest

    folder = tempfile.mkdtemp(prefix="minidist-lab-")
    for part, lab in enumerate(labs.parts(lesson)):
        path = os.path.join(folder, lab["lab"])
        with open(path, "w") as f:
            f.write(labs.fresh(lesson, cut, part))
        os.environ[labs.env_var(lesson, part)] = path
    # a deliberately broken lab: derandomized, no shrinking (tests/conftest.py), short waits
    os.environ.update({"MINIDIST_HYPOTHESIS": "grade", "MINIDIST_TIMEOUT": TIMEOUT})
    for key in [k for k in sys.modules if k.startswith("minidist_lab_")]:
        del sys.modules[key]  # impl() caches the lab it loaded: load this one
    outcomes = Outcomes()
    quiet = ["-p", "no:cacheprovider", "-p", "no:terminal", "-o", "addopts="]
    args = [*labs.LABS[lesson]["probe"], "-x", *quiet]
    old = os.getcwd()
    os.chdir(labs.ROOT)
    try:
        pytest.main([*args, "-W", "ignore::pytest.PytestAssertRewriteWarning"], [outcomes])
    finally:
        os.chdir(old)
        for part in range(len(labs.parts(lesson))):
            del os.environ[labs.env_var(lesson, part)]
    return outcomes


def unfilled(lesson: str) -> list[str]:
    """Check the probe tests pass on the filled lab and fail on each cut region; the problems."""
    ids = []
    for lab in labs.parts(lesson):
        module = open(os.path.join(labs.ROOT, lab["module"])).read()
        ids += [r[0] for r in labs.regions(module) if r[0].startswith(lesson + ".")]
    ids.sort()
    problems = []
    start = time.monotonic()
    filled = _probe(lesson, set())
    texts = [t for k, t in filled.failure.items() if not k.endswith(":crash")]
    if texts or not filled.ran:
        why = texts[0][-1500:] if texts else "no test ran"
        problems.append(f"lab {lesson} with every region filled should pass the probe: {why}")
    print(f"lab {lesson} filled: {filled.ran} probe tests run ({time.monotonic() - start:.1f}s)")
    for rid in ids:
        start = time.monotonic()
        outcome = _probe(lesson, {rid})
        hit = any(f"Lab {rid}:" in text for text in outcome.failure.values())
        verdict = "fails with its NotImplementedError" if hit else "NOT caught"
        print(f"lab {rid} unfilled: {verdict} ({time.monotonic() - start:.1f}s)")
        if not hit:
            problems.append(f"lab {rid}: the probe tests do not fail with 'Lab {rid}:'")
    return problems
