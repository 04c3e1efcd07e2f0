"""The hierarchical all-reduce: the rings of lesson 02 arranged by node, so only 1/g of the data
crosses the slow links between nodes.

Equals: ring_all_reduce over all p = n g ranks, bitwise for integer-valued data in every dtype
(tests/test_cluster.py); floats may differ in the last bits (another order of additions), and
every rank ends with bitwise the same tensor.
Communication per step, per rank (g ranks a node, n nodes, N elements of b bytes, only
point-to-point):
    inside the node   2 (g-1)/g N b, all to the node's next rank (a reduce-scatter and an
                      all-gather)
    across nodes      2 (n-1)/n N b / g, to the same local rank on the next node
    (the flat ring sends 2 (p-1)/p N b, most of it across nodes when the ring spans them)
Memory per rank: the ring's two fragments (at most 2 FRAGMENT_BYTES) extra; N b more when the
tensor is not contiguous.
Ladder: node_comms (the two groups a rank belongs to) -> hierarchical_all_reduce (three rings
from lesson 02, composed); cluster/hardware.py prices it (hierarchical_all_reduce_seconds).
Paper: Jia et al., "Highly Scalable Deep Learning Training System with Mixed-Precision: Training
ImageNet in Four Minutes" (arXiv:1807.11205, 2018): the hierarchical all-reduce; Thakur,
Rabenseifner, Gropp (IJHPCA 2005) for the rings.
Lesson: lessons/13_beyond_one_machine/.   Run: python lessons/13_beyond_one_machine/demo.py
"""

from __future__ import annotations

import torch

from minidist.collectives.algorithms import (
    chunk_bounds,
    copy_back,
    flat_view,
    ring_all_gather_flat,
    ring_all_reduce,
    ring_reduce_scatter_flat,
)
from minidist.comm.protocol import Comm, check_op
from minidist.comm.tagged import tag_of, tagged


def node_comms(comm: Comm, ranks_per_node: int) -> tuple[Comm, Comm]:
    """(node_comm, cross_comm): the ranks on this rank's node (rank // ranks_per_node) and those
    in its place on every node. Collective (two splits): make them once, not per call."""
    if ranks_per_node < 1 or comm.world_size % ranks_per_node:
        raise ValueError(f"world_size={comm.world_size} is not divisible by {ranks_per_node=}")
    node_comm = comm.split(comm.rank // ranks_per_node)
    cross_comm = comm.split(comm.rank % ranks_per_node)
    return node_comm, cross_comm


def hierarchical_all_reduce(
    t: torch.Tensor, node_comm: Comm, cross_comm: Comm, op: str = "sum"
) -> torch.Tensor:
    """All-reduce t in place, only a 1/g shard of it across nodes (g ranks a node, n nodes).

    Each rank: t any shape, the same on every rank. Ring reduce-scatter in the node (local rank
    l holds chunk l), ring all-reduce of chunk l among the n ranks holding it (cross_comm: the g
    chunks cross the network at once, each on its own rank's link), ring all-gather in the node.
    Sends 2 (g-1)/g N b in the node and 2 (n-1)/n N b / g across (the flat ring: 2 (p-1)/p N b).
    """
    check_op(op, t.dtype)
    # its own tag in the node; across, ring_all_reduce tags its messages itself
    node_comm = tagged(node_comm, tag_of("hierarchical_all_reduce", op))
    flat = flat_view(t)  # (N,)
    inner = "sum" if op == "avg" else op  # divide once, by p, after step 2
    ring_reduce_scatter_flat(flat, node_comm, inner)
    lo, hi = chunk_bounds(flat.numel(), node_comm.world_size)[node_comm.rank]
    ring_all_reduce(flat[lo:hi], cross_comm, inner)  # (N/g,) a view of flat: reduced in place
    if op == "avg":  # before the all-gather: every rank gets the same quotients
        flat[lo:hi].div_(node_comm.world_size * cross_comm.world_size)
    ring_all_gather_flat(flat, node_comm)
    return copy_back(t, flat)
