"""The import graph has no cycle and points downward only (tier 0: parses files, runs nothing).

Every import of every module under minidist/ is read with ast, the ones inside functions too,
and classified by the layer table below, bottom to top:

    comm          minidist/comm/: one Comm protocol and its backends
    foundation    built directly on comm, for everything above: the launcher and its watchdog
                  (launch/), hand-written collectives (collectives/), the rank grid, memory
                  measurement, the plain transformer, the bench helper, the package's __init__
    technique     one package per lesson's technique; a package imports another only along the
                  edges in COMPOSED, each with its reason (inside one package, freely)
    composition   what puts techniques together: the main job (gpt/), each technique's
                  benchmark (its bench.py), the command line, lesson 13's cluster, simulator
                  and planner (cluster/)
    harness       testing.py: the multi-rank test harness, references and strategies; it sits
                  on comm and the launcher, and nothing in minidist imports it: tests and
                  lessons stand on it
    lessons       lessons/NN_*/*.py: import minidist only

A module may import any module of a lower layer, and of its own layer where that layer is not
`technique`; never a higher one. A module the table does not name fails the test, with where to
add it: a new technique is placed on purpose, not by default.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ("comm", "foundation", "technique", "composition", "harness", "lessons")

# whole packages: every module below them is in that layer (a bench.py is composition wherever it
# lives: it measures its technique beside the others)
PACKAGES = {
    "minidist.comm": "comm",
    "minidist.launch": "foundation",
    "minidist.collectives": "foundation",
    "minidist.data_parallel": "technique",
    "minidist.tensor_parallel": "technique",
    "minidist.pipeline": "technique",
    "minidist.zero": "technique",
    "minidist.sgd": "technique",
    "minidist.mixed_precision": "technique",
    "minidist.checkpointing": "technique",
    "minidist.large_batches": "technique",
    "minidist.expert_parallel": "technique",
    "minidist.context_parallel": "technique",
    "minidist.gpt": "composition",  # the main job: model, data, train, reference, resume, cli
    "minidist.cluster": "composition",  # the simulator runs every technique's code
    "minidist.conform": "composition",  # the conformance kit: checks that run every technique
}

# the modules directly in minidist/, by name
MODULES = {
    "minidist": "foundation",  # __init__: minidist.init, from launch
    "mesh": "foundation",
    "memory": "foundation",
    "transformer": "foundation",
    "replicas": "foundation",  # the Replicas interface the replica techniques fill in
    "bench": "foundation",
    "cli": "composition",
    "testing": "harness",
}

# the only imports between technique packages: one is composed from the other, on purpose
COMPOSED = {
    ("zero", "mixed_precision"): "ZeRO composes mixed precision: Precision, LossScaler, skip_step",
}


def technique(name: str) -> str:
    """The package a module belongs to, as COMPOSED names it: minidist.zero.stages -> zero."""
    return name.removeprefix("minidist.").split(".")[0]


def module_name(path: pathlib.Path) -> str:
    """minidist/comm/mpi.py -> minidist.comm.mpi; a package's __init__.py -> the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    """Whether name (minidist.x.y) is a file or a package of this repository."""
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports(path: pathlib.Path) -> set[str]:
    """The minidist modules path imports, anywhere in the file (inside functions too)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:  # from minidist import zero: the module zero
                sub = f"{base}.{alias.name}"
                found.add(sub if is_module(sub) else base)
    return {name for name in found if name.split(".")[0] == "minidist"}


def layer(name: str) -> str:
    """The layer of module name, from PACKAGES or MODULES; fails naming where to add it."""
    if name.startswith("minidist.") and name.count(".") > 1 and name.endswith(".bench"):
        return "composition"
    for package, where in PACKAGES.items():
        if name == package or name.startswith(package + "."):
            return where
    short = name.removeprefix("minidist.")
    if short not in MODULES:
        pytest.fail(
            f"{name} is in no layer: add {short!r} to MODULES in tests/test_layers.py as one of "
            f"{LAYERS[:-2]} (a technique imports other techniques only through COMPOSED)"
        )
    return MODULES[short]


def graph() -> dict[str, set[str]]:
    """Every minidist module -> the minidist modules it imports."""
    files = sorted((ROOT / "minidist").rglob("*.py"))
    return {module_name(f): imports(f) for f in files}


def wrong_way(edges: dict[str, set[str]]) -> list[str]:
    """One line per import that points up, or sideways between techniques off COMPOSED."""
    problems = []
    for src, dsts in sorted(edges.items()):
        for dst in sorted(dsts - {src}):
            a, b = LAYERS.index(layer(src)), LAYERS.index(layer(dst))
            pair = (technique(src), technique(dst))
            if b > a:
                problems.append(f"{src} ({LAYERS[a]}) imports {dst} ({LAYERS[b]}): upward")
            elif (
                a == b == LAYERS.index("technique") and pair[0] != pair[1] and pair not in COMPOSED
            ):
                problems.append(f"{src} imports {dst}: two techniques, not in COMPOSED")
    return problems


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """A cycle of imports as [a, b, ..., a], or [] if there is none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return []


@pytest.mark.pure
def test_every_module_is_in_a_layer_and_imports_point_down():
    problems = wrong_way(graph())
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


@pytest.mark.pure
def test_the_import_graph_has_no_cycle():
    found = cycle(graph())
    assert not found, "an import cycle: " + " -> ".join(found)


@pytest.mark.pure
def test_every_composed_edge_is_still_an_import():
    """COMPOSED lists real imports only: a stale edge would allow a future one unseen."""
    edges = {(technique(s), technique(d)) for s, ds in graph().items() for d in ds}
    stale = sorted(set(COMPOSED) - edges)
    assert not stale, f"COMPOSED lists imports that no longer exist: {stale}"


@pytest.mark.pure
def test_lessons_import_minidist_only_and_nothing_imports_them():
    for path in sorted(ROOT.glob("lessons/*/*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            local = [n for n in names if n.split(".")[0] in ("lessons", "tests", "tools")]
            assert not local, f"{path.relative_to(ROOT)} imports {local}: lessons import minidist"
    for src, dsts in graph().items():
        assert layer(src) != "lessons" and all(layer(d) != "lessons" for d in dsts), src


@pytest.mark.pure
def test_the_checks_catch_a_cycle_an_upward_import_and_an_unplaced_module():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []
    up = wrong_way({"minidist.collectives.algorithms": {"minidist.zero.stages"}})
    assert up == [
        "minidist.collectives.algorithms (foundation) imports minidist.zero.stages (technique): "
        "upward"
    ]
    sideways = wrong_way({"minidist.mixed_precision.amp": {"minidist.zero.stages"}})
    assert sideways == [
        "minidist.mixed_precision.amp imports minidist.zero.stages: two techniques, not in COMPOSED"
    ]
    assert wrong_way({"minidist.zero.stages": {"minidist.zero.gatherer"}}) == []
    with pytest.raises(pytest.fail.Exception, match="add 'newthing' to MODULES"):
        layer("minidist.newthing")
