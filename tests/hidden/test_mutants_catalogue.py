"""The catalogue of wrong solutions (mutants.py) stays true to the reference modules.

Every mutant's `old` occurs exactly once in its module, inside the region of its task (whole
lines or parts of them, never a line break at either end: a tool that counts lines would read
it as reaching past the region), and differs from `new`; the mutated module still parses and
keeps its lab markers (so grading does not refuse it); every lab 01-15 has at least two
mutants, each named once. Pure: no grading runs here (`tools/labs.py mutants` grades them).
"""

from __future__ import annotations

import ast
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools"))  # the tools import each other by name
sys.path.insert(0, HERE)
import labs_cut  # noqa: E402
from labs_table import LABS  # noqa: E402
from mutants import MUTANTS  # noqa: E402

pytestmark = pytest.mark.pure


def module_text(lab: str, part: int) -> tuple[str, str]:
    path = labs_cut.parts(lab)[part]["module"]
    with open(os.path.join(ROOT, path)) as f:
        return path, f.read()


def region_span(text: str, path: str, task: str) -> tuple[int, int] | None:
    """[start, end) character offsets of the lines between task's markers, None if absent."""
    lines = text.splitlines(keepends=True)
    for rid, begin, end, _, _ in labs_cut.regions(text, path):
        if rid == task:
            return sum(map(len, lines[: begin + 1])), sum(map(len, lines[:end]))
    return None


def test_every_old_snippet_occurs_once_inside_its_tasks_region():
    problems = []
    for m in MUTANTS:
        where = f"{m.lab} {m.task} {m.name!r}"
        if m.lab not in LABS or not m.task.startswith(m.lab + "."):
            problems.append(f"{where}: no such lab or task")
            continue
        if not 0 <= m.module < len(labs_cut.parts(m.lab)):
            problems.append(f"{where}: lab {m.lab} has no module {m.module}")
            continue
        path, text = module_text(m.lab, m.module)
        count = text.count(m.old)
        span = region_span(text, path, m.task)
        if count != 1:
            problems.append(f"{where}: `old` occurs {count} times in {path}")
        elif span is None:
            problems.append(f"{where}: {path} has no region {m.task}")
        elif not span[0] <= text.index(m.old) <= text.index(m.old) + len(m.old) <= span[1]:
            problems.append(f"{where}: `old` lies outside region {m.task} of {path}")
        elif m.old == m.new:
            problems.append(f"{where}: `new` is `old`")
        elif m.old.startswith("\n") or m.old.endswith("\n"):  # read as reaching the next line
            problems.append(f"{where}: `old` starts or ends with a newline")
    assert not problems, "\n".join(problems)


def test_every_mutated_module_parses_and_keeps_its_markers():
    problems = []
    for m in MUTANTS:
        path, text = module_text(m.lab, m.module)
        if text.count(m.old) != 1:
            continue  # the test above names it
        mutated = text.replace(m.old, m.new)
        try:
            ast.parse(mutated, path)
            before = [r[0] for r in labs_cut.regions(text, path)]
            after = [r[0] for r in labs_cut.regions(mutated, path)]
        except (SyntaxError, labs_cut.LabError) as e:
            problems.append(f"{m.lab} {m.task} {m.name!r}: {type(e).__name__}: {e}")
            continue
        if before != after:
            problems.append(f"{m.lab} {m.task} {m.name!r}: regions {before} became {after}")
    assert not problems, "\n".join(problems)


def test_every_lab_has_at_least_two_mutants_each_named_once():
    by_lab: dict[str, list[str]] = {}
    for m in MUTANTS:
        by_lab.setdefault(m.lab, []).append(m.name)
    short = {lab: len(by_lab.get(lab, [])) for lab in LABS if len(by_lab.get(lab, [])) < 2}
    assert not short, f"labs with fewer than two mutants: {short}"
    assert sorted(LABS) == [f"{n:02d}" for n in range(1, 16)], sorted(LABS)
    repeated = {lab: names for lab, names in by_lab.items() if len(set(names)) < len(names)}
    assert not repeated, repeated
