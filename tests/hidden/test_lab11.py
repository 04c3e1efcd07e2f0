"""Hidden checks of lab 11 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests (which check the schedule's shape, never its formula: the student's
copy must not hold the answer), the rate at written-out steps, from the formula in the lesson:
warm-up peak (start + (1 - start) (s + 1) / W), then peak (final + (1 - final) u(t)) with
t = (s - W) / (T - W) and u = 1, 1 - t or (1 + cos(pi t)) / 2, flat at final x peak after T.
"""

from __future__ import annotations

import math

import pytest

from minidist.testing import impl

pytestmark = pytest.mark.pure


def test_11_1_warmup_rates_at_written_out_steps():
    lr = impl("large_batches.lr")
    cases = [  # (step, peak, W, T, start): the rate
        ((0, 2.0, 4, 10, 0.25), 2.0 * (0.25 + 0.75 / 4)),
        ((1, 2.0, 4, 10, 0.25), 2.0 * (0.25 + 0.75 * 2 / 4)),
        ((3, 2.0, 4, 10, 0.25), 2.0),  # the last warm-up step reaches the peak
        ((0, 1.0, 1, 5, 0.0), 1.0),  # W = 1: the peak at once
        ((2, 3.0, 5, 5, 0.0), 3.0 * 3 / 5),  # W = T
        ((4, 0.5, 8, 20, 1.0), 0.5),  # start = 1: flat
    ]
    for (step, peak, w, t, start), want in cases:
        got = lr.lr_at(step, peak, w, t, "linear", start, 0.0)
        assert got == pytest.approx(want, rel=1e-12), (step, peak, w, t, start, got, want)


def test_11_2_decay_rates_at_written_out_steps():
    lr = impl("large_batches.lr")
    cos = (1 + math.cos(math.pi / 4)) / 2  # u at t = 1/4
    cases = [  # (step, peak, W, T, decay, final): the rate
        ((2, 1.0, 2, 6, "linear", 0.1), 1.0),  # t = 0: the peak
        ((4, 1.0, 2, 6, "linear", 0.1), 0.1 + 0.9 * 0.5),
        ((6, 1.0, 2, 6, "linear", 0.1), 0.1),  # t = 1: final x peak
        ((9, 1.0, 2, 6, "linear", 0.1), 0.1),  # after T: flat
        ((3, 2.0, 2, 6, "cosine", 0.0), 2.0 * cos),
        ((4, 2.0, 2, 6, "cosine", 0.5), 2.0 * (0.5 + 0.5 * 0.5)),
        ((0, 4.0, 0, 8, "cosine", 0.0), 4.0),  # no warm-up
        ((7, 3.0, 3, 9, "constant", 0.2), 3.0),
        ((5, 1.0, 5, 5, "linear", 0.3), 1.0),  # W = T: t = 0 / max(1, 0) on step T
        ((6, 1.0, 5, 5, "linear", 0.3), 0.3),  # ... and final x peak after it
    ]
    for (step, peak, w, t, decay, final), want in cases:
        got = lr.lr_at(step, peak, w, t, decay, 0.0, final)
        assert got == pytest.approx(want, rel=1e-12), (step, peak, w, t, decay, final, got, want)
