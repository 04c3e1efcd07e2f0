"""The network as NCCL drives it (minidist/cluster/network.py) and the step model that uses it.

Tier 0: each algorithm's time is the formula its docstring states (tuning.cc's latencies, one
ring a card); NCCL's choice is the faster; the properties the lesson claims hold on the presets
(eight cards make a tp group of 16 on two nodes about eight times faster than one card's ring;
trees win small messages across many nodes; achieved bandwidth falls with the node count); the
step model prices tp across nodes on the cards and holds nothing proportional to the GPU count.
"""

from __future__ import annotations

import math
import os
import re
import time
import tracemalloc
from dataclasses import replace

import pytest

from minidist.cluster import hardware, network, plan
from minidist.cluster.network import Group

A100 = hardware.preset("dgx-a100")
H100 = hardware.preset("dgx-h100")
GPT3 = plan.SHAPES["gpt3-175b"]
MiB = 1 << 20
pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    "stride,size,k,n",
    [(1, 8, 8, 1), (1, 16, 8, 2), (1, 4, 4, 1), (8, 24, 1, 24), (64, 24, 1, 24), (3, 32, 2, 16)],
)
def test_spread_puts_k_ranks_a_node(stride, size, k, n):
    assert network.spread(stride, size, 8) == Group(k, n)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_one_node_is_lesson_02s_ring(p):
    n = 256 * MiB
    got, algorithm = network.collective_seconds(H100, "all_reduce", Group(p, 1), n)
    assert got == pytest.approx(hardware.ring_all_reduce_seconds(H100, p, n), rel=1e-12)
    assert algorithm == ("none" if p == 1 else "ring")
    half, _ = network.collective_seconds(H100, "all_gather", Group(p, 1), n)
    assert half == pytest.approx(got / 2, rel=1e-12)


@pytest.mark.parametrize("k,n", [(8, 2), (8, 16), (1, 24), (2, 16)])
def test_ring_and_tree_across_nodes_are_tuning_ccs_formulas(k, n):
    c = A100
    size = 512 * MiB
    eff = 0.9
    p = k * n
    net = min(k, c.nics) * c.inter.bandwidth * eff  # one ring a card, a card a GPU
    steps, across = 2 * (p - 1), 2 * (n - 1)
    latency = 8.4 + (steps - across) * 3.4 + across * 14 * 1.4
    want = latency * 1e-6 + 2 * (p - 1) / p * size / min(c.intra.bandwidth, net)
    assert network.ring(c, "all_reduce", Group(k, n), size, eff) == pytest.approx(want, rel=1e-12)
    cap = {1: 24.0, 2: 23.6}.get(n, 17.8) * 1e9 * min(k, c.nics)  # Ampere's per-channel caps
    correction = 1.0  # 512 MiB = 64 B x 2^23: past tuning.cc's correction table
    tree_latency = 8.4 + 2 * ((k - 1) * 4.0 + math.floor(math.log2(n)) * 14)
    want = tree_latency * 1e-6 + 2 * size / (min(0.92 * net, cap) * correction)
    assert network.tree(c, Group(k, n), size, eff) == pytest.approx(want, rel=1e-12)


def test_nccl_picks_the_faster_and_trees_win_small_messages_on_many_nodes():
    for group in (Group(8, 2), Group(8, 64), Group(1, 128)):
        for size in (64 * 1024, MiB, 1 << 30):
            got, algorithm = network.collective_seconds(A100, "all_reduce", group, size)
            ring = network.ring(A100, "all_reduce", group, size)
            tree = network.tree(A100, group, size)
            assert got == min(ring, tree) and algorithm == ("ring" if ring <= tree else "tree")
    assert network.collective_seconds(A100, "all_reduce", Group(8, 64), MiB)[1] == "tree"
    assert network.collective_seconds(A100, "all_reduce", Group(8, 2), 1 << 30)[1] == "ring"
    # reduce-scatter and all-gather: NCCL offers the ring only
    assert network.collective_seconds(A100, "reduce_scatter", Group(8, 64), MiB)[1] == "ring"


def test_eight_cards_carry_a_tp_group_of_16_eight_times_one_cards_ring():
    act = 2 * 2048 * 12288  # one GPT-3 activation, bf16: 50 MB
    many, _ = network.collective_seconds(A100, "all_reduce", Group(8, 2), act)
    one, _ = network.collective_seconds(replace(A100, channels=1), "all_reduce", Group(8, 2), act)
    assert 6 < one / many < 8.5, (one, many)
    # the single ring is what hardware.py's flat ring prices (its stream bound on one card)
    flat = hardware.ring_all_reduce_seconds(A100, 16, act)
    assert one == pytest.approx(flat, rel=0.05)


def test_achieved_bandwidth_falls_with_the_node_count():
    def busbw(n: int, size: int) -> float:
        group = Group(8, n)
        seconds, _ = network.collective_seconds(H100, "all_reduce", group, size)
        return 2 * (group.p - 1) / group.p * size / seconds

    for size in (MiB, 1 << 30):
        got = [busbw(n, size) for n in (2, 4, 8, 16, 64, 256)]
        assert got == sorted(got, reverse=True), got
    assert 300e9 < busbw(2, 1 << 30) < 8 * H100.inter.bandwidth  # eight NDR cards, ~400 GB/s


def test_the_hierarchy_pays_where_cards_are_few_not_on_a_card_per_gpu():
    # two nodes: NCCL's rings put 2 (p-1)/p N through a node's cards, the hierarchy 2 (n-1)/n N
    # but runs its three phases one after another: on one shared 100 GbE port it wins; with a
    # card per GPU (eight rings) the rings' 1.9 N on 200 GB/s beat it
    pcie = hardware.preset("pcie-a100")
    for c, hierarchy_wins in ((pcie, True), (A100, False)):
        ring = network.ring(c, "all_reduce", Group(8, 2), 1 << 30)
        hier = network.hierarchical(c, Group(8, 2), 1 << 30)
        assert (hier < ring) == hierarchy_wins, (c.name, hier, ring)


def test_a_pipeline_message_across_nodes_takes_its_own_card():
    got = network.p2p_seconds(A100, True, 50e6, 0.5)
    assert got == pytest.approx(A100.inter.latency + 50e6 / (A100.inter.bandwidth * 0.5))
    assert network.p2p_seconds(A100, False, 50e6) < got


def test_tensor_parallelism_across_nodes_is_priced_on_the_cards():
    eff = plan.calibrated(A100)
    x = plan.Layout(dp=8, pp=8, tp=16, b=1, recompute="full")
    parts = plan.step(GPT3, x, A100, 1536, eff)
    act = 2 * GPT3.seq * GPT3.hidden
    ar, _ = network.collective_seconds(A100, "all_reduce", Group(8, 2), act, eff.network)
    layers, m = plan.stage_layers(GPT3, x), x.microbatches(1536)
    assert parts["tp"] == pytest.approx(m * (6 * layers + 1) * ar, rel=1e-12)
    # tp 16 costs tp 8's compute halved and its all-reduces on eight cards: within 2x of tp 8
    tp8 = plan.step(GPT3, replace(x, pp=16, tp=8), A100, 1536, eff)
    assert sum(parts.values()) < 1.5 * sum(tp8.values())


def test_the_step_holds_nothing_proportional_to_the_gpu_count():
    eff = plan.calibrated(H100)
    x = plan.Layout(dp=1 << 17, pp=1, tp=8, zero=3, b=1)  # a million GPUs
    tracemalloc.start()
    start = time.perf_counter()
    parts = plan.step(plan.SHAPES["llama-7b"], x, H100, 1 << 17, eff)
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert parts["dp"] > 0 and seconds < 0.1 and peak < 1e6, (seconds, peak)


def test_lesson_13s_bus_bandwidth_table_is_the_modules():
    # | nodes | 1 GiB | 1 MiB |, DGX A100, 8 GPUs a node, at the calibrated network efficiency
    here = os.path.dirname(os.path.abspath(__file__))
    readme = open(os.path.join(here, "..", "lessons", "13_beyond_one_machine", "README.md")).read()
    cell = r"(\d+) GB/s, (ring|tree)"
    rows = re.findall(rf"^\| (\d+)[^|]* \| {cell} \| {cell} \|$", readme, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 8, 64], rows
    eff = plan.calibrated(A100).network
    for n, *cells in rows:
        group = Group(8, int(n))
        for size, (gbs, algorithm) in zip((1 << 30, MiB), (cells[:2], cells[2:]), strict=True):
            seconds, chosen = network.collective_seconds(A100, "all_reduce", group, size, eff)
            busbw = 2 * (group.p - 1) / group.p * size / seconds
            assert (round(busbw / 1e9), chosen) == (int(gbs), algorithm), (n, size, busbw)
