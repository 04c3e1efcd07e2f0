"""The student's copy of the course: `python tools/labs.py export DIR` (make handout DIR=...).

It holds every file git tracks, except what only the instructor may see:

    instructor/              time estimates, answer keys, the guide to running the course
    tests/hidden/            hidden tests: test_labNN*.py, each test named test_NN_k_* for its task
    tests/test_labs.py       checks the labs against the reference modules (not in the copy)
    tools/comm_speed.py      the comm's overhead per size, beside a plain mpi4py ring: lab 02's
                             answer in 15 lines
    lessons/NN_*/lab.py      in the copy the lab *is* the module, see below

and each lab's module in minidist/ is replaced by its lab (every region of its lesson cut to
`raise NotImplementedError`), so the student's package runs the student's code: lesson 04's
data parallelism all-reduces with the collectives written in lab 02. tools/handout.json keeps
each lab as handed out, which grading compares against (only the regions may change). `leaks`
proves no region's reference code is left anywhere in the copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import labs

PRIVATE = ("instructor/", "tests/hidden/", "tests/test_labs.py", "tools/comm_speed.py")


def handed_out(path: str) -> bool:
    """Whether a tracked file goes into the student's copy."""
    if path.startswith(PRIVATE) or path == os.path.relpath(labs.HANDOUT, labs.ROOT):
        return False
    name = os.path.basename(path)
    return not (path.startswith("lessons/") and name.startswith("lab") and name.endswith(".py"))


def cut_modules() -> dict[str, tuple[str, int]]:
    """{module path: (lesson, part)} for every file a lab cuts."""
    return {
        lab["module"]: (lesson, part)
        for lesson in labs.LABS
        for part, lab in enumerate(labs.parts(lesson))
    }


def export(dest: str) -> list[str]:
    """Write the student's copy into the new folder `dest`; the files written."""
    if labs.handout() is not None:
        raise labs.LabError("this is already a student's copy: export from the instructor's")
    if os.path.exists(dest) and os.listdir(dest):
        raise labs.LabError(f"{dest} is not empty: export into a new folder")
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=labs.ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    cut = cut_modules()
    written = []
    for path in filter(handed_out, tracked):
        target = os.path.join(dest, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if path in cut:
            with open(target, "w") as f:
                lesson, part = cut[path]
                f.write(labs.fresh(lesson, part=part))
        else:
            shutil.copy2(os.path.join(labs.ROOT, path), target)
        written.append(path)
    record = os.path.join(dest, os.path.relpath(labs.HANDOUT, labs.ROOT))
    with open(record, "w") as f:
        handed = {labs.handout_key(*at): labs.fresh(at[0], part=at[1]) for at in cut.values()}
        json.dump(handed, f, indent=0)
    return written


def reference_lines(lesson: str, shortest: int = 16, part: int = 0) -> set[str]:
    """The lines of the lesson's regions in one of its files (stripped, no comments, at least
    `shortest` characters) found in no other code of minidist/ (common idioms,
    `self.optimizer.step()`, are no secret) nor outside the regions of its module: what no
    file of a copy may contain."""
    module = labs.parts(lesson)[part]["module"]
    text = open(os.path.join(labs.ROOT, module)).read()
    outside = {line.strip() for line in labs.fresh(lesson, part=part).splitlines()}
    cuts = cut_modules()
    for here, _, files in os.walk(os.path.join(labs.ROOT, "minidist")):
        for name in files:
            path = os.path.join(here, name)
            if name.endswith(".py") and os.path.relpath(path, labs.ROOT) != module:
                cut = cuts.get(os.path.relpath(path, labs.ROOT))
                other = labs.fresh(cut[0], part=cut[1]) if cut else open(path).read()
                outside |= {line.strip() for line in other.splitlines()}
    lines = text.splitlines()
    found = set()
    for rid, start, end, _, _ in labs.regions(text, module):
        if rid.startswith(lesson + "."):
            found |= {line.strip() for line in lines[start + 1 : end]}
    return {line for line in found - outside if len(line) >= shortest and not line.startswith("#")}


def leaks(dest: str) -> list[str]:
    """'file: lab NN.k: line' for every reference line of any region found in the copy."""
    wanted = {
        line: lesson
        for lesson, part in cut_modules().values()
        for line in reference_lines(lesson, part=part)
    }
    found = []
    for here, _, files in os.walk(dest):
        for name in files:
            path = os.path.join(here, name)
            try:
                text = open(path).read()
            except UnicodeDecodeError:
                continue
            for line in text.splitlines():
                if line.strip() in wanted:
                    where = os.path.relpath(path, dest)
                    found.append(f"{where}: lab {wanted[line.strip()]}: {line.strip()}")
    return found
