"""The dp x pp x tp rank grid: pure layout maths, and the sub-communicators it splits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist.mesh import Layout, make_mesh
from minidist.testing import run_threads

layouts = st.builds(Layout, st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))


@pytest.mark.pure
@settings(max_examples=200, deadline=None)
@given(layouts)
def test_coords_and_ranks_are_inverse_and_tp_is_adjacent(layout):
    grid = layout.grid
    for rank in range(layout.world_size):
        d, s, t = layout.coords(rank)
        assert layout.rank(d, s, t) == rank == grid[d, s, t]
        tp = layout.group(rank, "tp")
        assert tp == list(range(tp[0], tp[0] + layout.tp)), "tp ranks must be adjacent"
        for axis, coordinate in zip(("dp", "pp", "tp"), (d, s, t), strict=True):
            group = layout.group(rank, axis)
            assert len(group) == getattr(layout, axis)
            assert group.index(rank) == coordinate  # the group's rank i is coordinate i
            # the groups along one axis partition the world: same color <=> same group
            same = [r for r in range(layout.world_size) if layout.color(r, axis) == group[0]]
            assert same == group


@pytest.mark.pure
def test_the_picture_in_the_docstring():
    layout = Layout(2, 2, 2)
    assert [layout.group(r, "tp") for r in (0, 2, 4, 6)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [layout.group(r, "pp") for r in (0, 1, 4, 5)] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [layout.group(r, "dp") for r in (0, 1, 2, 3)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.pure
def test_bad_layouts_are_refused_naming_every_factor():
    with pytest.raises(ValueError, match=r"world_size=6 != dp=2 \* pp=2 \* tp=2 = 8"):
        Layout(2, 2, 2).check(6)
    with pytest.raises(ValueError, match="tp=0 must be a positive integer"):
        Layout(1, 1, 0)
    with pytest.raises(ValueError, match="rank=8 is outside a world of 8"):
        Layout(2, 2, 2).coords(8)
    with pytest.raises(ValueError, match="axis='ep'"):
        Layout(2, 2, 2).group(0, "ep")


def mesh_groups(comm, layout: Layout) -> dict:
    """Each sub-comm's members, learned by all-gathering world ranks over it."""
    mesh = make_mesh(comm, layout)
    found = {}
    for axis in ("dp", "pp", "tp"):
        sub = getattr(mesh, f"{axis}_comm")
        members = torch.empty(sub.world_size, dtype=torch.int64)
        sub.all_gather(members, torch.tensor([comm.rank]))
        found[axis] = members.tolist()
    return found


@pytest.mark.threads
@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (2, 2, 2), (3, 1, 2), (1, 4, 2), (2, 3, 1)])
def test_sub_communicators_hold_the_layouts_groups(dp, pp, tp):
    layout = Layout(dp, pp, tp)
    results = run_threads(mesh_groups, layout.world_size, layout)
    for rank, found in enumerate(results):
        for axis in ("dp", "pp", "tp"):
            assert found[axis] == layout.group(rank, axis), (rank, axis)


@pytest.mark.threads
def test_make_mesh_refuses_a_wrong_world_before_communicating():
    def wrong(comm):
        with pytest.raises(ValueError, match=r"world_size=3 != dp=2 \* pp=1 \* tp=2 = 4"):
            make_mesh(comm, Layout(2, 1, 2))

    run_threads(wrong, 3)
