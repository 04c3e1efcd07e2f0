"""The student's copy of the course: `python tools/labs.py export DIR` (make handout DIR=...).

It holds every file git tracks, except what only the instructor may see:

    instructor/              time estimates, answer keys, the guide to running the course
    tests/hidden/            hidden tests: test_labNN*.py, each test named test_NN_k_* for its task
    tests/test_labs.py       checks the labs against the reference modules (not in the copy)
    tools/comm_speed.py      the comm's overhead per size, beside a plain mpi4py ring: lab 02's
                             answer in 15 lines
    tools/labs_mutants.py    the mutation score, which plants tests/hidden/mutants.py's wrong
                             solutions into the reference
    lessons/NN_*/lab.py      in the copy the lab *is* the module, see below

and each lab's module in minidist/ is replaced by its lab (every region of its lesson cut to
`raise NotImplementedError`), so the student's package runs the student's code: lesson 04's
data parallelism all-reduces with the collectives written in lab 02. Each lesson's README names
the module as the file to fill (`for_copy`): the copy has no lab.py. tools/handout.json keeps
each lab as handed out, which grading compares against (only the regions may change). `leaks`
proves no region's reference code is left anywhere in the copy: no line of it, and in the
copy's tests no formula of a region written out again in other words (`restated`: lab 11's
schedule as a helper of its test was its answer).
"""

from __future__ import annotations

import ast
import itertools
import json
import math
import os
import re
import shutil
import subprocess

import labs_cut
from labs_table import LABS

PRIVATE = (
    "instructor/",
    "tests/hidden/",
    "tests/test_labs.py",
    "tools/comm_speed.py",
    "tools/labs_mutants.py",
)


def handed_out(path: str) -> bool:
    """Whether a tracked file goes into the student's copy."""
    if path.startswith(PRIVATE) or path == os.path.relpath(labs_cut.HANDOUT, labs_cut.ROOT):
        return False
    name = os.path.basename(path)
    return not (path.startswith("lessons/") and name.startswith("lab") and name.endswith(".py"))


def cut_modules() -> dict[str, tuple[str, int]]:
    """{module path: (lesson, part)} for every file a lab cuts."""
    return {
        lab["module"]: (lesson, part)
        for lesson in LABS
        for part, lab in enumerate(labs_cut.parts(lesson))
    }


def export(dest: str) -> list[str]:
    """Write the student's copy into the new folder `dest`; the files written."""
    if labs_cut.handout() is not None:
        raise labs_cut.LabError("this is already a student's copy: export from the instructor's")
    if os.path.exists(dest) and os.listdir(dest):
        raise labs_cut.LabError(f"{dest} is not empty: export into a new folder")
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=labs_cut.ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    cut = cut_modules()
    readmes = {os.path.join(LABS[x]["folder"], "README.md"): x for x in LABS}
    written = []
    for path in filter(handed_out, tracked):
        target = os.path.join(dest, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if path in cut:
            with open(target, "w") as f:
                lesson, part = cut[path]
                f.write(labs_cut.fresh(lesson, part=part))
        elif path in readmes:
            with open(target, "w") as f:
                f.write(for_copy(open(os.path.join(labs_cut.ROOT, path)).read(), readmes[path]))
        else:
            shutil.copy2(os.path.join(labs_cut.ROOT, path), target)
        written.append(path)
    record = os.path.join(dest, os.path.relpath(labs_cut.HANDOUT, labs_cut.ROOT))
    with open(record, "w") as f:
        handed = {
            labs_cut.handout_key(*at): labs_cut.fresh(at[0], part=at[1]) for at in cut.values()
        }
        json.dump(handed, f, indent=0)
    return written


def for_copy(readme: str, lesson: str) -> str:
    """A lesson's README as the copy needs it: the lab is the module itself, so "`lab.py` (a
    copy of `minidist/x.py`" reads "`minidist/x.py` (in this copy, the module itself", and every
    other mention of lab.py (lab_train.py) names the module."""
    for lab in labs_cut.parts(lesson):
        readme = readme.replace(
            f"`{lab['lab']}` (a copy of `{lab['module']}`",
            f"`{lab['module']}` (in this copy, the module itself",
        )
        readme = re.sub(rf"(?<![\w/]){re.escape(lab['lab'])}(?!\w)", lab["module"], readme)
    return readme


def reference_lines(lesson: str, shortest: int = 16, part: int = 0) -> set[str]:
    """The lines of the lesson's regions in one of its files (stripped, no comments, at least
    `shortest` characters) found in no other code of minidist/ (common idioms,
    `self.optimizer.step()`, are no secret) nor outside the regions of its module: what no
    file of a copy may contain."""
    module = labs_cut.parts(lesson)[part]["module"]
    text = open(os.path.join(labs_cut.ROOT, module)).read()
    outside = {line.strip() for line in labs_cut.fresh(lesson, part=part).splitlines()}
    cuts = cut_modules()
    for here, _, files in os.walk(os.path.join(labs_cut.ROOT, "minidist")):
        for name in files:
            path = os.path.join(here, name)
            if name.endswith(".py") and os.path.relpath(path, labs_cut.ROOT) != module:
                cut = cuts.get(os.path.relpath(path, labs_cut.ROOT))
                other = labs_cut.fresh(cut[0], part=cut[1]) if cut else open(path).read()
                outside |= {line.strip() for line in other.splitlines()}
    lines = text.splitlines()
    found = set()
    for rid, start, end, _, _ in labs_cut.regions(text, module):
        if rid.startswith(lesson + "."):
            found |= {line.strip() for line in lines[start + 1 : end]}
    return {line for line in found - outside if len(line) >= shortest and not line.startswith("#")}


def leaks(dest: str) -> list[str]:
    """'file: lab NN.k: line' for every reference line of any region found in the copy, then
    every formula of a region its tests write out again (restated)."""
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
    return found + restated(os.path.join(dest, "tests"))


# ---- formulas written out again ------------------------------------------------------------

MATH = {"math": math, "min": min, "max": max, "abs": abs}
OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
POINTS = [(1.37, 2.11, 0.73, 1.91, 2.57), (0.61, 1.29, 2.43, 1.07, 0.89), (2.3, 0.9, 1.6, 0.7, 1.2)]
# formulas of a region that a lesson derives in its own text: no answer when a test uses them
PUBLIC = {
    # lesson 02's ring time 2 (p-1) (a + N / (p B)) with g ranks: the node's term of 13.2, which
    # tests of the flat ring write out; the lab is the composition with the ring across nodes
    "2 * (g - 1) * (cluster.intra.latency + nbytes / g / cluster.intra.bandwidth)",
}


def _dotted(node: ast.AST) -> str | None:
    """'self.lr' for an attribute chain over a name, 'x' for a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def _arithmetic(node: ast.AST) -> bool:
    """Numbers, names and + - * / // % ** over them, and math's functions, min, max, abs."""
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, OPS) and _arithmetic(node.left) and _arithmetic(node.right)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.USub, ast.UAdd)) and _arithmetic(node.operand)
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float)
    if isinstance(node, ast.Call):
        name = _dotted(node.func) or ""
        known = name in ("min", "max", "abs") or name.startswith("math.")
        return known and not node.keywords and all(_arithmetic(a) for a in node.args)
    return _dotted(node) is not None


class _Variables(ast.NodeTransformer):
    """Rename the free names of an expression to _v0, _v1, ... (math.pi stays math's)."""

    def __init__(self):
        self.names: list[str] = []

    def visit_Call(self, node):
        node.args = [self.visit(a) for a in node.args]
        return node  # the function's name is no variable

    def _var(self, node):
        name = _dotted(node)
        if name.startswith("math."):
            return node
        if name not in self.names:
            self.names.append(name)
        return ast.copy_location(ast.Name(f"_v{self.names.index(name)}", ast.Load()), node)

    visit_Name = visit_Attribute = _var


def _formula(node: ast.AST):
    """(its free names, a function of them) for an arithmetic expression."""
    renamed = _Variables()
    body = renamed.visit(ast.parse(ast.unparse(node), mode="eval")).body
    args = ", ".join(f"_v{i}" for i in range(len(renamed.names)))
    return renamed.names, eval(f"lambda {args}: {ast.unparse(body)}", dict(MATH))


def _value(fn, point) -> float | None:
    try:
        value = float(fn(*point))
    except (ArithmeticError, ValueError, TypeError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def _formulas(tree: ast.AST, lines: range | None = None, least: int = 4):
    """Every arithmetic expression of tree (within `lines`, 1-based) with 2..5 free names and
    at least `least` operations (fewer, `a * b / c + d`, are any formula's shape): (line,
    text, names, function)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.BinOp, ast.Call)) or not _arithmetic(node):
            continue
        if lines is not None and not (node.lineno in lines and node.end_lineno in lines):
            continue
        operations = sum(isinstance(n, (ast.BinOp, ast.Call, ast.UnaryOp)) for n in ast.walk(node))
        if operations < least:
            continue
        names, fn = _formula(node)
        if 2 <= len(names) <= 5:
            found.append((node.lineno, ast.unparse(node), names, fn))
    return found


def region_formulas() -> list[tuple[str, str, int, list]]:
    """(region id, the expression, its number of names, its values at POINTS[0] under every
    order of its names) for every formula inside a lab region of a reference module."""
    out = []
    for lesson in LABS:
        for lab in labs_cut.parts(lesson):
            text = open(os.path.join(labs_cut.ROOT, lab["module"])).read()
            tree = ast.parse(text)
            for rid, start, end, _, _ in labs_cut.regions(text, lab["module"]):
                if not rid.startswith(lesson + "."):
                    continue
                for _, expr, names, fn in _formulas(tree, range(start + 2, end + 1)):
                    if expr in PUBLIC:
                        continue
                    k = len(names)
                    orders = list(itertools.permutations(range(k)))
                    values = [_value(fn, [POINTS[0][i] for i in order]) for order in orders]
                    out.append((rid, expr, fn, k, list(zip(orders, values, strict=True))))
    return out


def restated(folder: str) -> list[str]:
    """'file:line: lab NN.k: expr' for every expression in the Python files under `folder`
    that computes one of a region's formulas (the same numbers at three points, its names in
    some order): the answer written out again, whatever the names or the algebra."""
    regions = region_formulas()
    found = []
    for here, _, files in os.walk(folder):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(here, name)
            try:
                tree = ast.parse(open(path).read())
            except (SyntaxError, UnicodeDecodeError):
                continue
            for line, expr, names, fn in _formulas(tree, least=2):
                k = len(names)
                for rid, ref, ref_fn, ref_k, values in regions:
                    if ref_k != k or not _same(fn, ref_fn, values, k):
                        continue
                    where = os.path.relpath(path, os.path.dirname(folder))
                    found.append(f"{where}:{line}: lab {rid}: {expr} restates {ref}")
                    break
    return found


def _same(fn, ref_fn, values: list, k: int) -> bool:
    """Whether fn equals ref_fn with its arguments in some order, at every point."""
    here = _value(fn, POINTS[0][:k])
    if here is None:
        return False
    for order, value in values:
        if value is None or not math.isclose(here, value, rel_tol=1e-9, abs_tol=1e-12):
            continue
        # ref_fn's j-th name is fn's order[j]-th: check the same pairing at the other points
        for point in POINTS[1:]:
            a, b = _value(fn, point[:k]), _value(ref_fn, [point[:k][i] for i in order])
            if a is None or b is None or not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
                break
        else:
            return True
    return False
