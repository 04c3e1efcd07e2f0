"""The labs as files: the `# lab NN.k` markers of a reference module, the lab cut from it,
where each lab lives, and writing or checking every lab (tools/labs.py is their command line).

A lesson's taught regions are marked in its reference module by comment lines:

        # lab 01.1 begin: a hint for the learner
        ...the code the learner writes, a whole indented block...
        # lab 01.1 end

A lesson's lab may cut more than one module (labs_table's "more"; `parts`): lesson 12 cuts the
grid, mesh.py, into lab.py and the main job's composition, gpt/train.py, into lab_train.py;
each file has its own impl() variable, and grading sets both.

`generate` copies the module, replaces the body of each region of *this* lesson (regions of
other lessons stay as they are) by `raise NotImplementedError("Lab 01.1: a hint for the
learner")` at the marker's indentation, keeps the markers, and rewrites relative imports (`from
.protocol import x`) to absolute `minidist.` ones so the file runs from the lesson folder. It
keeps a lab that holds work (a region no longer its stub) unless --force. In a student's copy
(labs_export.py) each lab is its module, and tools/handout.json holds the labs as handed out.

This module imports no other tool but the table (labs_table.py): grading, the student's copy
and the mutation score import it, and the command line imports them all.
"""

from __future__ import annotations

import difflib
import json
import os
import re

from labs_table import LABS  # lesson -> its module, impl() name, grading and probe tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
    found = []
    open_region = None
    seen = set()
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
    lines = text.splitlines()
    out = []
    skip_to = -1
    starts = {start: (rid, end, indent, hint) for rid, start, end, indent, hint in found}
    for i, line in enumerate(lines):
        if i <= skip_to:
            continue
        if i in starts and starts[i][0] in cut:
            rid, skip_to, indent, hint = starts[i]
            # the markers stay: grading checks that nothing outside them was changed
            out += [line, *_raise_line(indent, rid, hint), lines[skip_to]]
        else:
            out.append(_absolute(line, package))
    header = [
        "# GENERATED by `python tools/labs.py generate` (make labs)",
        f"# from {module}.",
        "# Do not edit by hand except inside the lab regions: replace each",
        f'# `raise NotImplementedError("Lab {lesson}.k: ...")` between its markers by your',
        "# code (grading refuses a lab changed outside the regions), then grade it with",
        f"# `make lab L={lesson}`. Until you do, imports and variables look unused, and names your",
        "# code defines look undefined to linters:",
        "# ruff: noqa: F401, F821, F841",
    ]
    return "\n".join(header + out) + "\n"


HANDOUT = os.path.join(ROOT, "tools", "handout.json")  # written by `export`: a student's copy
STUB = re.compile(r'^raise NotImplementedError\(\s*"Lab (\d\d\.\d+): .*"\s*\)$', re.S)


def handout() -> dict | None:
    """In a student's copy (see handout.py): {lesson: the lab text handed out}; else None."""
    if not os.path.exists(HANDOUT):
        return None
    with open(HANDOUT) as f:
        return json.load(f)


def parts(lesson: str) -> list[dict]:
    """The files a lesson's lab cuts, each {module, impl, lab}: its module (lab.py), then any
    more (lesson 12: mesh.py in lab.py, the main job's train.py in lab_train.py)."""
    entry = _lab(lesson)
    return [
        {"module": entry["module"], "impl": entry["impl"], "lab": "lab.py"},
        *entry.get("more", []),
    ]


def lab_path(lesson: str, part: int = 0) -> str:
    """The file a learner fills: lessons/NN_*/lab.py (or lab_train.py, ...), or in a handout
    the module itself."""
    if handout() is not None:
        return os.path.join(ROOT, parts(lesson)[part]["module"])
    return os.path.join(ROOT, _lab(lesson)["folder"], parts(lesson)[part]["lab"])


def handout_key(lesson: str, part: int = 0) -> str:
    """The key of a lab in handout.json: the lesson, or lesson/lab_train.py for more parts."""
    return lesson if part == 0 else f"{lesson}/{parts(lesson)[part]['lab']}"


def _lab(lesson: str) -> dict:
    if lesson not in LABS:
        raise LabError(f"no lab for lesson {lesson!r}; lessons with labs: {sorted(LABS)}")
    return LABS[lesson]


def fresh(lesson: str, cut: set[str] | None = None, part: int = 0) -> str:
    """The lab file that `generate` writes for `lesson` today (in a handout: the one handed
    out). cut: the region ids to replace (default all); ids of another part are ignored."""
    given = handout()
    if given is not None:
        return given[handout_key(lesson, part)]
    module = parts(lesson)[part]["module"]
    with open(os.path.join(ROOT, module)) as f:
        return make_lab(f.read(), module, lesson, cut)


def bodies(text: str, lesson: str, where: str = "lab") -> tuple[list[str], dict[str, str]]:
    """(the lines outside this lesson's regions, markers included; {id: the region's body}).

    A light parse of a learner's file: it only needs matching markers, in any indentation."""
    outside = []
    inside = {}
    current = None
    for i, line in enumerate(text.splitlines(), 1):
        begin, end = BEGIN.match(line), END.match(line)
        if begin and begin["id"].startswith(lesson + "."):
            if current:
                raise LabError(f"{where}:{i}: lab {begin['id']} begins inside lab {current}")
            current = begin["id"]
            inside[current] = []
        elif end and end["id"] == current:
            inside[current], current = "\n".join(inside[current]), None
        elif current:
            inside[current].append(line)
            continue
        outside.append(line)
    if current:
        raise LabError(f"{where}: the '# lab {current} end' marker is missing")
    return outside, inside


def changed_outside(lesson: str, path: str, part: int = 0) -> str:
    """'' if `path` differs from the generated lab only inside its regions, else a diff."""
    have, _ = bodies(open(path).read(), lesson, path)
    want, _ = bodies(fresh(lesson, part=part), lesson)
    if have == want:
        return ""
    diff = difflib.unified_diff(want, have, "as generated", "yours", lineterm="", n=1)
    return "\n".join(list(diff)[2:14])


def unfilled_regions(text: str, lesson: str) -> list[str]:
    """The region ids of `lesson` whose body is still the generated `raise` (sorted)."""
    _, inside = bodies(text, lesson)
    return sorted(rid for rid, body in inside.items() if STUB.match(body.strip()))


def untouched(lesson: str, path: str, part: int = 0) -> bool:
    """True if the lab at `path` holds no work: every region is still its stub."""
    text = open(path).read()
    _, inside = bodies(text, lesson, path)
    if not inside:  # a lab generated before the markers stayed: every stub still there?
        want = {r[0] for r in regions(fresh(lesson, part=part)) if r[0].startswith(lesson + ".")}
        return all(f'"Lab {rid}:' in text for rid in want)
    return len(unfilled_regions(text, lesson)) == len(inside)


def generate(force: bool = False) -> list[str]:
    """Write every lesson's lab.py; the paths written. A lab with work in it (a region that is
    no longer its stub) is kept, and named in the LabError, unless force."""
    if handout() is not None:
        raise LabError("this is a student's copy: its labs are the modules in minidist/")
    every = [(lesson, part) for lesson in LABS for part in range(len(parts(lesson)))]
    kept = [
        os.path.relpath(lab_path(lesson, part), ROOT)
        for lesson, part in every
        if not force and os.path.exists(lab_path(lesson, part))
        if not untouched(lesson, lab_path(lesson, part), part)
    ]
    if kept:
        raise LabError(f"{', '.join(kept)} hold work: move them away, or --force to overwrite")
    written = []
    for lesson, part in every:
        os.makedirs(os.path.dirname(lab_path(lesson, part)), exist_ok=True)
        with open(lab_path(lesson, part), "w") as f:
            f.write(fresh(lesson, part=part))
        written.append(os.path.relpath(lab_path(lesson, part), ROOT))
    return written


def stale() -> dict[str, str]:
    """{lab path: a short unified diff} for every committed lab.py that differs from fresh."""
    problems = {}
    for lesson, part in [(x, k) for x in LABS for k in range(len(parts(x)))]:
        path = lab_path(lesson, part)
        want = fresh(lesson, part=part)
        have = open(path).read() if os.path.exists(path) else ""
        if have != want:
            diff = difflib.unified_diff(
                have.splitlines(), want.splitlines(), "committed", "fresh", lineterm=""
            )
            problems[os.path.relpath(path, ROOT)] = "\n".join(list(diff)[:20])
    return problems


def env_var(lesson: str, part: int = 0) -> str:
    """MINIDIST_IMPL_COMM_THREADS for impl name comm.threads (see minidist.testing.impl)."""
    return "MINIDIST_IMPL_" + parts(lesson)[part]["impl"].upper().replace(".", "_")
