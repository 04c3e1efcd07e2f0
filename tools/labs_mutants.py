"""The mutation score: `python tools/labs.py mutants [NN ...]` grades every catalogued wrong
solution of the labs, and each must lose points.

tests/hidden/mutants.py (the instructor's copy only) lists them: a Mutant replaces `old`, an
exact snippet of a lab's reference module inside its task's region, by `new`. For each, this
tool takes the lab with no region cut (labs_cut.fresh(lesson, set(), part): the reference as a lab
file), plants the mutant, writes it (and the lab's other parts, unchanged) into a temporary
folder it removes afterwards, and grades it in a fresh process with `grade NN --file ... --task
NN.k`: the lesson's tests and the hidden tests that check the mutant's task, as a student's
submission would be graded. A mutant passes when its task earns all its points; the table (lab,
mutant, task, earned / points, seconds, the first failing check) goes to instructor/mutants.md,
and the exit code is 1 if any mutant passes (or cannot be planted or graded).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import labs_cut

CATALOGUE = os.path.join(labs_cut.ROOT, "tests", "hidden", "mutants.py")
REPORT = os.path.join(labs_cut.ROOT, "instructor", "mutants.md")
LIMIT = 15.0  # seconds a mutant may take to grade (a hang included)
KILL = 120  # seconds after which its grading process is stopped


def catalogue() -> list:
    """The Mutant entries of tests/hidden/mutants.py (the instructor's copy only)."""
    if not os.path.exists(CATALOGUE):
        raise labs_cut.LabError(
            f"no {os.path.relpath(CATALOGUE, labs_cut.ROOT)}: the instructor's copy"
        )
    spec = importlib.util.spec_from_file_location("minidist_mutants", CATALOGUE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # before running it: dataclasses look their module up
    spec.loader.exec_module(module)
    return list(module.MUTANTS)


def planted(mutant) -> str:
    """The lab file of mutant.module with the mutant planted: `old` replaced by `new` once.
    LabError, naming the mutant, unless `old` occurs exactly once, inside its task's region."""
    text = labs_cut.fresh(mutant.lab, set(), mutant.module)
    where = f"mutant {mutant.task} {mutant.name!r}"
    count = text.count(mutant.old)
    if count != 1:
        raise labs_cut.LabError(
            f"{where}: its `old` occurs {count} times in the reference, not once"
        )
    line = text[: text.index(mutant.old)].count("\n")
    last = line + mutant.old.count("\n")
    inside = [
        r for r in labs_cut.regions(text) if r[0] == mutant.task and r[1] < line and last < r[2]
    ]
    if not inside:
        raise labs_cut.LabError(f"{where}: its `old` is not inside the region of {mutant.task}")
    return text.replace(mutant.old, mutant.new)


def grade(mutant, folder: str) -> dict:
    """Grade one mutant in a fresh process; {earned, points, seconds, message} of its task."""
    paths = []
    for part, lab in enumerate(labs_cut.parts(mutant.lab)):
        path = os.path.join(folder, lab["lab"])
        with open(path, "w") as f:
            f.write(
                planted(mutant)
                if part == mutant.module
                else labs_cut.fresh(mutant.lab, set(), part)
            )
        paths.append(path)
    report = os.path.join(folder, "grade.json")
    tool = os.path.join(labs_cut.ROOT, "tools", "labs.py")
    args = ["grade", mutant.lab, "--file", *paths, "--task", mutant.task, "--json", report]
    start = time.monotonic()
    try:
        run = subprocess.run(
            [sys.executable, tool, *args], capture_output=True, text=True, timeout=KILL
        )
    except subprocess.TimeoutExpired:
        return {"earned": None, "points": None, "seconds": KILL, "message": "grading hung"}
    seconds = round(time.monotonic() - start, 1)
    if not os.path.exists(report):
        why = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no grade written"]
        return {"earned": None, "points": None, "seconds": seconds, "message": why[0]}
    result = json.load(open(report))
    if result.get("refused"):
        return {"earned": None, "points": None, "seconds": seconds, "message": result["refused"]}
    row = result["tasks"][0]
    return {"earned": row["earned"], "points": row["points"], "seconds": seconds} | {
        "message": row["message"]
    }


def score(mutants: list) -> list[dict]:
    """Grade every mutant, one after another, each in its own folder (removed after)."""
    rows = []
    for mutant in mutants:
        with tempfile.TemporaryDirectory(prefix="minidist-mutant-") as folder:
            try:
                got = grade(mutant, folder)
            except labs_cut.LabError as e:
                got = {"earned": None, "points": None, "seconds": 0.0, "message": str(e)}
        row = {"lab": mutant.lab, "task": mutant.task, "mutant": mutant.name} | got
        row["caught"] = got["earned"] is not None and got["earned"] < got["points"]
        rows.append(row)
        print(line(row), flush=True)
    return rows


HEAD = f"| lab | mutant | task | earned / points | seconds | first failing check |\n{'|---' * 6}|"


def line(row: dict) -> str:
    """One mutant as a row of the markdown table."""
    got = "error" if row["earned"] is None else f"{row['earned']:g} / {row['points']:g}"
    verdict = "" if row["caught"] else " **not caught**"
    slow = " **slow**" if row["seconds"] > LIMIT else ""
    message, name = (row[k].replace("|", "\\|") for k in ("message", "mutant"))
    return (
        f"| {row['lab']} | {name} | {row['task']} | {got}{verdict} | "
        f"{row['seconds']:.1f}{slow} | {message} |"
    )


def write(rows: list[dict], path: str = REPORT) -> None:
    """The table, with how it was made, into instructor/mutants.md."""
    caught = sum(r["caught"] for r in rows)
    slowest = max((r["seconds"] for r in rows), default=0.0)
    about = (
        "Written by `python tools/labs.py mutants` (instructor/grading.md): each wrong solution "
        "of tests/hidden/mutants.py planted into its lab's reference and graded with `grade NN "
        "--file ... --task NN.k` (its task's public and hidden checks). Every one must lose "
        f"points, in at most {LIMIT:g} s. This run: {caught} of {len(rows)} caught, the slowest "
        f"graded in {slowest:.1f} s."
    )
    text = ["# Mutation score", "", textwrap.fill(about, 96), "", HEAD, *map(line, rows), ""]
    with open(path, "w") as f:
        f.write("\n".join(text))


def main(lessons: list[str], path: str | None = REPORT) -> int:
    """Grade the mutants of these labs (all if none), write the table to `path` (None: print
    it only); 1 if any passes or fails to grade."""
    mutants = [m for m in catalogue() if not lessons or m.lab in lessons]
    if not mutants:
        raise labs_cut.LabError(f"no mutants for labs {lessons or 'any'} in {CATALOGUE}")
    print(HEAD)
    rows = score(mutants)
    if path:
        write(rows, path)
    missed = [r for r in rows if not r["caught"]]
    slow = [r for r in rows if r["seconds"] > LIMIT]
    print(f"{len(rows) - len(missed)} of {len(rows)} mutants lose points", end="")
    print(f"; {len(slow)} took over {LIMIT:g} s" if slow else "")
    return 1 if missed else 0
