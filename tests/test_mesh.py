"""The dp x pp x tp rank grid: pure layout maths, and the sub-communicators it splits.

The module under test comes from impl("mesh"), inside each test (inside the rank function for
processes), so `make lab L=12` grades a learner's lessons/12_3d_parallel/lab.py with these
tests. Expected groups are written out by hand or from the grid's definition, never from the
module's own group().
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist.testing import impl, run_ranks, run_threads, verdict

sizes = st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))


def expected_group(dp: int, pp: int, tp: int, rank: int, axis: str) -> list[int]:
    """The ranks that agree with rank on the other two coordinates, by brute force from
    rank = (d * pp + s) * tp + t (not from the module's own group)."""

    def coords(r: int) -> dict:
        return {"dp": r // (pp * tp), "pp": r // tp % pp, "tp": r % tp}

    mine = coords(rank)
    others = [a for a in ("dp", "pp", "tp") if a != axis]
    return [r for r in range(dp * pp * tp) if all(coords(r)[a] == mine[a] for a in others)]


@pytest.mark.pure
@settings(max_examples=200, deadline=None)
@given(sizes)
def test_coords_and_ranks_are_inverse(dp_pp_tp):
    layout = impl("mesh").Layout(*dp_pp_tp)
    grid = layout.grid
    for rank in range(layout.world_size):
        d, s, t = layout.coords(rank)
        assert layout.rank(d, s, t) == rank == grid[d, s, 0, t]


@pytest.mark.pure
@settings(max_examples=200, deadline=None)
@given(sizes)
def test_groups_are_the_grids_slices_and_tp_is_adjacent(dp_pp_tp):
    layout = impl("mesh").Layout(*dp_pp_tp)
    for rank in range(layout.world_size):
        # the coordinates from the grid's definition, not from coords() (lab 12.1)
        d = rank // (layout.pp * layout.tp)
        s = rank // layout.tp % layout.pp
        t = rank % layout.tp
        tp = layout.group(rank, "tp")
        assert tp == list(range(tp[0], tp[0] + layout.tp)), "tp ranks must be adjacent"
        for axis, coordinate in zip(("dp", "pp", "tp"), (d, s, t), strict=True):
            group = layout.group(rank, axis)
            assert group == expected_group(*dp_pp_tp, rank, axis), (rank, axis)
            assert group.index(rank) == coordinate  # the group's rank i is coordinate i
            # the groups along one axis partition the world: same color <=> same group
            same = [r for r in range(layout.world_size) if layout.color(r, axis) == group[0]]
            assert same == group


@pytest.mark.pure
def test_the_picture_in_the_docstring():
    layout = impl("mesh").Layout(2, 2, 2)
    assert [layout.coords(r) for r in (0, 3, 5, 6)] == [(0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0)]


@pytest.mark.pure
def test_the_groups_in_the_docstrings_picture():
    layout = impl("mesh").Layout(2, 2, 2)
    assert [layout.group(r, "tp") for r in (0, 2, 4, 6)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [layout.group(r, "pp") for r in (0, 1, 4, 5)] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [layout.group(r, "dp") for r in (0, 1, 2, 3)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.pure
def test_bad_layouts_are_refused_naming_every_factor():
    Layout = impl("mesh").Layout
    with pytest.raises(ValueError, match=r"world_size=6 != dp=2 \* pp=2 \* tp=2 = 8"):
        Layout(2, 2, 2).check(6)
    with pytest.raises(ValueError, match="tp=0 must be a positive integer"):
        Layout(1, 1, 0)
    with pytest.raises(ValueError, match="rank=8 is outside a world of 8"):
        Layout(2, 2, 2).coords(8)
    with pytest.raises(ValueError, match="axis='xp'"):
        Layout(2, 2, 2).group(0, "xp")
    with pytest.raises(ValueError, match="dp=6 is not divisible by ep=4"):
        Layout(6, 1, 2, ep=4)
    with pytest.raises(ValueError, match="ep=0 must be a positive integer"):
        Layout(2, 1, 1, ep=0)


@pytest.mark.pure
@settings(max_examples=100, deadline=None)
@given(sizes, st.integers(1, 4))
def test_ep_blocks_of_adjacent_dp_ranks_and_their_replicas(dp_pp_tp, ep):
    """ep: blocks of ep consecutive dp coordinates (same pp, tp); edp: the same place (d % ep)
    in every block. Brute force from the coordinates, not from group()."""
    dp, pp, tp = dp_pp_tp
    layout = impl("mesh").Layout(dp * ep, pp, tp, ep)
    for rank in range(layout.world_size):
        d, s, t = layout.coords(rank)
        peers = [r for r in range(layout.world_size) if layout.coords(r)[1:] == (s, t)]
        block = [r for r in peers if layout.coords(r)[0] // ep == d // ep]
        replicas = [r for r in peers if layout.coords(r)[0] % ep == d % ep]
        assert layout.group(rank, "ep") == block and block.index(rank) == d % ep
        assert layout.group(rank, "edp") == replicas and replicas.index(rank) == d // ep


@pytest.mark.pure
@settings(max_examples=100, deadline=None)
@given(sizes, st.integers(1, 3))
def test_cp_sits_between_pp_and_tp(dp_pp_tp, cp):
    """rank = ((d pp + s) cp + c) tp + t; cp: the same (d, s, t); dcp: the same (s, t).
    Brute force from that formula, not from group()."""
    dp, pp, tp = dp_pp_tp
    layout = impl("mesh").Layout(dp, pp, tp, cp=cp)
    place = {
        ((d * pp + s) * cp + c) * tp + t: (d, s, c, t)
        for d in range(dp)
        for s in range(pp)
        for c in range(cp)
        for t in range(tp)
    }
    assert sorted(place) == list(range(layout.world_size))
    for rank, (d, s, c, t) in place.items():
        assert (layout.coords(rank), layout.cp_coord(rank)) == ((d, s, t), c)
        assert layout.rank(d, s, t, c) == rank == layout.grid[d, s, c, t]
        want = [r for r, x in place.items() if (x[0], x[1], x[3]) == (d, s, t)]
        assert layout.group(rank, "cp") == want and want.index(rank) == c
        want = [r for r, x in place.items() if (x[1], x[3]) == (s, t)]
        assert layout.group(rank, "dcp") == want and want.index(rank) == d * cp + c
        want = [r for r, x in place.items() if (x[0], x[1], x[2]) == (d, s, c)]
        assert layout.group(rank, "tp") == want, "tp ranks stay adjacent"


def cp_members(comm, layout) -> tuple:
    """The world ranks in this rank's cp and dcp comms, and its rank in each."""
    mesh = impl("mesh").make_mesh(comm, layout)
    found = []
    for sub in (mesh.cp_comm, mesh.dcp_comm):
        members = torch.empty(sub.world_size, dtype=torch.int64)
        sub.all_gather(members, torch.tensor([comm.rank]))
        found.append((members.tolist(), sub.rank))
    return tuple(found)


@pytest.mark.threads
def test_make_mesh_splits_cp_and_dp_x_cp():
    layout = impl("mesh").Layout(2, 1, 2, cp=2)
    for rank, (cp, dcp) in enumerate(run_threads(cp_members, 8, layout)):
        assert cp[0] == layout.group(rank, "cp") and cp[1] == layout.cp_coord(rank), rank
        assert dcp[0] == layout.group(rank, "dcp"), rank


def ep_members(comm, layout) -> tuple:
    """The world ranks in this rank's ep and edp comms, and its rank in each."""
    mesh = impl("mesh").make_mesh(comm, layout)
    found = []
    for sub in (mesh.ep_comm, mesh.edp_comm):
        members = torch.empty(sub.world_size, dtype=torch.int64)
        sub.all_gather(members, torch.tensor([comm.rank]))
        found.append((members.tolist(), sub.rank))
    return tuple(found)


@pytest.mark.threads
@pytest.mark.parametrize("dp_pp_tp_ep", [(4, 1, 1, 2), (2, 2, 1, 2), (6, 1, 1, 3), (4, 1, 2, 4)])
def test_make_mesh_splits_ep_and_its_replicas(dp_pp_tp_ep):
    layout = impl("mesh").Layout(*dp_pp_tp_ep)
    for rank, (ep, edp) in enumerate(run_threads(ep_members, layout.world_size, layout)):
        assert ep == (layout.group(rank, "ep"), layout.coords(rank)[0] % layout.ep), rank
        assert edp == (layout.group(rank, "edp"), layout.coords(rank)[0] // layout.ep), rank


def mesh_groups(comm, dp_pp_tp: tuple[int, int, int]) -> dict:
    """Each sub-comm's members, learned by all-gathering world ranks over it, and the mesh's
    coordinates of this rank."""
    mesh = impl("mesh").make_mesh(comm, impl("mesh").Layout(*dp_pp_tp))
    found = {"coords": mesh.coords}
    for axis in ("dp", "pp", "tp"):
        sub = getattr(mesh, f"{axis}_comm")
        members = torch.empty(sub.world_size, dtype=torch.int64)
        sub.all_gather(members, torch.tensor([comm.rank]))
        found[axis] = members.tolist()
    return found


def mesh_problems(found: dict, dp_pp_tp: tuple[int, int, int], rank: int) -> list[str]:
    """What in one rank's mesh_groups differs from the grid's definition."""
    dp, pp, tp = dp_pp_tp
    want = {axis: expected_group(dp, pp, tp, rank, axis) for axis in ("dp", "pp", "tp")}
    want["coords"] = (rank // (pp * tp), rank // tp % pp, rank % tp)
    return [
        f"rank {rank} of {dp_pp_tp}: {k} {found[k]} != {v}"
        for k, v in want.items()
        if found[k] != v
    ]


@pytest.mark.threads
@pytest.mark.parametrize("dp_pp_tp", [(1, 1, 1), (2, 2, 2), (3, 1, 2), (1, 4, 2), (2, 3, 1)])
def test_sub_communicators_hold_the_layouts_groups(dp_pp_tp):
    dp, pp, tp = dp_pp_tp
    results = run_threads(mesh_groups, dp * pp * tp, dp_pp_tp)
    problems = [
        p for rank, found in enumerate(results) for p in mesh_problems(found, dp_pp_tp, rank)
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.threads
def test_make_mesh_refuses_a_wrong_world_before_communicating():
    def wrong(comm):
        with pytest.raises(ValueError, match=r"world_size=3 != dp=2 \* pp=1 \* tp=2 = 4"):
            impl("mesh").make_mesh(comm, impl("mesh").Layout(2, 1, 2))

    run_threads(wrong, 3)


def meshes_in_ranks(comm) -> int:
    """Every layout of every sub-world of 1..world ranks (sub-worlds by comm.split), in one
    launch: 13 layouts at world 4, few enough to try them all instead of drawing some. One
    verdict over the world per layout, so every rank fails together, naming the culprits."""
    subs = {k: comm.split(int(comm.rank < k)) for k in range(1, comm.world_size + 1)}
    tried = 0
    for k, sub in subs.items():
        for dp_pp_tp in [
            (k // (pp * tp), pp, tp)
            for pp in range(1, k + 1)
            for tp in range(1, k + 1)
            if k % (pp * tp) == 0
        ]:
            problems = []
            if comm.rank < k:
                problems = mesh_problems(mesh_groups(sub, dp_pp_tp), dp_pp_tp, comm.rank)
            verdict(comm, not problems, "; ".join(problems))
            tried += 1
    return tried


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_sub_communicators_hold_the_layouts_groups_processes(backend):
    assert run_ranks(meshes_in_ranks, 4, backend, timeout=120) == [13] * 4
