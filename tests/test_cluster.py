"""The cluster as data (minidist/cluster/hardware.py) and the hierarchical all-reduce it prices.

Tier 0: the presets are well-formed and their formulas are the documented ones; the model's
qualitative claims (the hierarchy beats the flat ring across nodes; trees win small messages
at many ranks) hold on the presets. Tiers 1-2: hierarchical.hierarchical_all_reduce equals the
exact reduction (integer-valued data: exact in every dtype) and bitwise the flat ring, for
every op, dtype, layout and nodes x ranks-per-node, and each rank sends exactly the bytes of
cluster.hierarchical_sent_nbytes inside and across nodes.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from minidist.collectives.algorithms import ring_all_reduce
from minidist.collectives.hierarchical import hierarchical_all_reduce, node_comms
from minidist.comm.wrappers import Counter, ObservedComm
from minidist.testing import (
    RANK_SETTINGS,
    all_dtypes,
    check_all,
    impl,
    integer_valued,
    ops,
    reduce_expected,
    run_ranks,
    run_threads,
    seeds,
    shapes,
    verdict,
)

MiB = 1 << 20


def C():
    """The module under test (make lab L=13 swaps in lessons/13_beyond_one_machine/lab.py)."""
    return impl("cluster.hardware")


# ---- tier 0: the data and the formulas ---------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize("name", ["dgx-a100", "dgx-h100", "dgx-h200", "pcie-a100"])
def test_presets_are_well_formed(name):
    c = C().preset(name)
    assert c.gpus_per_node >= 1 and c.node_watts > c.gpus_per_node * c.gpu.watts * 0.5
    assert c.gpu.peak_flops > 1e14 and c.gpu.memory >= 80e9 and c.gpu.memory_bw > 1e12
    assert c.intra.bandwidth > c.inter.bandwidth > 0, "a node's links outrun its network"
    assert 0 < c.intra.latency <= c.inter.latency < 1e-4
    assert 1.0 <= c.pue < 2.0 and c.usd_per_gpu_hour > 0


@pytest.mark.pure
def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown cluster preset 'dgx-z'.*dgx-a100"):
        C().preset("dgx-z")


@pytest.mark.pure
def test_links_by_node():
    c = C()
    h100 = c.preset("dgx-h100")
    assert h100.node_of(7) == 0 and h100.node_of(8) == 1
    assert h100.link(0, 7) == h100.intra and h100.link(7, 8).name == h100.inter.name
    tapered = c.Cluster(**{**h100.__dict__, "oversubscription": 2.0})
    assert tapered.link(0, 8).bandwidth == h100.inter.bandwidth / 2
    n = 4 * MiB
    want = h100.inter.latency + n / h100.inter.bandwidth
    assert c.message_seconds(h100, 3, 12, n) == pytest.approx(want, rel=1e-12)


@pytest.mark.pure
@pytest.mark.parametrize("p", [1, 2, 8, 16, 64])
def test_formulas_as_documented(p):
    c = C()
    h100, n = c.preset("dgx-h100"), 256 * MiB
    slow = h100.intra if p <= 8 else h100.inter
    ring = c.ring_all_reduce_seconds(h100, p, n)
    if p <= 8:  # one node: lesson 02's formula, every step waits for the one before
        want = 2 * (p - 1) * (slow.latency + n / p / slow.bandwidth)
        assert ring == pytest.approx(want, rel=1e-12)
        assert c.hierarchical_all_reduce_seconds(h100, p, n) == pytest.approx(ring)
    else:  # the network link streams every step's chunk: at least 2 (p-1)/p N / B
        assert ring >= 2 * (p - 1) / p * n / slow.bandwidth
    tree = 2 * (math.ceil(math.log2(p)) * slow.latency + n / slow.bandwidth) if p > 1 else 0
    assert c.tree_all_reduce_seconds(h100, p, n) == pytest.approx(tree, rel=1e-12)


@pytest.mark.pure
def test_hierarchy_beats_the_flat_ring_across_nodes_and_trees_win_small_messages():
    c = C()
    h100, p = c.preset("dgx-h100"), 64  # 8 nodes x 8 GPUs
    big, small = 1 << 30, 1 << 10
    flat = c.ring_all_reduce_seconds(h100, p, big)
    hier = c.hierarchical_all_reduce_seconds(h100, p, big)
    # the flat ring moves 2 (p-1)/p N over the network, the hierarchy 2 (n-1)/n N/g
    assert 4 < flat / hier < 8, (flat, hier)
    tree = c.tree_all_reduce_seconds(h100, p, small)
    assert tree < c.ring_all_reduce_seconds(h100, p, small)
    with pytest.raises(ValueError, match="p=12 ranks do not fill whole nodes of 8"):
        c.hierarchical_all_reduce_seconds(h100, 12, big)


@pytest.mark.pure
def test_calibrated_fits_a_and_b():
    a, bw = 2e-6, 8e9
    rows = [{"nbytes": n, "time_us": (a + n / bw) * 1e6} for n in (1024, 65536, 4 * MiB)]
    link = C().calibrated(rows)
    assert link.latency == pytest.approx(a, rel=1e-9) and link.bandwidth == pytest.approx(bw)
    with pytest.raises(ValueError, match="at least two message sizes"):
        C().calibrated(rows[:1])
    machine = C().this_machine(link, flops=5e10, cores=2)
    assert machine.link(0, 1) == link and machine.gpus_per_node == 2


@pytest.mark.pure
def test_wave_share_counts_tiles_and_waves():
    a100 = C().PRESETS["dgx-a100"].gpu
    assert a100.sms == 108
    # 256 x 128 tiles: 108 x 108 of them fill 108 waves exactly, forward and both gradients
    assert C().wave_share(a100, 256 * 108, [(128 * 108, 128 * 108)]) == pytest.approx(1.0)
    # one tile forward and one for the input's gradient (1/108 of a wave each), half a tile
    # for the weight's (1/216): three passes of equal FLOPs over 108 + 108 + 216 units of time
    assert C().wave_share(a100, 256, [(128, 128)]) == pytest.approx(3 / 432)
    cpu = C().this_machine(C().NVLINK3, flops=5e10, cores=2).gpu
    assert cpu.sms == 0 and C().wave_share(cpu, 256, [(128, 128)]) == 1.0


# ---- tiers 1-2: the hierarchical all-reduce, run for real --------------------------------


def hierarchical_case(comm, subs, g, op, dtype, shape, seed) -> None:
    """On the first n*g ranks: hierarchical_all_reduce equals the exact reduction and, bitwise,
    the flat ring; bytes inside and across nodes equal the formula (N divisible by n*g)."""
    node_comm, cross_comm = subs[g]
    p, r = node_comm.world_size * cross_comm.world_size, comm.rank
    xs = [integer_valued(shape, dtype, seed, rank=i) for i in range(p)]
    context = f"hierarchical n={p // g} g={g} {shape} {dtype} op={op}"
    if op == "avg" and not dtype.is_floating_point:
        try:
            hierarchical_all_reduce(xs[r].clone(), node_comm, cross_comm, op)
            problem = "accepted avg on an integer dtype"
        except ValueError:
            problem = ""
        return verdict(comm, not problem, f"{context}: {problem}")
    inside, across = Counter(), Counter()
    x = xs[r].clone()
    hierarchical_all_reduce(
        x, ObservedComm(node_comm, inside), ObservedComm(cross_comm, across), op
    )
    flat = ring_all_reduce(xs[r].clone(), subs["flat", p], op)
    pairs = {"hierarchical vs ring": (x, flat), "exact": (x, reduce_expected(xs, op))}
    nbytes = x.numel() * x.element_size()
    if x.numel() % p == 0:
        want = impl("cluster.hardware").hierarchical_sent_nbytes(p, g, nbytes)
        pairs["bytes intra, inter"] = (
            torch.tensor([inside.bytes_sent, across.bytes_sent], dtype=torch.float64),
            torch.tensor([want["intra"], want["inter"]], dtype=torch.float64),
        )
    check_all(comm, pairs, context=context)


# the process tier's fixed cases on 4 ranks (the threads tier draws the sweep): 2 nodes of 2,
# 4 of 1 and 1 of 4; each op; float, half, integer and bool data; uneven, 0-d and empty shapes
HARD = [
    dict(g=2, op="sum", dtype=torch.float32, shape=(7, 3), seed=1),
    dict(g=1, op="max", dtype=torch.bfloat16, shape=(5,), seed=2),
    dict(g=4, op="avg", dtype=torch.int64, shape=(9,), seed=3),
    dict(g=2, op="min", dtype=torch.bool, shape=(), seed=4),
    dict(g=2, op="sum", dtype=torch.float16, shape=(0, 2), seed=5),
]


def layouts_in_ranks(comm, max_examples: int) -> int:
    """The fixed cases, then hypothesis (the same cases everywhere) inside every rank: each
    case picks g, a divisor of the world size, and all ranks run it as world_size/g nodes of g.
    The comms are split once, before any example."""
    p = comm.world_size
    subs = {("flat", p): comm}
    for g in (d for d in range(1, p + 1) if p % d == 0):
        subs[g] = node_comms(comm, g)
        for sub in subs[g]:
            sub.timeout = 15.0  # a correct case takes milliseconds: fail a deadlock fast
    divisors = sorted(k for k in subs if isinstance(k, int))
    count = [0]

    # no shrinking: a failing case may cost a timeout per try; the threads tier shrinks
    phases = [Phase.explicit, Phase.generate] if max_examples else [Phase.explicit]

    @settings(RANK_SETTINGS, max_examples=max(max_examples, 1), phases=phases)
    @given(st.sampled_from(divisors), ops, all_dtypes, shapes(max_side=6), seeds)
    def prop(g, op, dtype, shape, seed):
        count[0] += 1
        problem = ""
        try:
            hierarchical_case(comm, subs, g, op, dtype, shape, seed)
        except Exception as e:  # through a verdict: every rank fails together, in step
            problem = f"{type(e).__name__}: {e}"[:2000].encode("ascii", "replace").decode()
        verdict(comm, not problem, problem)

    for case in HARD:
        prop = example(**case)(prop)
    prop()
    return count[0]


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_hierarchical_all_reduce_processes(backend):
    counts = run_ranks(layouts_in_ranks, 4, backend, 0, timeout=120)
    assert counts == [len(HARD)] * 4, counts  # every rank ran the same cases


@pytest.mark.threads
@pytest.mark.parametrize("nodes,g", [(1, 1), (1, 4), (4, 1), (2, 2), (2, 3), (3, 2), (2, 4)])
@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(ops, all_dtypes, shapes(max_side=7), seeds)
def test_hierarchical_all_reduce_threads(nodes, g, op, dtype, shape, seed):
    run_threads(_one_layout, nodes * g, g, op, dtype, shape, seed, timeout=20, comm_timeout=4)


def _one_layout(comm, g, op, dtype, shape, seed) -> None:
    subs = {g: node_comms(comm, g), ("flat", comm.world_size): comm}
    hierarchical_case(comm, subs, g, op, dtype, shape, seed)


def _bytes_sent(comm, g: int, n_elements: int) -> dict:
    node_comm, cross_comm = node_comms(comm, g)
    inside, across = Counter(), Counter()
    x = torch.ones(n_elements, dtype=torch.float32)
    hierarchical_all_reduce(x, ObservedComm(node_comm, inside), ObservedComm(cross_comm, across))
    return {
        "intra": inside.bytes_sent,
        "inter": across.bytes_sent,
        "ok": bool((x == 1.0 * comm.world_size).all()),
    }


@pytest.mark.threads
@pytest.mark.parametrize("nodes,g", [(1, 4), (4, 1), (2, 2), (2, 4), (4, 2), (3, 3)])
def test_hierarchical_bytes_inside_and_across_nodes(nodes, g):
    p = nodes * g
    n_elements = 12 * p
    want = impl("cluster.hardware").hierarchical_sent_nbytes(p, g, n_elements * 4)
    for r, got in enumerate(run_threads(_bytes_sent, p, g, n_elements)):
        assert got == {**want, "ok": True}, f"rank {r}: {got}, formula {want}"


def _refuses_partial_nodes(comm) -> str:
    try:
        node_comms(comm, 3)
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.threads
def test_node_comms_refuses_partial_nodes():
    got = run_threads(_refuses_partial_nodes, 4)
    assert got == ["world_size=4 is not divisible by ranks_per_node=3"] * 4, got
