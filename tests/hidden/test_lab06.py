"""Hidden checks of lab 06 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests: 1F1B's compute order written out by hand for two stages (a backward
before its steady forward, or a warmup one too long, shows), its stored activations against a
table that includes m < p (a warmup not capped at m, a stage that stashes p - s + 1 or p);
interleaved 1F1B's forward and backward orders against the definition (groups of p
microbatches through chunk 0, 1, ..., backwards through the chunks last to first) for p = 2,
3 and 4 (a group of 2 is right only for p = 2; backwards in chunk order deadlock).
"""

from __future__ import annotations

import pytest

from minidist.testing import impl

pytestmark = pytest.mark.pure


def letters(ops) -> str:
    """'F0 F1 B0 ...': the compute ops of a program (chunks left out)."""
    sch = impl("pipeline.schedules")
    return " ".join(f"{sch.LETTER[op.kind]}{op.microbatch}" for op in ops if op.kind in sch.COMPUTE)


def test_06_1_1f1b_compute_order_of_two_stages_by_hand():
    sch = impl("pipeline.schedules")
    want = {
        (2, 3): ["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"],
        (3, 4): ["F0 F1 F2 B0 F3 B1 B2 B3", "F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
        (3, 1): ["F0 B0", "F0 B0", "F0 B0"],
    }
    for (p, m), programs in want.items():
        got = [letters(sch.schedule_1f1b(p, m, s)) for s in range(p)]
        assert got == programs, (p, m, got)


def test_06_1_1f1b_stores_min_p_minus_s_m_activations():
    sch = impl("pipeline.schedules")
    for p, m in [(4, 8), (4, 2), (3, 1), (5, 5), (6, 3)]:
        programs = [sch.schedule_1f1b(p, m, s) for s in range(p)]
        got = [sch.peak_activations(ops) for ops in programs]
        assert got == [min(p - s, m) for s in range(p)], (p, m, got)
        counts = [(letters(ops).count("F"), letters(ops).count("B")) for ops in programs]
        assert counts == [(m, m)] * p, (p, m, counts)


def by_definition(p: int, v: int, m: int, backward: bool) -> list[tuple[int, int]]:
    """(microbatch, chunk) in the order a stage runs its forwards (or backwards): groups of p
    microbatches through chunk 0, 1, ..., v - 1 (backwards: v - 1 first)."""
    order = []
    for first in range(0, m, p):
        for c in reversed(range(v)) if backward else range(v):
            order += [(i, c) for i in range(first, first + p)]
    return order


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (3, 2, 6), (4, 3, 4), (3, 4, 3)])
def test_06_2_interleaved_orders_are_the_definitions(p, v, m):
    sch = impl("pipeline.schedules")
    for s in range(p):
        ops = sch.schedule_interleaved(p, m, s, v)
        fwd = [(op.microbatch, op.chunk) for op in ops if op.kind == sch.FORWARD]
        bwd = [(op.microbatch, op.chunk) for op in ops if op.kind == sch.BACKWARD]
        assert fwd == by_definition(p, v, m, False), (p, v, m, s, fwd)
        assert bwd == by_definition(p, v, m, True), (p, v, m, s, bwd)
    sch.simulate(sch.build_schedules("interleaved", p, m, v))  # raises Deadlock if stuck
