"""Hidden checks of lab 13 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests: a hand-made cluster (nodes of 2, then of 4; a slow network) whose
rings are worked out by hand: the chain's dearest run of hops starts after hop 0 (a window
that never slides misses it), the stream wins for large chunks (the chain alone is too
short) and the chain for small ones (the stream alone ignores latencies in a row); the
hierarchical all-reduce's two rings inside a node and its ring of n across on 1/g.
"""

from __future__ import annotations

import pytest

from minidist.testing import impl

pytestmark = pytest.mark.pure
A_IN = 1e-6
B_IN = 100e9
A_OUT = 5e-6
B_OUT = 10e9


def cluster(g: int):
    c = impl("cluster.hardware")
    gpu = c.GPU("toy", 1e15, 80e9, 2e12, 500.0)
    intra, inter = c.Link("nv", A_IN, B_IN), c.Link("ib", A_OUT, B_OUT)
    return c.Cluster("toy", gpu, g, intra, inter, 4000.0, 2.0, 1.2)


def test_13_1_rings_on_a_hand_made_cluster():
    c, two = impl("cluster.hardware"), cluster(2)
    hop_in = lambda chunk: A_IN + chunk / B_IN  # noqa: E731
    hop_out = lambda chunk: A_OUT + chunk / B_OUT  # noqa: E731
    # ranks 0 1 | 2 3: hops in, out, in, out; 3 steps of 1 kB: the chain's dearest run of
    # three hops is out, in, out (from hop 1), longer than the stream
    small = 1e3
    want = 2 * hop_out(small) + hop_in(small)
    assert c.ring_seconds(two, (0, 1, 2, 3), 3, small) == pytest.approx(want, rel=1e-12)
    # 6 steps (a lap and 2 hops) of 1 GB: the network streams them, 6 chunks then a latency
    big = 1e9
    want = 6 * big / B_OUT + A_OUT
    assert c.ring_seconds(two, (0, 1, 2, 3), 6, big) == pytest.approx(want, rel=1e-12)
    # one node: the chain, steps hops in a row, whatever the size
    for chunk in (small, big):
        want = 5 * hop_in(chunk)
        assert c.ring_seconds(two, (0, 1), 5, chunk) == pytest.approx(want, rel=1e-12)
    # a ring in another order: 0 2 1 3 crosses the network on every hop
    want = 4 * hop_out(small)
    assert c.ring_seconds(two, (0, 2, 1, 3), 4, small) == pytest.approx(want, rel=1e-12)


def test_13_2_hierarchical_all_reduce_on_a_hand_made_cluster():
    c = impl("cluster.hardware")
    n_bytes = 8e6
    cases = [  # (g, p): the two rings in a node + the ring of n across nodes on 1/g
        (2, 2, 2 * (A_IN + n_bytes / 2 / B_IN)),
        (2, 4, 2 * (A_IN + n_bytes / 2 / B_IN) + 2 * (A_OUT + n_bytes / 2 / 2 / B_OUT)),
        (2, 6, 2 * (A_IN + n_bytes / 2 / B_IN) + 4 * (A_OUT + n_bytes / 2 / 3 / B_OUT)),
        (4, 8, 6 * (A_IN + n_bytes / 4 / B_IN) + 2 * (A_OUT + n_bytes / 4 / 2 / B_OUT)),
    ]
    for g, p, want in cases:
        got = c.hierarchical_all_reduce_seconds(cluster(g), p, n_bytes)
        assert got == pytest.approx(want, rel=1e-12), (g, p, got, want)
