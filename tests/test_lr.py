"""Large batches: the LR rules and schedule (minidist/lr.py) match their formulas at every step,
and gradient accumulation (minidist/accumulation.py) equals one step on the concatenated batch.

The formulas are written out again here, independently of the module. The schedule drives real
torch optimizers (SGD, AdamW) with two param groups of different peak rates. Accumulation is
compared in float64 at 1e-12 relative (the sum over rows happens in another order); with one
microbatch it must be bitwise the plain step. Under data parallelism (threads), accumulation
with DataParallelBucketed's no_sync equals the single process on the whole batch. lr comes from
impl("lr"), so `make lab L=11` grades a learner's file.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minidist import accumulation, amp
from minidist.testing import check_all, impl, run_threads

RTOL, ATOL = 1e-12, 1e-15  # float64; the sum over rows happens in another order


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: tiny models, and a busy 2-core machine (see tests/test_amp.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def formula(s: int, peak: float, w: int, t: int, decay: str, start: float, final: float):
    """The documented schedule, written out again: warm-up, then decay, then flat."""
    if s < w:
        return peak * start + (peak - peak * start) * (s + 1) / w
    frac = min(1.0, (s - w) / max(1, t - w))
    shape = {"constant": 1.0, "linear": 1 - frac, "cosine": 0.5 + 0.5 * math.cos(math.pi * frac)}
    return peak * final + (peak - peak * final) * shape[decay]


@pytest.mark.pure
@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 12),
    st.integers(0, 30),
    st.sampled_from(["constant", "linear", "cosine"]),
    st.sampled_from([0.0, 0.125, 1 / 3, 1.0]),
    st.sampled_from([0.0, 0.1, 1.0]),
    st.floats(1e-4, 10.0),
    st.sampled_from(["sgd", "adamw"]),
)
def test_schedule_matches_the_formula_at_every_step(w, extra, decay, start, final, peak, opt):
    lr = impl("lr")
    total = w + extra
    model = nn.Linear(2, 2)
    groups = [{"params": [model.weight], "lr": peak}, {"params": [model.bias], "lr": peak / 4}]
    optimizer = (
        torch.optim.SGD(groups, lr=1.0, momentum=0.9)
        if opt == "sgd"
        else torch.optim.AdamW(groups, lr=1.0)
    )
    schedule = lr.WarmupDecay(optimizer, w, total, decay, start, final)
    for s in range(total + 3):  # and a few steps past the end: stays at final * peak
        want = [formula(s, p, w, total, decay, start, final) for p in (peak, peak / 4)]
        got = [group["lr"] for group in optimizer.param_groups]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), f"step {s}"
        assert lr.lr_at(s, peak, w, total, decay, start, final) == pytest.approx(want[0], 1e-12)
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        schedule.step()
    state = schedule.state_dict()  # resuming: a fresh scheduler continues where it left off
    again = lr.WarmupDecay(optimizer, w, total, decay, start, final)
    again.load_state_dict(state)
    assert again.get_last_lr() == schedule.get_last_lr()


@pytest.mark.pure
def test_scaling_rules_and_bad_settings():
    lr = impl("lr")
    assert lr.scaled_lr(0.1, 32, 512, "linear") == pytest.approx(1.6)
    assert lr.scaled_lr(0.1, 32, 512, "sqrt") == pytest.approx(0.4)
    assert lr.scaled_lr(0.1, 32, 512, "none") == 0.1
    assert lr.scaled_lr(0.1, 64, 16, "linear") == pytest.approx(0.025)  # smaller batch: less
    assert lr.lr_at(0, 1.0, 4, 10, start=0.25) == pytest.approx(0.25 + 0.75 / 4)
    assert lr.lr_at(3, 1.0, 4, 10) == 1.0  # the last warm-up step reaches the peak
    with pytest.raises(ValueError, match="rule='cube' is not one of"):
        lr.scaled_lr(0.1, 32, 64, "cube")
    with pytest.raises(ValueError, match="warmup_steps=5 <= total_steps=3"):
        lr.lr_at(0, 1.0, 5, 3)
    with pytest.raises(ValueError, match="decay='step' is not one of"):
        lr.lr_at(0, 1.0, 1, 3, decay="step")


@pytest.mark.pure
def test_the_schedule_drives_the_mixed_precision_optimizer():
    """Anything with param_groups: here the master-weights wrapper of lesson 09."""
    lr = impl("lr")
    model = nn.Linear(3, 1)
    mp = amp.MixedPrecisionOptimizer(model, lambda ps: torch.optim.SGD(ps, lr=0.4), amp.BF16)
    schedule = lr.WarmupDecay(mp, warmup_steps=4, total_steps=8, decay="linear")
    seen = []
    for _ in range(8):
        seen.append(mp.optimizer.param_groups[0]["lr"])
        mp.backward(model(torch.ones(2, 3, dtype=torch.bfloat16)).float().sum())
        mp.step()
        schedule.step()
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.3, 0.2, 0.1])


class Net(nn.Module):
    def __init__(self, d: int, h: int, seed: int):
        super().__init__()
        self.inp = nn.Linear(d, h, dtype=torch.float64)
        self.out = nn.Linear(h, 2, dtype=torch.float64)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for q in self.parameters():
                q.copy_(torch.randn(q.shape, generator=g, dtype=torch.float64) * 0.5)

    def forward(self, x):  # (B, d) -> (B, 2)
        return self.out(torch.tanh(self.inp(x)))


def batches(d: int, n: int, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, d, generator=g, dtype=torch.float64),  # (n, d)
            torch.randn(n, 2, generator=g, dtype=torch.float64),  # (n, 2)
        )
        for _ in range(steps)
    ]


@pytest.mark.pure
@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(1, 3),
    st.integers(0, 10**6),
    st.sampled_from(["sgd", "adamw"]),
)
def test_accumulation_equals_one_step_on_the_concatenated_batch(m, b, h, steps, seed, opt):
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    }[opt]
    ref, model = Net(3, h, seed), Net(3, h, seed)
    ref_opt, opt_ = make(list(ref.parameters())), make(list(model.parameters()))
    mse = nn.functional.mse_loss
    for step, (x, y) in enumerate(batches(3, m * b, steps, seed)):
        ref_opt.zero_grad()
        ref_loss = mse(ref(x), y)  # the concatenated batch: m * b rows at once
        ref_loss.backward()
        ref_opt.step()
        loss = accumulation.train_step(model, mse, x, y, opt_, n_microbatches=m)
        assert loss == pytest.approx(ref_loss.item(), rel=1e-12)
        for (name, q), q_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
            # one microbatch is the very same program: bitwise
            same = torch.allclose(q, q_ref, RTOL, ATOL) if m > 1 else torch.equal(q, q_ref)
            assert same, f"step {step} {name}: {(q - q_ref).abs().max():.3g}"
    with pytest.raises(ValueError, match="batch=5 is not divisible by n_microbatches=2"):
        accumulation.microbatches(torch.zeros(5, 1), torch.zeros(5, 1), 2)


def accumulate_data_parallel(comm, m: int, seed: int) -> None:
    """Per rank m microbatches of 2 rows, no_sync until the last: the whole batch's step."""
    dp = impl("data_parallel")
    p, r = comm.world_size, comm.rank
    ((x, y),) = batches(3, 2 * m * p, 1, seed)  # the global batch: 2 m p rows
    ref = Net(3, 4, seed)
    nn.functional.mse_loss(ref(x), y).backward()
    local = Net(3, 4, seed + r)  # out of sync: the wrapper broadcasts rank 0's
    model = dp.DataParallelBucketed(local, comm, bucket_bytes=64)
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    lo, hi = 2 * m * r, 2 * m * (r + 1)  # this rank's rows
    mse = nn.functional.mse_loss
    accumulation.train_step(
        model, mse, x[lo:hi], y[lo:hi], opt, m, no_sync=model.no_sync,
        finish=model.finish_gradient_sync,
    )  # fmt: skip
    with torch.no_grad():
        for q in ref.parameters():
            q -= 0.1 * q.grad
    pairs = {
        name: (q, q_ref)
        for (name, q), q_ref in zip(local.named_parameters(), ref.parameters(), strict=True)
    }
    check_all(comm, pairs, RTOL, ATOL, context=f"m={m} p={p}")


@pytest.mark.threads
@pytest.mark.parametrize("p, m", [(1, 3), (2, 1), (3, 2), (4, 3)])
def test_accumulation_under_data_parallelism(p, m):
    run_threads(accumulate_data_parallel, p, m, p * 10 + m, timeout=60, comm_timeout=20)
