"""Labs: generate each lesson's lab.py from its reference module, check, grade and hand them out.

    python tools/labs.py generate       # rebuild every lessons/NN_*/lab.py        (make labs)
    python tools/labs.py check          # exit 1 if a committed lab.py is stale     (CI)
    python tools/labs.py grade 01       # a table of lab 01's tasks and points     (make lab L=01)
    python tools/labs.py status         # which labs are filled, their last grades
    python tools/labs.py export DIR     # the student's copy of the course         (make handout)
    python tools/labs.py unfilled 01    # prove the tests fail on an unfilled lab   (CI)
    python tools/labs.py mutants 02     # grade lab 02's catalogued wrong solutions (instructor)

The command line only: the imports point one way, from here to the verbs' modules and from
each of them to labs_cut.py (the markers, the lab cut from a module, generate and check).
`grade` (labs_grade.py) points MINIDIST_IMPL_<NAME>, which `minidist.testing.impl()` reads, at
the learner's file and runs the lesson's tests: the very tests that check the reference; it
refuses a file changed outside its markers. `unfilled` (labs_unfilled.py) runs a few of those
tests once per region, with only that region cut out, and fails unless each region makes them
fail with its own "Lab NN.k" error; it also runs them on the lab with nothing cut out, which
must pass. `export` is labs_export.py, `mutants` labs_mutants.py (instructor/grading.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import labs_export
import labs_grade
import labs_unfilled
from labs_cut import ROOT, LabError, generate, stale
from labs_table import LABS


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
        problems = [p for lesson in lessons for p in labs_unfilled.unfilled(lesson)]
        print("\n".join(problems) or "every region is caught by its tests")
        return 1 if problems else 0
    except LabError as e:
        print(f"labs: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
