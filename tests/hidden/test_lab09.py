"""Hidden checks of lab 09 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests: ranks that hold different numbers of tensors (one holds none, as a
ZeRO rank with only padding) still agree, and still all join the all-reduce; the loss scale
over a written-out sequence of steps (a back-off must restart the count of clean steps);
one rank of three overflows: every rank skips that step with the scale halved, the model and
the masters untouched, and the next step is taken everywhere, the model holding the masters.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from minidist.testing import check_all, impl, run_threads, verdict

F64 = torch.float64
FAST = {"timeout": 30, "comm_timeout": 3}


def uneven_tensors(comm, bad_rank: int) -> bool:
    """Rank 0 holds no tensors, rank 1 two, rank 2 one; rank `bad_rank` (if it holds any)
    puts an inf in its last: every rank must give the same answer."""
    amp = impl("mixed_precision.amp")
    r = comm.rank
    tensors = [torch.ones(3) * (i + 1) for i in range(r if r < 2 else 1)]
    if r == bad_rank and tensors:
        tensors[-1][1] = math.inf
    got = amp.found_nonfinite(tensors, comm)
    want = bad_rank in (1, 2)
    verdict(comm, got == want, f"rank {r}: found_nonfinite={got}, expected {want}")
    return got


@pytest.mark.threads
@pytest.mark.parametrize("bad_rank", [1, 2, 3])
def test_09_1_ranks_holding_different_tensors_agree(bad_rank):
    run_threads(uneven_tensors, 3, bad_rank, **FAST)


@pytest.mark.pure
def test_09_2_the_scale_over_a_written_out_sequence():
    amp = impl("mixed_precision.amp")
    scaler = amp.LossScaler(8.0, growth_interval=2)
    steps = [False, False, True, False, True, False, False, False]
    want = [8.0, 16.0, 8.0, 8.0, 4.0, 4.0, 8.0, 8.0]
    got = []
    for found in steps:
        scaler.update(found)
        got.append(scaler.scale)
    assert got == want, got
    assert scaler.state_dict() == {"scale": 8.0, "clean_steps": 1}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1, dtype=F64)
        with torch.no_grad():
            self.lin.weight.copy_(torch.tensor([[0.5, -1.0, 2.0]], dtype=F64))
            self.lin.bias.fill_(0.25)

    def forward(self, x):
        return self.lin(x)


def one_rank_overflows(comm) -> list[int]:
    """Step 0: rank 2's loss is inf, so every rank skips (the scale 16 -> 8, nothing moves);
    step 1: every rank steps, the model equal to its masters and to one process's SGD step."""
    amp = impl("mixed_precision.amp")
    f64 = amp.Precision(F64, F64, F64)
    p, r = comm.world_size, comm.rank
    model = Net()
    mp = amp.MixedPrecisionOptimizer(
        model, lambda ps: torch.optim.SGD(ps, lr=0.1), f64, amp.LossScaler(16.0), comm
    )
    g = torch.Generator().manual_seed(9)
    xs = torch.randn(2, p, 2, 3, generator=g, dtype=F64)  # (steps, p, rows, 3)
    ref = Net()
    start = [q.detach().clone() for q in model.parameters()]
    problems = []
    for step in range(2):
        mp.zero_grad()
        loss = model(xs[step, r]).square().mean()
        mp.backward(loss * math.inf if (step, r) == (0, 2) else loss)
        stepped = mp.step()
        if stepped != (step == 1):
            problems.append(f"step {step}: stepped={stepped}")
        if step == 0:
            problems += [
                f"step 0 moved a parameter: {q}"
                for q, s in zip(model.parameters(), start, strict=True)
                if not torch.equal(q, s)
            ]
    want_scales = 8.0
    if mp.scaler.scale != want_scales:
        problems.append(f"scale {mp.scaler.scale}, expected {want_scales}")
    ref(xs[1].reshape(-1, 3)).square().mean().backward()
    with torch.no_grad():
        for q in ref.parameters():
            q -= 0.1 * q.grad
    verdict(comm, not problems, f"rank {r}: " + "; ".join(problems))
    pairs = {}
    for (name, q), m, q_ref in zip(
        model.named_parameters(), mp.master, ref.parameters(), strict=True
    ):
        pairs[f"model {name}"] = (q.detach(), q_ref.detach())
        pairs[f"master {name}"] = (m.detach(), q_ref.detach())
    check_all(comm, pairs, 1e-12, 1e-14)
    return mp.skipped


@pytest.mark.threads
def test_09_3_one_rank_overflows_and_every_rank_skips_with_the_scale_halved():
    assert run_threads(one_rank_overflows, 3, **FAST) == [[0]] * 3


def two_stages_one_overflow(comm) -> list[int]:
    """Ranks {0, 1} and {2, 3} are two dp groups (two pipeline stages); rank 3's loss is inf
    at step 1; overflow_comm is the world: every rank of both stages skips step 1 alone."""
    amp = impl("mixed_precision.amp")
    f64 = amp.Precision(F64, F64, F64)
    dp_comm = comm.split(comm.rank // 2)
    model = Net()
    mp = amp.MixedPrecisionOptimizer(
        model,
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        f64,
        amp.LossScaler(4.0),
        dp_comm,
        overflow_comm=comm,
    )
    g = torch.Generator().manual_seed(comm.rank)
    for step in range(3):
        mp.zero_grad()
        loss = model(torch.randn(2, 3, generator=g, dtype=F64)).square().mean()
        mp.backward(loss * math.inf if (step, comm.rank) == (1, 3) else loss)
        mp.step()
    return mp.skipped


@pytest.mark.threads
def test_09_3_a_stage_that_overflows_makes_every_stage_skip():
    assert run_threads(two_stages_one_overflow, 4, **FAST) == [[1]] * 4
