"""Pipeline schedules as data (minidist.pipeline.schedules): invariants, simulated bubble, peak
memory.

Tier 0 (pure): no communicator. Cost model, as in the papers' figures: every stage takes t_f per
forward and t_b per backward (default t_b = 2 t_f); split backward (ZB-H1): t_B = t_b - t_W and
t_W = t_b / 2, so t_F = t_B = t_W. Bubble = idle / total over all stages of the simulated run;
the papers' bubble / ideal x equals x / (1 + x) here: (p-1)/m -> (p-1)/(m+p-1).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist.pipeline.draw import add_schedule_command, draw_timeline
from minidist.testing import impl

pytestmark = pytest.mark.pure

stages = st.integers(1, 8)
microbatches = st.integers(1, 32)
chunks = st.integers(1, 4)
few = settings(max_examples=40, deadline=None)


def programs(sch, name: str, p: int, m: int, v: int = 1, place: bool = True):
    """All stages' programs, or None where the schedule refuses (p, m, v) (interleaved, m % p)."""
    if name == "interleaved" and m % p:
        with pytest.raises(ValueError, match=f"n_microbatches={m}.*n_stages={p}"):
            sch.build_schedules(name, p, m, v)
        return None
    return sch.build_schedules(name, p, m, v, place=place)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)  # times are sums of small integers


@few
@given(st.sampled_from(["gpipe", "1f1b", "zb"]), stages, microbatches)
def test_invariants_hold_and_nothing_deadlocks(name, p, m):
    """Every forward before its backward, sends matched, and no deadlock under rendezvous."""
    check_invariants(impl("pipeline.schedules"), name, p, m, 1)


@few
@given(stages, microbatches, chunks)
def test_interleaved_invariants_hold_and_nothing_deadlocks(p, m, v):
    """The same for the interleaved schedule (lab 06.2: which op comes k-th)."""
    check_invariants(impl("pipeline.schedules"), "interleaved", p, m, v)


def check_invariants(sch, name: str, p: int, m: int, v: int) -> None:
    placed = programs(sch, name, p, m, v)
    if placed is None:
        return  # a clear ValueError, checked in programs()
    naive = sch.build_schedules(name, p, m, v, place=False)
    for ops in (naive, placed):
        assert sch.check_order(ops, m) == [], (name, p, m, v)
        assert sch.check_matching(ops) == [], (name, p, m, v)
    for s, (a, b) in enumerate(zip(naive, placed, strict=True)):
        compute = [op for op in a if op.kind in sch.COMPUTE]
        assert compute == [op for op in b if op.kind in sch.COMPUTE], f"stage {s}: order changed"
    timeline = sch.simulate(placed)  # raises Deadlock rather than hang
    n_compute = (3 if name == "zb" else 2) * m * (v if name == "interleaved" else 1)
    assert [len(ops) for ops in timeline] == [n_compute] * p


@few
@given(
    st.sampled_from(["gpipe", "1f1b"]), stages, microbatches, st.integers(1, 3), st.integers(1, 6)
)
def test_bubble_gpipe_1f1b(name, p, m, cost_f, cost_b):
    """(p-1)/(m+p-1) for any t_f, t_b as long as all stages are equal; blocking send/recv."""
    sch = impl("pipeline.schedules")
    placed = sch.place_comm(programs(sch, name, p, m, place=False), cost_f, cost_b)
    bubble = sch.bubble_fraction(sch.simulate(placed, cost_f, cost_b))
    assert close(bubble, (p - 1) / (m + p - 1)), (name, p, m, cost_f, cost_b, bubble)
    assert close(bubble, sch.bubble_formula(name, p, m))


@few
@given(stages, st.integers(1, 8), st.integers(2, 4))
def test_bubble_interleaved(p, groups, v):
    """Megatron's (p-1)/(v*m+p-1) with eager sends (its assumption: sends never wait).

    With blocking send/recv (t_b = 2 t_f) the same value when p % 3 != 2 or m == p; otherwise
    the activation wrapping from the last stage to the first finds no moment when both are
    free, someone waits, and the bubble is larger.
    """
    sch = impl("pipeline.schedules")
    m = groups * p  # Megatron's requirement: m a multiple of p
    formula = (p - 1) / (v * m + p - 1)
    eager = sch.simulate(programs(sch, "interleaved", p, m, v, place=False), rendezvous=False)
    assert close(sch.bubble_fraction(eager), formula), (p, m, v)
    blocking = sch.bubble_fraction(sch.simulate(programs(sch, "interleaved", p, m, v)))
    if p % 3 != 2 or m == p:
        assert close(blocking, formula), (p, m, v, blocking)
    else:
        assert blocking > formula + 1e-9, (p, m, v, blocking)


@few
@given(stages, microbatches)
def test_bubble_zb_h1(p, m):
    """ZB-H1 with t_F = t_B = t_W: (p-1)/(3m+p-1), the paper's (p-1)(t_F+t_B-t_W) / (3m t_F)
    bubble over ideal, for m >= p; with m < p less than 1F1B's (p-1)/(m+p-1), more than that."""
    sch = impl("pipeline.schedules")
    bubble = sch.bubble_fraction(sch.simulate(programs(sch, "zb", p, m), 1, 2, 1))
    zb, one_f_one_b = (p - 1) / (3 * m + p - 1), (p - 1) / (m + p - 1)
    if m >= p:
        assert close(bubble, zb), (p, m, bubble)
    else:
        assert zb < bubble < one_f_one_b, (p, m, bubble)


@few
@given(stages, microbatches)
def test_peak_activations(p, m):
    """GPipe m; 1F1B and ZB-H1 min(p - s, m) (ZB-H1: min(p, m) on every stage counted until the
    W)."""
    sch = impl("pipeline.schedules")
    peak = sch.peak_activations
    assert [peak(ops) for ops in programs(sch, "gpipe", p, m)] == [m] * p
    expected = [min(p - s, m) for s in range(p)]
    assert [peak(ops) for ops in programs(sch, "1f1b", p, m)] == expected
    zb = programs(sch, "zb", p, m)
    assert [peak(ops) for ops in zb] == expected
    assert [peak(ops, until_weight=True) for ops in zb] == [min(p, m)] * p


@few
@given(stages, microbatches, chunks)
def test_peak_activations_interleaved(p, m, v):
    """Interleaved: min(v*m, (v-1)*p + 2*(p-s-1) + 1) chunk-microbatches."""
    sch = impl("pipeline.schedules")
    peak = sch.peak_activations
    groups = 1 + m % 4  # interleaved needs groups of p microbatches; keep the run short
    interleaved = programs(sch, "interleaved", p, groups * p, v)
    assert [peak(ops) for ops in interleaved] == [
        min(v * groups * p, (v - 1) * p + 2 * (p - s - 1) + 1) for s in range(p)
    ]


def test_fewer_microbatches_than_stages():
    """m < p: GPipe, 1F1B and ZB-H1 run (all warmup); interleaved refuses, naming the numbers."""
    sch = impl("pipeline.schedules")
    for name in ("gpipe", "1f1b", "zb"):
        timeline = sch.simulate(programs(sch, name, 8, 3))
        assert all(len(ops) > 0 for ops in timeline)
    with pytest.raises(ValueError, match="n_microbatches=3 is not a multiple of n_stages=8"):
        sch.schedule_interleaved(8, 3, 0, 2)


def test_naive_comm_deadlocks_and_says_where():
    """1F1B with each send right after its compute: both stages send first and wait forever.
    The simulator names them; place_comm's order runs."""
    sch = impl("pipeline.schedules")
    naive = programs(sch, "1f1b", 2, 2, place=False)
    with pytest.raises(sch.Deadlock, match=r"stage 0 in .*send_act.*stage 1 in .*send_grad"):
        sch.simulate(naive)
    sch.simulate(sch.place_comm(naive))


def test_checks_find_broken_schedules():
    sch = impl("pipeline.schedules")
    good = programs(sch, "1f1b", 2, 2)
    swapped = [list(ops) for ops in good]
    f, b = swapped[1].index(sch.Op("forward", 0)), swapped[1].index(sch.Op("backward", 0))
    swapped[1][f], swapped[1][b] = swapped[1][b], swapped[1][f]
    assert any("out of order" in p for p in sch.check_order(swapped, 2))
    no_recv = [list(ops) for ops in good]
    no_recv[1].remove(sch.Op("recv_act", 1))
    assert any("no recv_act" in p for p in sch.check_order(no_recv, 2))
    assert any("send_act" in p for p in sch.check_matching(no_recv))


def test_text_grid_1f1b():
    """p=2, m=2, t_b = 2 t_f: the bubble is (p-1)/(m+p-1) = 1/3 and visible in the grid."""
    sch = impl("pipeline.schedules")
    timeline = sch.simulate(programs(sch, "1f1b", 2, 2))
    assert sch.text_grid(timeline) == (
        "stage 0 | F0 F1  .  . B0 B0  . B1 B1\nstage 1 |  . F0 B0 B0 F1 B1 B1  .  ."
    )
    assert close(sch.bubble_fraction(timeline), 1 / 3)


def test_draw_timeline_simulated_and_measured(tmp_path):
    sch = impl("pipeline.schedules")
    timeline = sch.simulate(programs(sch, "interleaved", 2, 4, 2))
    measured = [(0, 0.0, 1.5, "F0"), (1, 1.5, 2.0, "F0"), (1, 2.0, 3.0, "B0"), (0, 3.0, 4.5, "B0")]
    for data, name in ((timeline, "simulated.png"), (measured, "measured.png")):
        draw_timeline(data, str(tmp_path / name), name)
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert close(sch.bubble_fraction(measured), 1 - 4.5 / 9)


def run_command(*argv: str) -> tuple[int, str, str]:
    sch = impl("pipeline.schedules")
    parser = argparse.ArgumentParser(prog="minidist")
    add_schedule_command(parser.add_subparsers(dest="command", required=True), sch)
    args = parser.parse_args(["schedule", *argv])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = args.func(args)
    return code, out.getvalue(), err.getvalue()


def test_schedule_command(tmp_path):
    code, out, _ = run_command("--schedule", "1f1b", "--stages", "4", "--microbatches", "8")
    assert code == 0 and out.count("stage ") == 4 and "formula 0.2727" in out
    assert "peak stored activations per stage: 4 3 2 1" in out
    png = tmp_path / "zb.png"
    code, out, _ = run_command(
        "--schedule", "zb", "--stages", "4", "--microbatches", "8", "--png", str(png), "--json"
    )
    result = json.loads(out)
    assert code == 0 and png.exists() and result["peak_activations"] == [4, 3, 2, 1]
    assert close(result["bubble"], 3 / 27) and close(result["bubble_formula"], 3 / 27)
    code, out, err = run_command(
        "--schedule", "interleaved", "--stages", "3", "--microbatches", "4"
    )
    assert code == 2 and out == "" and "n_microbatches=4 is not a multiple of n_stages=3" in err
