"""Hidden checks of lab 10 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests: predicted_peak on a written-out table (A and b far apart, so a block
counted as an input shows; n a multiple of k, n < k, one block); checkpoint() of a function
with dropout called on two inputs, one without grad, twice in a row on the same generator:
the gradients, and the generator's state afterwards, bitwise those of the plain function
(a state not restored draws another mask; one not forked moves the generator).
"""

from __future__ import annotations

import pytest
import torch

from minidist.testing import impl

pytestmark = pytest.mark.pure
F64 = torch.float64


def test_10_1_predicted_peak_on_a_written_out_table():
    ck = impl("checkpointing.recompute")
    a, b = 1000, 7  # one block's saved bytes, its input's
    table = {
        (6, 2): 2 * b + 2 * a,  # c = 3, s = 2: the last segment (2 inputs held) is the peak
        (7, 3): max(2 * b + a, b + 3 * a),  # c = 3, s = 1: a full segment's recompute
        (7, 2): max(3 * b + a, 2 * b + 2 * a),  # c = 4, s = 1
        (4, 4): 4 * a,  # one segment
        (3, 7): 3 * a,  # k > n: one shorter segment
        (1, 1): a,
        (5, 1): 4 * b + a,
        (8, 0): 8 * a,  # no checkpointing
    }
    got = {(n, k): ck.predicted_peak(n, k, a, b) for n, k in table}
    assert got == table, {key: (got[key], want) for key, want in table.items() if got[key] != want}


def twice(use_checkpoint: bool) -> dict:
    ck = impl("checkpointing.recompute")
    g = torch.Generator().manual_seed(10)
    w = torch.randn(3, 3, generator=g, dtype=F64, requires_grad=True)
    x = torch.randn(4, 3, generator=g, dtype=F64, requires_grad=True)
    c = torch.randn(4, 3, generator=g, dtype=F64)  # no gradient

    def noisy(x, c):
        """dropout(tanh(x @ w)) * c + x: draws from the default generator; w a closure."""
        return torch.nn.functional.dropout(torch.tanh(x @ w), 0.5, training=True) * c + x

    with torch.random.fork_rng():
        torch.manual_seed(1234)
        h = x
        for _ in range(2):
            h = ck.checkpoint(noisy, h, c, params=[w]) if use_checkpoint else noisy(h, c)
        h.square().sum().backward()
        after = torch.get_rng_state()
    return {"x.grad": x.grad, "w.grad": w.grad, "rng after": after}


def test_10_2_two_checkpoints_with_dropout_equal_the_plain_function_bitwise():
    plain, ours = twice(False), twice(True)
    for name, want in plain.items():
        assert ours[name] is not None and torch.equal(ours[name], want), name
