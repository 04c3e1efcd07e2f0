"""Every region caught: `python tools/labs.py unfilled [NN ...]` (CI) proves that a lab's tests fail
on each region left unfilled.

For each region of a lesson it writes the lab with only that region cut (labs_cut.fresh) and
runs the lesson's probe tests (labs_table's "probe", a few fast ones) against it, in this
process, derandomized and with grading's short comm timeout: they must fail with that region's
own "Lab NN.k" NotImplementedError. The lab with nothing cut must pass them. Grading itself is
labs_grade.py, whose pytest plugin (Outcomes) records what failed.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import labs_cut
import labs_grade
from labs_table import LABS


def _probe(lesson: str, cut: set[str]) -> labs_grade.Outcomes:
    """Run the lesson's probe tests, in this process, against a lab with `cut` regions cut."""
    import pytest

    folder = tempfile.mkdtemp(prefix="minidist-lab-")  # removed when the probe has run
    labs_grade.clear_other_labs(lesson)
    for part, lab in enumerate(labs_cut.parts(lesson)):
        path = os.path.join(folder, lab["lab"])
        with open(path, "w") as f:
            f.write(labs_cut.fresh(lesson, cut, part))
        os.environ[labs_cut.env_var(lesson, part)] = path
    # a deliberately broken lab: derandomized, no shrinking (tests/conftest.py), short waits
    os.environ.update({"MINIDIST_HYPOTHESIS": "grade", "MINIDIST_TIMEOUT": labs_grade.TIMEOUT})
    for key in [k for k in sys.modules if k.startswith("minidist_lab_")]:
        del sys.modules[key]  # impl() caches the lab it loaded: load this one
    outcomes = labs_grade.Outcomes()
    quiet = ["-p", "no:cacheprovider", "-p", "no:terminal", "-o", "addopts="]
    args = [*LABS[lesson]["probe"], "-x", *quiet]
    old = os.getcwd()
    os.chdir(labs_cut.ROOT)
    try:
        pytest.main([*args, "-W", "ignore::pytest.PytestAssertRewriteWarning"], [outcomes])
    finally:
        os.chdir(old)
        for part in range(len(labs_cut.parts(lesson))):
            del os.environ[labs_cut.env_var(lesson, part)]
        shutil.rmtree(folder, ignore_errors=True)
    return outcomes


def unfilled(lesson: str) -> list[str]:
    """Check the probe tests pass on the filled lab and fail on each cut region; the problems."""
    ids = []
    for lab in labs_cut.parts(lesson):
        module = open(os.path.join(labs_cut.ROOT, lab["module"])).read()
        ids += [r[0] for r in labs_cut.regions(module) if r[0].startswith(lesson + ".")]
    ids.sort()
    problems = []
    start = time.monotonic()
    filled = _probe(lesson, set())
    texts = [t for k, t in filled.failure.items() if not k.endswith(":crash")]
    if texts or not filled.ran:
        why = texts[0] if texts else "no test ran"  # whole: a failure here is rare, and needs it
        problems.append(f"lab {lesson} with every region filled should pass the probe: {why}")
    print(f"lab {lesson} filled: {filled.ran} probe tests run ({time.monotonic() - start:.1f}s)")
    for rid in ids:
        start = time.monotonic()
        outcome = _probe(lesson, {rid})
        hit = any(f"Lab {rid}:" in text for text in outcome.failure.values())
        verdict = "fails with its NotImplementedError" if hit else "NOT caught"
        print(f"lab {rid} unfilled: {verdict} ({time.monotonic() - start:.1f}s)")
        if not hit:
            first = next(iter(outcome.failure.values()), f"no test failed of {outcome.ran} run")
            print("  the first failure instead:\n" + first)
            problems.append(f"lab {rid}: the probe tests do not fail with 'Lab {rid}:'")
    return problems
