"""The rank grid of 3D parallelism: world = dp x pp x tp (x cp), and a communicator per axis.

Equals: nothing to match, a layout is data. `Layout` is a pure function of (dp, pp, tp, ep, cp):
the grid is torch.arange(world).view(dp, pp, cp, tp), so rank = ((d * pp + s) * cp + c) * tp + t
(with cp = 1, (d * pp + s) * tp + t). Tensor-parallel
ranks are adjacent: tp moves data inside every layer (several all-reduces per block, forward
and backward) and must stay inside a node's fast links; the pipeline's neighbours are tp ranks
apart, and data-parallel replicas pp*tp ranks apart, across nodes, where the traffic is once
per step (dp) or point to point (pp).
Communication: building a Mesh issues three comm.split calls, collective over the world, in the
order tp, pp, dp. Afterwards tp_comm.rank == t, pp_comm.rank == s, dp_comm.rank == d.
Expert parallelism (ep > 1, lesson 14) is carved out of dp, as in Megatron: each block of ep
adjacent dp ranks shares out the experts (ep_comm, rank d % ep) and the ranks at the same place
in every block hold the same experts (edp_comm, rank d // ep): two more splits, ep then edp,
both at one (stage, cp rank, tp rank): with cp, each cp rank's ep group routes its own tokens.
Context parallelism (cp > 1, lesson 15) sits between pp and tp, next to tp: its ring moves
keys and values in every attention layer. cp_comm (rank c) holds the cp ranks of one replica,
stage and tp rank; dcp_comm (rank d * cp + c) all of dp x cp, over which the gradients are
averaged (every cp rank saw other tokens of the same sequences): two more splits, cp then dcp.
Memory per rank: nothing.
Paper: Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM (SC 2021), section 3 (placement: tensor parallel within a node).
Lesson: lessons/12_3d_parallel/.   Run: minidist train --dp 2 --pp 2 --tp 2 --backend mpi

    8 ranks, dp=2 pp=2 tp=2:      tp groups (adjacent)   pp groups        dp groups
      d=0: s=0 [0 1]  s=1 [2 3]   {0,1} {2,3}            {0,2} {1,3}      {0,4} {1,5}
      d=1: s=0 [4 5]  s=1 [6 7]   {4,5} {6,7}            {4,6} {5,7}      {2,6} {3,7}
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AXES = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Layout:
    """How a world of dp * pp * cp * tp ranks is cut: data, pipeline, context and tensor
    parallel sizes (and expert parallel, carved out of dp)."""

    dp: int
    pp: int
    tp: int
    ep: int = 1  # expert parallel: blocks of ep adjacent dp ranks share out the experts
    cp: int = 1  # context parallel: cp ranks hold the chunks of every sequence

    def __post_init__(self):
        for axis in (*AXES, "ep", "cp"):
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis}={size!r} must be a positive integer")
        if self.dp % self.ep:
            raise ValueError(f"dp={self.dp} is not divisible by ep={self.ep}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def grid(self) -> torch.Tensor:
        """(dp, pp, cp, tp): grid[d, s, c, t] is the world rank at those coordinates."""
        return torch.arange(self.world_size).view(self.dp, self.pp, self.cp, self.tp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(d, s, t) of a world rank: its replica, pipeline stage and tensor-parallel rank
        (its context-parallel rank c: cp_coord)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside a world of {self.world_size}")
        # lab 12.1 begin: invert rank = ((d * pp + s) * cp + c) * tp + t: divmods, c dropped
        d, rest = divmod(rank, self.pp * self.cp * self.tp)
        s, rest = divmod(rest, self.cp * self.tp)
        return d, s, rest % self.tp
        # lab 12.1 end

    def cp_coord(self, rank: int) -> int:
        """c of a world rank: which of its sequences' chunks it holds (0 when cp = 1)."""
        return rank // self.tp % self.cp

    def rank(self, d: int, s: int, t: int, c: int = 0) -> int:
        """The world rank at coordinates (d, s, t) and context-parallel rank c."""
        return ((d * self.pp + s) * self.cp + c) * self.tp + t

    def group(self, rank: int, axis: str) -> list[int]:
        """The world ranks that share `rank`'s other two coordinates: its group along axis,
        in increasing order (so the group's rank i is coordinate i along the axis)."""
        # lab 12.2 begin: fix rank's other coordinates, slice self.grid along axis
        (d, s, t), c = self.coords(rank), self.cp_coord(rank)
        if axis == "tp":
            return self.grid[d, s, c, :].tolist()
        if axis == "pp":
            return self.grid[d, :, c, t].tolist()
        if axis == "dp":
            return self.grid[:, s, c, t].tolist()
        # lab 12.2 end
        if axis == "cp":  # the ranks holding the other chunks of the same sequences
            return self.grid[d, s, :, t].tolist()
        if axis == "dcp":  # every replica's every chunk: where the gradients are averaged
            return self.grid[:, s, :, t].reshape(-1).tolist()
        if axis == "ep":  # its block of ep dp ranks: together they hold every expert once
            lo = d // self.ep * self.ep
            return self.grid[lo : lo + self.ep, s, c, t].tolist()
        if axis == "edp":  # the same place in every block: the replicas of its experts
            return self.grid[d % self.ep :: self.ep, s, c, t].tolist()
        raise ValueError(f"axis={axis!r} is not one of {(*AXES, 'cp', 'dcp', 'ep', 'edp')}")

    def color(self, rank: int, axis: str) -> int:
        """A number shared exactly by the ranks of rank's group along axis: the split color."""
        return self.group(rank, axis)[0]

    def check(self, world_size: int) -> Layout:
        """self, if it fills world_size ranks exactly; else a ValueError naming every factor."""
        if world_size != self.world_size:
            cp = f" * cp={self.cp}" if self.cp > 1 else ""
            raise ValueError(
                f"world_size={world_size} != dp={self.dp} * pp={self.pp}{cp} * tp={self.tp}"
                f" = {self.world_size}"
            )
        return self


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the grid and its sub-communicators (and the world's)."""

    layout: Layout
    world: object  # Comm
    dp_comm: object
    pp_comm: object
    tp_comm: object
    ep_comm: object = None  # with ep > 1 only: expert parallelism's all-to-all group
    edp_comm: object = None  # with ep > 1 only: the replicas of this rank's experts
    cp_comm: object = None  # with cp > 1 only: context parallelism's ring
    dcp_comm: object = None  # with cp > 1 only: dp x cp, where gradients are averaged

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.layout.coords(self.world.rank)

    @property
    def cp_coord(self) -> int:
        return self.layout.cp_coord(self.world.rank)

    @property
    def grad_comm(self):
        """Where the replicas average their gradients: dp_comm, or dp x cp with cp > 1."""
        return self.dp_comm if self.dcp_comm is None else self.dcp_comm


def make_mesh(comm, layout: Layout) -> Mesh:
    """Split comm into this rank's tp, pp and dp groups (collective: every rank calls it).

    Checks the layout before any communication, with the numbers; then checks what the
    splits returned, so a backend that orders a split's ranks otherwise fails here, loudly."""
    layout.check(comm.world_size)
    # lab 12.3 begin: split comm once per axis, in the order tp, pp, dp, by the axis's color
    subs = {axis: comm.split(layout.color(comm.rank, axis)) for axis in ("tp", "pp", "dp")}
    # lab 12.3 end
    for axis, coordinate in zip(AXES, layout.coords(comm.rank), strict=True):
        sub, size = subs[axis], getattr(layout, axis)
        if (sub.rank, sub.world_size) != (coordinate, size):
            raise RuntimeError(
                f"rank {comm.rank}: its {axis} group has rank {sub.rank} of {sub.world_size},"
                f" expected {coordinate} of {size}"
            )
    d, c = layout.coords(comm.rank)[0], layout.cp_coord(comm.rank)
    more = {}  # each pair split only when its axis is used, so other layouts split as before
    if layout.cp > 1:  # cp then dcp
        more |= _split_checked(comm, layout, {"cp": c, "dcp": d * layout.cp + c})
    if layout.ep > 1:  # ep carved out of dp, as Megatron places it: ep then edp
        more |= _split_checked(comm, layout, {"ep": d % layout.ep, "edp": d // layout.ep})
    more = {f"{axis}_comm": sub for axis, sub in more.items()}
    return Mesh(layout, comm, subs["dp"], subs["pp"], subs["tp"], **more)


def _split_checked(comm, layout: Layout, want: dict[str, int]) -> dict:
    """{axis: comm.split by the axis's color}, each checked to give this rank the rank want."""
    subs = {}
    for axis, rank in want.items():
        subs[axis] = comm.split(layout.color(comm.rank, axis))
        if subs[axis].rank != rank:
            raise RuntimeError(
                f"rank {comm.rank}: its {axis} group has rank {subs[axis].rank}, not {rank}"
            )
    return subs
