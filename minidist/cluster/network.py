"""The network as NCCL drives it: a group's ranks per node, one channel per network card, ring
and tree priced per algorithm, and the choice NCCL makes by size.

Equals: NCCL's own cost model, src/graph/tuning.cc of NVIDIA/nccl (commit 5067397c, 2026; the
constants below are its Simple protocol's, the one large messages take), on the cluster's links
(cluster/hardware.py). Inside one node the lesson-02 ring of hardware.py is kept as it is.
Communication (a group of p = k n ranks, k on each of n nodes; N bytes; B_in a GPU's NVLink;
B_net what the group's k ranks of a node push through the cards: one channel (ring) a card they
reach, at the card's bandwidth, and at most their share of the node's cards when every group
sends at once: k B_g, B_g a GPU's share. Rail-optimized nodes give every GPU its own card, so
B_net = k B_g: a tp group of 16 on two DGX drives 8 cards, a dp group of one rank a node 1):
    ring       all-reduce moves 2 (p-1)/p N through every node's cards and every GPU's NVLink:
               2 (p-1)/p N / min(B_in, B_net) + latency; reduce-scatter, all-gather half that
    tree       all-reduce only: a chain inside the node, a double binary tree across nodes;
               2 N / B_tree, B_tree = min(0.92 B_net, channels x tuning.cc's per-channel tree
               cap, which falls from 1 or 2 nodes to 4 and more: that fall is NCCL's own data)
    latency    tuning.cc: a base per algorithm, then per step inside the node and per step across
               it: ring 2 (p-1) - 2 (n-1) NVLink steps and 2 (n-1) network steps (x 1.4, NCCL's
               "plateau effect of ring" across nodes); tree 2 ((k-1) NVLink + log2 n network)
    hierarchical  reduce-scatter in the node, all-reduce of N/k across nodes (one rank a node,
               each on its own card: ring or tree as NCCL picks), all-gather in the node: it
               pays where a node's cards are few (one shared port), not with a card per GPU,
               where NCCL's rings already carry the node's traffic on every card
NCCL picks, per collective and size, the algorithm of least time (ncclTopoGetAlgoTime): here,
ring or tree for an all-reduce, ring for the others. The achieved bandwidth thus falls with the
node count where latency matters (the ring's steps grow with p, the tree's with log2 n) and the
tree's cap falls from 2 nodes to 4. Not modelled: LL and LL128 protocols (small messages: the
planner's are megabytes), NVLS and CollNet (in-switch reduction), PXN, several channels a card.
Placement: spread() takes a group's stride in the rank order (plan.step uses the framework's:
minidist's mesh puts tp innermost, then cp, pp, dp; Megatron-LM and DeepSpeed put dp before pp:
cluster/profiles.py) and gives (ranks per node, nodes) for nodes filled in order.
Ladder: spread (where a group's ranks sit) -> ring, tree, hierarchical (one algorithm each) ->
collective_seconds (NCCL's choice) -> plan.step (each dimension on its own group).
Paper: Jeaugey, "Massively Scale Your Deep Learning Training with NCCL 2.4" (NVIDIA blog, 2019):
double binary trees. Lesson: lessons/13_beyond_one_machine/.
Run: see tests/test_network.py.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from minidist.cluster.hardware import Cluster

US = 1e-6
# [TUNING] NVIDIA/nccl src/graph/tuning.cc at 5067397c: ncclTunerConstantsDefaults, Simple
# protocol, microseconds: baseLatencies (tree 8.4, ring 8.4); hwLatencies NVLINK (tree 4.0,
# ring 3.4), PCI (tree 4.0, ring 5.7), NET (tree 14, ring 14); intra steps at least the network
# post overhead x 3 (1 us on Intel hosts: 3.0); inter-node ring all-reduce latency x 1.4 from
# compute capability 8.0 (ncclTopoGetAlgoTime: "Plateau effect of ring").
BASE = {"ring": 8.4, "tree": 8.4}
STEP = {"nvlink": {"ring": 3.4, "tree": 4.0}, "pci": {"ring": 5.7, "tree": 4.0}}
NET_STEP = {"ring": 14.0, "tree": 14.0}
RING_PLATEAU = 1.4
# [TUNING] perChMaxTreeBws, GB/s a channel on 1, 2, 4+ nodes (Ampere, Hopper), and the tree's
# bandwidth factor .92 (busBw = min(busBw * .92, nChannels * perChMaxTreeBw))
TREE_CAP = {"A100": (24.0, 23.6, 17.8), "H100": (38.7, 41.4, 36.0)}
TREE_SHARE = 0.92
# [TUNING] treeCorrectionFactor, Simple protocol: the tree's bandwidth at 64 B x 2^i bytes
TREE_CORRECTION = (
    *(0.9,) * 7,
    *(0.8, 0.7, 0.6, 0.6, 0.5, 0.5, 0.5, 0.5, 0.6, 0.7, 0.8, 0.7, 0.7, 0.8, 0.9, 0.9, 0.9),
)
STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}  # x (p - 1) steps of N/p


@dataclass(frozen=True)
class Group:
    """Where a collective's ranks sit: k on each of n nodes (p = k n)."""

    k: int
    n: int

    @property
    def p(self) -> int:
        return self.k * self.n


def spread(stride: int, size: int, g: int) -> Group:
    """A group of `size` ranks `stride` apart in the rank order, on nodes of g filled in order:
    k = min(size, g / stride) of them share a node (1 once stride >= g). A group that cannot
    align with the nodes (tp = 3 on nodes of 8) is priced as if it did: a simplification."""
    k = max(1, min(size, g // stride))
    return Group(k, -(-size // k))


def spread_axes(axes: list[tuple[int, int]], g: int) -> Group:
    """A group made of several axes of the rank order, (stride, size) each, innermost first (dp
    x cp: the cp ranks tp apart, the dp replicas pp cp tp apart): k = the product of each
    axis's ranks on one node, min(size, g / stride) as spread() counts them."""
    p = 1
    k = 1
    for stride, size in axes:
        p *= size
        k *= max(1, min(size, g // stride))
    return Group(k, -(-p // k))


def all_to_all_seconds(cluster: Cluster, group: Group, nbytes: float, efficiency: float = 1.0):
    """Seconds of an all-to-all in which every rank of the group sends nbytes, an equal part to
    each rank (its own part stays): (k-1)/p of it to its node's other ranks on its NVLink and
    (p-k)/p across on its own card (rail-optimized: every GPU of the node sends at once), the
    two at the same time, plus a network latency if the group spans nodes (NCCL runs it as a
    send and a receive to every peer, grouped)."""
    k = group.k
    p = group.p
    if p == 1:
        return 0.0
    inside = (k - 1) / p * nbytes / cluster.intra.bandwidth
    if group.n == 1:
        return cluster.intra.latency + inside
    card = cluster.inter.bandwidth * efficiency / cluster.oversubscription
    return cluster.inter.latency + max(inside, (p - k) / p * nbytes / card)


def _hw(cluster: Cluster) -> str:
    return "nvlink" if "NVLink" in cluster.intra.name else "pci"


def _generation(cluster: Cluster) -> str:
    if cluster.gpu.calibration:
        return cluster.gpu.calibration
    return "H100" if any(name in cluster.gpu.name for name in ("H100", "H200")) else "A100"


def _channels(cluster: Cluster, group: Group) -> int:
    """Rings (channels) a collective of the group runs across nodes: one a card its k GPUs of a
    node reach (min(k, nics)), unless the cluster says (cluster.channels)."""
    return cluster.channels or min(group.k, cluster.nics)


def _network_bandwidth(cluster: Cluster, group: Group, efficiency: float) -> float:
    """B/s a group's k ranks of one node push through the network: its channels at a card's
    bandwidth each (inter.bandwidth x gpus_per_node / nics), at most its k GPUs' share of the
    cards when every group of the node sends at once, over the fabric's oversubscription."""
    card = cluster.inter.bandwidth * cluster.gpus_per_node / cluster.nics
    most = min(_channels(cluster, group) * card, group.k * cluster.inter.bandwidth)
    return most * efficiency / cluster.oversubscription


def inside(cluster: Cluster, kind: str, k: int, nbytes: float) -> float:
    """Seconds of a ring of k ranks of one node (lesson 02): STEPS x (k-1) steps of N/k bytes,
    each alpha + N/(k B) on the node's links."""
    if k == 1:
        return 0.0
    link = cluster.intra
    return STEPS[kind] * (k - 1) * (link.latency + nbytes / k / link.bandwidth)


def ring(cluster: Cluster, kind: str, group: Group, nbytes: float, efficiency: float = 1.0):
    """Seconds of NCCL's ring (Simple) over a group that spans nodes: its bytes through the
    slower of a GPU's NVLink and the node's share of cards, plus tuning.cc's latency."""
    k = group.k
    n = group.n
    p = group.p
    if n == 1:
        return inside(cluster, kind, k, nbytes)
    steps, across = STEPS[kind] * (p - 1), STEPS[kind] * (n - 1)
    net = NET_STEP["ring"] * (RING_PLATEAU if kind == "all_reduce" else 1.0)
    latency = BASE["ring"] + (steps - across) * STEP[_hw(cluster)]["ring"] + across * net
    bandwidth = min(cluster.intra.bandwidth, _network_bandwidth(cluster, group, efficiency))
    return latency * US + steps / p * nbytes / bandwidth


def tree(cluster: Cluster, group: Group, nbytes: float, efficiency: float = 1.0) -> float:
    """Seconds of NCCL's tree all-reduce (Simple) over a group that spans nodes: 2 N over the
    tree's bandwidth (TREE_SHARE of the cards, capped per card by TREE_CAP for this many nodes,
    corrected by size), plus tuning.cc's latency."""
    k, n = group.k, group.n
    if n == 1:
        return inside(cluster, "all_reduce", k, nbytes)
    cap = TREE_CAP[_generation(cluster)][min(n, 3) - 1] * 1e9 * _channels(cluster, group)
    bandwidth = min(TREE_SHARE * _network_bandwidth(cluster, group, efficiency), cap)
    size = int(math.log2(max(nbytes, 64) / 64))
    bandwidth *= TREE_CORRECTION[size] if size < 23 else 1.0  # tuning.cc: logSize < 23
    hw = _hw(cluster)
    hops = (k - 1) * STEP[hw]["tree"] + math.floor(math.log2(n)) * NET_STEP["tree"]
    latency = BASE["tree"] + 2 * hops
    return latency * US + 2 * nbytes / bandwidth


def hierarchical(cluster: Cluster, group: Group, nbytes: float, efficiency: float = 1.0):
    """Seconds of the all-reduce cut in three: reduce-scatter inside the node, all-reduce of the
    N/k shard across the n nodes (k such all-reduces at once, one rank a node, each on its own
    card; NCCL's choice for each), all-gather inside the node."""
    half = inside(cluster, "reduce_scatter", group.k, nbytes)
    shard = nbytes / group.k
    across, _ = collective_seconds(cluster, "all_reduce", Group(1, group.n), shard, efficiency)
    return 2 * half + across


@functools.lru_cache(maxsize=8192)
def collective_seconds(
    cluster: Cluster, kind: str, group: Group, nbytes: float, efficiency: float = 1.0
) -> tuple[float, str]:
    """(seconds, algorithm) of `kind` ("all_reduce", "reduce_scatter", "all_gather") of nbytes
    over the group, as NCCL would run it: the faster of ring and tree for an all-reduce, the
    ring otherwise. efficiency: the fraction of the cards' bandwidth reached (plan.Efficiency)."""
    if group.p == 1:
        return 0.0, "none"
    times = {"ring": ring(cluster, kind, group, nbytes, efficiency)}
    if kind == "all_reduce" and group.n > 1:
        times["tree"] = tree(cluster, group, nbytes, efficiency)
    best = min(times, key=times.get)
    return times[best], best


def p2p_seconds(cluster: Cluster, across: bool, nbytes: float, efficiency: float = 1.0) -> float:
    """One message between two GPUs, every GPU of the node sending at once: inside the node on
    its NVLink, across on its share of the cards (rail-optimized: its own card)."""
    if not across:
        return cluster.intra.latency + nbytes / cluster.intra.bandwidth
    bandwidth = cluster.inter.bandwidth * efficiency / cluster.oversubscription
    return cluster.inter.latency + nbytes / bandwidth
