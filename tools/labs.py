"""Labs: generate each lesson's lab.py from its reference module, check them, grade them.

    python tools/labs.py generate       # rebuild every lessons/NN_*/lab.py        (make labs)
    python tools/labs.py check          # exit 1 if a committed lab.py is stale     (CI)
    python tools/labs.py grade 01       # the lesson's tests against its lab.py    (make lab L=01)
    python tools/labs.py unfilled 01    # prove those tests fail on an unfilled lab (CI)

A lesson's taught regions are marked in its reference module by comment lines:

        # lab 01.1 begin: a hint for the learner
        ...the code the learner writes, a whole indented block...
        # lab 01.1 end

`generate` copies the module, replaces each region of *this* lesson (regions of other lessons
stay as they are) by `raise NotImplementedError("Lab 01.1: a hint for the learner")` at the
marker's indentation, and rewrites relative imports (`from .protocol import x`) to absolute
`minidist.` ones so the file runs from the lesson folder. `grade` points MINIDIST_IMPL_<NAME>,
which `minidist.testing.impl()` reads, at the learner's lab.py and runs pytest on the lesson's
tests: the very tests that check the reference. `unfilled` runs a few of those tests once per
region, with only that region cut out, and fails unless each region makes them fail with its
own "Lab NN.k" error; it also runs them on the lab with nothing cut out, which must pass.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# lesson -> the reference module it cuts, the impl() name that swaps it in, the pytest
# arguments that grade it, and `probe`: a few fast tests that must fail on an unfilled region
LABS = {
    "01": {
        "folder": "lessons/01_processes_p2p",
        "module": "minidist/comm/threads.py",
        "impl": "comm.threads",
        "grade": ["tests/test_comm.py", "-m", "threads"],
        "probe": ["tests/test_comm.py", "-m", "threads", "-k", "p2p_ring"],
    },
    "02": {
        "folder": "lessons/02_collectives",
        "module": "minidist/collectives.py",
        "impl": "collectives",
        "grade": ["tests/test_collectives.py", "-m", "threads"],
        "probe": ["tests/test_collectives.py", "-m", "threads", "-k", "message_counts or right"],
    },
    "03": {
        "folder": "lessons/03_debugging_hangs",
        "module": "minidist/comm/checked.py",
        "impl": "comm.checked",
        "grade": ["tests/test_debug.py", "-m", "threads"],
        "probe": ["tests/test_debug.py", "-m", "threads"],
    },
    "04": {
        "folder": "lessons/04_data_parallel",
        "module": "minidist/data_parallel.py",
        "impl": "data_parallel",
        "grade": ["tests/test_data_parallel.py", "-m", "not processes"],
        "probe": ["tests/test_data_parallel.py", "-m", "not processes"],
    },
    "05": {
        "folder": "lessons/05_tensor_parallel",
        "module": "minidist/tensor_parallel.py",
        "impl": "tensor_parallel",
        "grade": ["tests/test_tensor_parallel.py", "-m", "threads"],
        "probe": ["tests/test_tensor_parallel.py", "-k", "bytes_per_layer or float32_block"],
    },
    "06": {
        "folder": "lessons/06_pipeline",
        "module": "minidist/schedules.py",
        "impl": "schedules",
        "grade": ["tests/test_schedules.py", "-m", "not processes"],
        "probe": ["tests/test_schedules.py", "-k", "invariants"],
    },
    "07": {
        "folder": "lessons/07_zero",
        "module": "minidist/zero.py",
        "impl": "zero",
        "grade": ["tests/test_zero.py", "-m", "not processes"],
        "probe": ["tests/test_zero.py", "-k", "zero_small_threads"],
    },
    "08": {
        "folder": "lessons/08_sync_async_sgd",
        "module": "minidist/parameter_server.py",
        "impl": "parameter_server",
        "grade": ["tests/test_sgd.py", "-m", "not processes"],
        "probe": ["tests/test_sgd.py", "-k", "pushed_twice or parameter_server_threads"],
    },
    "09": {
        "folder": "lessons/09_mixed_precision",
        "module": "minidist/amp.py",
        "impl": "amp",
        "grade": ["tests/test_amp.py", "-m", "not processes"],
        "probe": ["tests/test_amp.py", "-m", "not processes"],
    },
    "10": {
        "folder": "lessons/10_checkpointing",
        "module": "minidist/checkpointing.py",
        "impl": "checkpointing",
        "grade": ["tests/test_checkpointing.py", "-m", "not processes"],
        "probe": ["tests/test_checkpointing.py", "-m", "not processes"],
    },
    "11": {
        "folder": "lessons/11_large_batches",
        "module": "minidist/lr.py",
        "impl": "lr",
        "grade": ["tests/test_lr.py", "-m", "not processes"],
        "probe": ["tests/test_lr.py", "-m", "not processes"],
    },
    "12": {
        "folder": "lessons/12_3d_parallel",
        "module": "minidist/mesh.py",
        "impl": "mesh",
        "grade": ["tests/test_mesh.py"],
        "probe": ["tests/test_mesh.py", "-m", "not processes"],
    },
    "13": {
        "folder": "lessons/13_beyond_one_machine",
        "module": "minidist/cluster.py",
        "impl": "cluster",
        "grade": ["tests/test_cluster.py", "tests/test_simulate.py", "-m", "pure or threads"],
        "probe": ["tests/test_cluster.py", "-m", "pure"],
    },
}

BEGIN = re.compile(r"^(?P<indent>[ ]*)# lab (?P<id>\d\d\.\d+) begin: (?P<hint>\S.*?)\s*$")
END = re.compile(r"^(?P<indent>[ ]*)# lab (?P<id>\d\d\.\d+) end\s*$")
RELATIVE = re.compile(r"^(?P<indent>[ ]*)from (?P<dots>\.+)(?P<rest>[\w.]*) import ")
LINE_LENGTH = 100


class LabError(ValueError):
    """A reference module's lab markers are malformed, or a lesson is unknown."""


def regions(text: str, where: str = "module") -> list[tuple[str, int, int, str, str]]:
    """The lab regions of a module: (id, begin line, end line, indentation, hint), 0-based.

    Raises LabError, naming the line, on a begin without end, an end without begin, nesting, a
    repeated id, an empty region, or a body line indented less than its begin marker.
    """
    found, open_region, seen = [], None, set()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        begin, end = BEGIN.match(line), END.match(line)
        if begin and open_region:
            raise LabError(f"{where}:{i + 1}: lab {begin['id']} begins inside {open_region[0]}")
        if begin:
            if begin["id"] in seen:
                raise LabError(f"{where}:{i + 1}: lab {begin['id']} is marked twice")
            seen.add(begin["id"])
            open_region = (begin["id"], i, begin["indent"], begin["hint"])
        elif end:
            if not open_region or end["id"] != open_region[0]:
                raise LabError(f"{where}:{i + 1}: 'lab {end['id']} end' without its begin")
            rid, start, indent, hint = open_region
            body = [b for b in lines[start + 1 : i] if b.strip()]
            if not body:
                raise LabError(f"{where}:{start + 1}: lab {rid} is empty")
            for j, b in enumerate(lines[start + 1 : i], start + 2):
                if b.strip() and len(b) - len(b.lstrip()) < len(indent):
                    raise LabError(f"{where}:{j}: lab {rid}: line indented less than its marker")
            if end["indent"] != indent or len(body[0]) - len(body[0].lstrip()) != len(indent):
                raise LabError(f"{where}:{start + 1}: lab {rid}: markers and code not aligned")
            found.append((rid, start, i, indent, hint))
            open_region = None
    if open_region:
        raise LabError(f"{where}:{open_region[1] + 1}: lab {open_region[0]} never ends")
    return found


def _raise_line(indent: str, rid: str, hint: str) -> list[str]:
    """The stub, on one line if it fits, else wrapped the way `ruff format` wraps it."""
    message = f'"Lab {rid}: ' + hint.replace("\\", "\\\\").replace('"', '\\"') + '"'
    one = f"{indent}raise NotImplementedError({message})"
    if len(one) <= LINE_LENGTH:
        return [one]
    if len(indent) + 4 + len(message) > LINE_LENGTH:
        raise LabError(f"lab {rid}: the hint is {len(hint)} characters, too long for one line")
    return [f"{indent}raise NotImplementedError(", f"{indent}    {message}", f"{indent})"]


def _absolute(line: str, package: list[str]) -> str:
    """`from .protocol import x` in package minidist.comm -> `from minidist.comm.protocol ...`."""
    m = RELATIVE.match(line)
    if not m:
        return line
    up = len(m["dots"]) - 1
    if up >= len(package):
        raise LabError(f"{line.strip()!r} reaches above the package {'.'.join(package)}")
    target = ".".join(package[: len(package) - up] + ([m["rest"]] if m["rest"] else []))
    head, names = f"{m['indent']}from {target} import ", line[m.end() :]
    if len(head + names) <= LINE_LENGTH or names.strip().startswith("("):
        return head + names
    if "#" in names:
        raise LabError(f"{line.strip()!r} is too long made absolute: wrap it in the reference")
    # now too long: one name a line, as `ruff format` lays it out
    inner = [f"{m['indent']}    {name.strip()}," for name in names.split(",")]
    return "\n".join([head + "(", *inner, m["indent"] + ")"])


def make_lab(text: str, module: str, lesson: str, cut: set[str] | None = None) -> str:
    """The lab.py text for `lesson` from the reference module's `text` (path `module`).

    cut: the region ids to replace (default: all of this lesson's); the others stay filled.
    """
    found = [r for r in regions(text, module) if r[0].startswith(lesson + ".")]
    if not found:
        raise LabError(f"{module} has no '# lab {lesson}.k begin' regions")
    cut = {r[0] for r in found} if cut is None else cut
    package = module.removesuffix(".py").split("/")[:-1]  # minidist/comm/x.py -> minidist.comm
    lines, out, skip_to = text.splitlines(), [], -1
    starts = {start: (rid, end, indent, hint) for rid, start, end, indent, hint in found}
    for i, line in enumerate(lines):
        if i <= skip_to:
            continue
        if i in starts and starts[i][0] in cut:
            rid, skip_to, indent, hint = starts[i]
            out += _raise_line(indent, rid, hint)
        else:
            out.append(_absolute(line, package))
    header = [
        f"# GENERATED by `python tools/labs.py generate` (make labs) from {module}.",
        "# Do not edit by hand except inside the lab regions: replace each",
        f'# `raise NotImplementedError("Lab {lesson}.k: ...")` by your code, then grade it with',
        f"# `make lab L={lesson}`. Until you do, imports and variables look unused, and names your",
        "# code defines look undefined to linters:",
        "# ruff: noqa: F401, F821, F841",
    ]
    return "\n".join(header + out) + "\n"


def lab_path(lesson: str) -> str:
    return os.path.join(ROOT, _lab(lesson)["folder"], "lab.py")


def _lab(lesson: str) -> dict:
    if lesson not in LABS:
        raise LabError(f"no lab for lesson {lesson!r}; lessons with labs: {sorted(LABS)}")
    return LABS[lesson]


def fresh(lesson: str, cut: set[str] | None = None) -> str:
    """The lab.py that `generate` writes for `lesson` today."""
    module = _lab(lesson)["module"]
    with open(os.path.join(ROOT, module)) as f:
        return make_lab(f.read(), module, lesson, cut)


def generate() -> list[str]:
    """Write every lesson's lab.py; the paths written."""
    written = []
    for lesson in LABS:
        os.makedirs(os.path.dirname(lab_path(lesson)), exist_ok=True)
        with open(lab_path(lesson), "w") as f:
            f.write(fresh(lesson))
        written.append(os.path.relpath(lab_path(lesson), ROOT))
    return written


def stale() -> dict[str, str]:
    """{lab path: a short unified diff} for every committed lab.py that differs from fresh."""
    problems = {}
    for lesson in LABS:
        path = lab_path(lesson)
        want = fresh(lesson)
        have = open(path).read() if os.path.exists(path) else ""
        if have != want:
            diff = difflib.unified_diff(
                have.splitlines(), want.splitlines(), "committed", "fresh", lineterm=""
            )
            problems[os.path.relpath(path, ROOT)] = "\n".join(list(diff)[:20])
    return problems


def env_var(lesson: str) -> str:
    """MINIDIST_IMPL_COMM_THREADS for impl name comm.threads (see minidist.testing.impl)."""
    return "MINIDIST_IMPL_" + _lab(lesson)["impl"].upper().replace(".", "_")


def grade(lesson: str, path: str | None = None, extra: list[str] | None = None) -> int:
    """Run the lesson's tests against its lab.py (or `path`); pytest's exit code."""
    path = os.path.abspath(path or lab_path(lesson))
    args = [*_lab(lesson)["grade"], *(extra or [])]
    left = sorted(set(re.findall(rf'"Lab ({lesson}\.\d+):', open(path).read())))
    shown = os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path
    print(f"grading {shown}: pytest {' '.join(args)}")
    print(f"  with {env_var(lesson)}={path}")
    if left:
        print(f"  still unfilled: {', '.join(left)} (their tests will fail)")
    env = dict(os.environ, **{env_var(lesson): path})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


class _Outcomes:
    """A pytest plugin that keeps the failures' text and counts the tests that ran."""

    def __init__(self):
        self.failures: list[str] = []
        self.ran = 0

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.failed:
            self.ran += report.when == "call"
            if report.failed:
                self.failures.append(report.longreprtext)


def _probe(lesson: str, cut: set[str]) -> _Outcomes:
    """Run the lesson's probe tests, in this process, against a lab with `cut` regions cut."""
    import pytest
    from hypothesis import Phase, settings

    # a deliberately broken lab: no shrinking its failures, nor keeping them for later runs
    settings.register_profile("labs-probe", database=None, phases=[Phase.explicit, Phase.generate])
    settings.load_profile("labs-probe")
    folder = tempfile.mkdtemp(prefix="minidist-lab-")
    path = os.path.join(folder, "lab.py")
    with open(path, "w") as f:
        f.write(fresh(lesson, cut))
    os.environ[env_var(lesson)] = path
    for key in [k for k in sys.modules if k.startswith("minidist_lab_")]:
        del sys.modules[key]  # impl() caches the lab it loaded: load this one
    outcomes = _Outcomes()
    quiet = ["-p", "no:cacheprovider", "-p", "no:terminal", "-o", "addopts="]
    args = [*_lab(lesson)["probe"], "-x", *quiet]
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        pytest.main([*args, "-W", "ignore::pytest.PytestAssertRewriteWarning"], [outcomes])
    finally:
        os.chdir(old)
        del os.environ[env_var(lesson)]
    return outcomes


def unfilled(lesson: str) -> list[str]:
    """Check the probe tests pass on the filled lab and fail on each cut region; the problems."""
    ids = [r[0] for r in regions(open(os.path.join(ROOT, _lab(lesson)["module"])).read())]
    ids = sorted(rid for rid in ids if rid.startswith(lesson + "."))
    problems = []
    start = time.monotonic()
    filled = _probe(lesson, set())
    if filled.failures or not filled.ran:
        why = filled.failures[0][-1500:] if filled.failures else "no test ran"
        problems.append(f"lab {lesson} with every region filled should pass the probe: {why}")
    print(f"lab {lesson} filled: {filled.ran} probe tests run ({time.monotonic() - start:.1f}s)")
    for rid in ids:
        start = time.monotonic()
        outcome = _probe(lesson, {rid})
        hit = any(f"Lab {rid}:" in text for text in outcome.failures)
        verdict = "fails with its NotImplementedError" if hit else "NOT caught"
        print(f"lab {rid} unfilled: {verdict} ({time.monotonic() - start:.1f}s)")
        if not hit:
            problems.append(f"lab {rid}: the probe tests do not fail with 'Lab {rid}:'")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("generate", help="rebuild every lessons/NN_*/lab.py")
    sub.add_parser("check", help="exit 1 if a committed lab.py differs from a fresh one")
    g = sub.add_parser("grade", help="run lesson NN's tests against its lab.py (+ pytest args)")
    g.add_argument("lesson")
    g.add_argument("--file", help="grade this file instead of the lesson's lab.py")
    u = sub.add_parser("unfilled", help="prove lesson NN's tests fail on an unfilled lab")
    u.add_argument("lessons", nargs="*", help="default: every lesson")
    args, pytest_args = parser.parse_known_args(argv)  # grade passes the rest on to pytest
    if pytest_args and args.verb != "grade":
        parser.error(f"unrecognized arguments: {' '.join(pytest_args)}")
    try:
        if args.verb == "generate":
            print("\n".join(f"wrote {p}" for p in generate()))
            return 0
        if args.verb == "check":
            problems = stale()
            for path, diff in problems.items():
                print(f"{path} is stale: run `make labs` (python tools/labs.py generate)\n{diff}")
            return 1 if problems else 0
        if args.verb == "grade":
            return grade(args.lesson.zfill(2), args.file, pytest_args)
        lessons = [lesson.zfill(2) for lesson in args.lessons] or list(LABS)
        problems = [p for lesson in lessons for p in unfilled(lesson)]
        print("\n".join(problems) or "every region is caught by its tests")
        return 1 if problems else 0
    except LabError as e:
        print(f"labs: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
