"""Labs: generate each lesson's lab.py from its reference module, check, grade and hand them out.

    python tools/labs.py generate       # rebuild every lessons/NN_*/lab.py        (make labs)
    python tools/labs.py check          # exit 1 if a committed lab.py is stale     (CI)
    python tools/labs.py grade 01       # a table of lab 01's tasks and points     (make lab L=01)
    python tools/labs.py status         # which labs are filled, their last grades
    python tools/labs.py export DIR     # the student's copy of the course         (make handout)
    python tools/labs.py unfilled 01    # prove the tests fail on an unfilled lab   (CI)
    python tools/labs.py mutants 02     # grade lab 02's catalogued wrong solutions (instructor)

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
keeps a lab that holds work (a region no longer its stub) unless --force. `grade` (labs_grade.py)
points MINIDIST_IMPL_<NAME>, which `minidist.testing.impl()` reads, at the learner's file and runs
the lesson's tests: the very tests that check the reference; it refuses a file changed outside
its markers. `unfilled` runs a few of those tests once per region, with only that region cut
out, and fails unless each region makes them fail with its own "Lab NN.k" error; it also runs
them on the lab with nothing cut out, which must pass. `export` is labs_export.py, `mutants`
labs_mutants.py (instructor/grading.md).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys

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
    outside, inside, current = [], {}, None
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    gen = sub.add_parser("generate", help="rebuild every lessons/NN_*/lab.py")
    gen.add_argument("--force", action="store_true", help="overwrite labs that hold work")
    sub.add_parser("check", help="exit 1 if a committed lab.py differs from a fresh one")
    g = sub.add_parser("grade", help="run lesson NN's tests against its lab.py (+ pytest args)")
    g.add_argument("lesson")
    g.add_argument(
        "--file", nargs="+", help="grade these files instead of the lesson's (lab.py, lab_train.py)"
    )
    g.add_argument(
        "--json", help="also write the grade as JSON to this path ('-': stdout, the JSON alone)"
    )
    g.add_argument("--task", nargs="+", help="grade only these tasks (NN.k): their checks alone")
    g.add_argument("--all", action="store_true", help="run the tests no task names too (no points)")
    g.add_argument("--junit", help="also write pytest's JUnit XML to this path")
    g.add_argument("--verbose", action="store_true", help="pytest's own report as well")
    sub.add_parser("status", help="which labs are filled, and their last grades")
    e = sub.add_parser("export", help="write the student's copy of the course into DIR")
    e.add_argument("dir")
    u = sub.add_parser("unfilled", help="prove lesson NN's tests fail on an unfilled lab")
    u.add_argument("lessons", nargs="*", help="default: every lesson")
    m = sub.add_parser("mutants", help="grade the labs' catalogued wrong solutions")
    m.add_argument("lessons", nargs="*", help="default: every lesson")
    m.add_argument(
        "--out", help="write the table here (default: instructor/mutants.md, for every lab)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    import labs_export
    import labs_grade

    parser = _parser()
    args, pytest_args = parser.parse_known_args(argv)  # grade passes the rest on to pytest
    if pytest_args and args.verb != "grade":
        parser.error(f"unrecognized arguments: {' '.join(pytest_args)}")
    try:
        if args.verb == "generate":
            print("\n".join(f"wrote {p}" for p in generate(args.force)))
            return 0
        if args.verb == "check":
            problems = stale()
            for path, diff in problems.items():
                print(f"{path} is stale: run `make labs` (python tools/labs.py generate)\n{diff}")
            return 1 if problems else 0
        if args.verb == "grade":
            options = {"json": args.json, "junit": args.junit, "verbose": args.verbose}
            options |= {"tasks": args.task, "all": args.all}
            return labs_grade.grade(args.lesson.zfill(2), args.file, pytest_args, options)
        if args.verb == "status":
            print(labs_grade.status())
            return 0
        if args.verb == "export":
            written = labs_export.export(args.dir)
            found = labs_export.leaks(args.dir)
            print(f"wrote {len(written)} files to {args.dir}")
            print("\n".join(f"reference code left: {f}" for f in found) or "no reference code")
            return 1 if found else 0
        if args.verb == "mutants":
            if not os.path.exists(os.path.join(ROOT, "tools", "labs_mutants.py")):
                raise LabError("mutants is the instructor's: this copy has no wrong solutions")
            import labs_mutants

            lessons = [lesson.zfill(2) for lesson in args.lessons]
            # the instructor's table is every lab's: a run of some labs prints theirs alone
            path = args.out or (None if lessons else labs_mutants.REPORT)
            return labs_mutants.main(lessons, path)
        lessons = [lesson.zfill(2) for lesson in args.lessons] or list(LABS)
        problems = [p for lesson in lessons for p in labs_grade.unfilled(lesson)]
        print("\n".join(problems) or "every region is caught by its tests")
        return 1 if problems else 0
    except LabError as e:
        print(f"labs: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    import labs  # run as a script: one module `labs`, the one labs_grade and labs_export use

    sys.exit(labs.main())
