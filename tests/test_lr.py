"""Large batches: the LR rules and schedule (minidist/large_batches/lr.py) have their documented
shape at every step, and gradient accumulation (minidist/large_batches/accumulation.py) equals one
step on the concatenated batch.

The schedule is checked by what defines it, not by a second copy of its formula (that copy
would be lab 11's answer in the student's tests): the warm-up is the line from start x peak
to the peak, the decay falls from the peak to final x peak in equal steps (linear) or through
cosine's values at the quarters, symmetric about the middle (cosine). The schedule drives real
torch optimizers (SGD, AdamW) with two param groups of different peak rates. Accumulation is
compared in float64 at 1e-12 relative (the sum over rows happens in another order); with one
microbatch it must be bitwise the plain step. Under data parallelism (threads), accumulation
with DataParallelBucketed's no_sync equals the single process on the whole batch. lr comes from
impl("large_batches.lr"), so `make lab L=11` grades a learner's file.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minidist.large_batches import accumulation
from minidist.mixed_precision import amp
from minidist.testing import check_all, impl, run_threads

RTOL, ATOL = 1e-12, 1e-15  # float64; the sum over rows happens in another order


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: tiny models, and a busy 2-core machine (see tests/test_amp.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


rates = st.floats(1e-4, 10.0)
fractions = st.sampled_from([0.0, 0.125, 1 / 3, 1.0])


def close(a: float, b: float, scale: float) -> bool:
    return abs(a - b) <= 1e-12 * scale + 1e-15


@pytest.mark.pure
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(0, 8), fractions, rates)
def test_warmup_is_the_line_from_start_to_the_peak(w, extra, start, peak):
    """Lab 11.1: the warm-up steps 0..W-1 climb in equal increments from start x peak (the
    rate of step -1, before any) to the peak on step W-1: a straight line through both."""
    lr = impl("large_batches.lr")
    rates_ = [start * peak] + [lr.lr_at(s, peak, w, w + extra, "linear", start) for s in range(w)]
    rise = rates_[1] - rates_[0]
    for s in range(1, w + 1):
        assert close(rates_[s] - rates_[s - 1], rise, peak), f"step {s - 1}: {rates_}"
    assert close(rates_[w], peak, peak), f"step {w - 1} is not the peak: {rates_}"
    assert rise >= 0 and (start == 1.0 or rise > 0), rates_


@pytest.mark.pure
@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 6),
    st.integers(1, 6),
    st.sampled_from(["constant", "linear", "cosine"]),
    fractions,
    rates,
)
def test_decay_falls_from_the_peak_to_final_by_its_shape(w, quarters, decay, final, peak):
    """Lab 11.2: from step W the rate falls from the peak to final x peak at step T, by its
    shape u = (rate - final x peak) / (peak - final x peak): constant 1; linear in equal steps;
    cosine 1, (2 + sqrt 2) / 4, 1/2, (2 - sqrt 2) / 4, 0 at the quarters and symmetric about
    the middle; final x peak after T."""
    lr = impl("large_batches.lr")
    total = w + 4 * quarters
    rate = [
        lr.lr_at(s, peak, w, total, decay, 0.0, final) if s >= w else None for s in range(total + 3)
    ]
    low = final * peak
    if final == 1.0:
        assert all(close(r, peak, peak) for r in rate[w:]), rate
        return
    u = [None if r is None else (r - low) / (peak - low) for r in rate]  # None in warm-up
    flat = decay == "constant"
    assert all(close(x, 1.0 if flat else 0.0, 1) for x in u[total + 1 :]), u
    if flat:
        assert all(close(x, 1.0, 1) for x in u[w:]), u
        return
    assert close(u[w], 1.0, 1) and close(u[total], 0.0, 1), u
    n = total - w
    if decay == "linear":
        assert all(close(u[w + k] - u[w + k + 1], 1 / n, 1) for k in range(n)), u
    else:
        quarter = [1.0, 0.8535533905932737, 0.5, 0.14644660940672624, 0.0]
        assert all(close(u[w + k * quarters], quarter[k], 1) for k in range(5)), u
        assert all(close(u[w + k] + u[total - k], 1.0, 1) for k in range(n + 1)), u
        assert all(u[w + k] > u[w + k + 1] for k in range(n)), u


@pytest.mark.pure
@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 12),
    st.integers(0, 30),
    st.sampled_from(["constant", "linear", "cosine"]),
    fractions,
    st.sampled_from([0.0, 0.1, 1.0]),
    rates,
    st.sampled_from(["sgd", "adamw"]),
)
def test_warmup_decay_sets_every_groups_rate_at_every_step(
    w, extra, decay, start, final, peak, opt
):
    """The scheduler: each param group's rate is lr_at(step, that group's peak) before every
    optimizer step, and a fresh scheduler resumes from a state_dict."""
    lr = impl("large_batches.lr")
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
        want = [lr.lr_at(s, p, w, total, decay, start, final) for p in (peak, peak / 4)]
        got = [group["lr"] for group in optimizer.param_groups]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), f"step {s}"
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        schedule.step()
    state = schedule.state_dict()  # resuming: a fresh scheduler continues where it left off
    again = lr.WarmupDecay(optimizer, w, total, decay, start, final)
    again.load_state_dict(state)
    assert again.get_last_lr() == schedule.get_last_lr()


@pytest.mark.pure
def test_scaling_rules_and_bad_settings():
    lr = impl("large_batches.lr")
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
    lr = impl("large_batches.lr")
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
    dp = impl("data_parallel.wrappers")
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
        model,
        mse,
        x[lo:hi],
        y[lo:hi],
        opt,
        m,
        no_sync=model.no_sync,
        finish=model.finish_gradient_sync,
    )
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
