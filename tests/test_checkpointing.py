"""Gradient checkpointing (minidist/checkpointing/recompute.py): the same gradients as without it,
and the saved-activation memory the policy predicts.

Gradients: float64, bitwise (the recomputation runs the same ops on the same inputs in the same
order); with dropout too, since the random state is restored before each recomputation, and
the generator ends where it would without checkpointing. torch.utils.checkpoint serves as a
second, independent reference. Memory: SavedTensorMeter's peak equals predicted_peak(n, k, A,
b) byte for byte, A and b measured on one block alone. Dropout draws from torch's default
generator, so these tests run in one thread and set its state inside torch.random.fork_rng
(restored afterwards; no other thread runs meanwhile). The module comes from
impl("checkpointing.recompute"), so `make lab L=10` grades a learner's file.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minidist.testing import check_all, impl, run_threads

policies = st.one_of(st.sampled_from(["none", "block", "sqrt"]), st.integers(1, 7))


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: tiny models, and a busy 2-core machine (see tests/test_amp.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Block(nn.Module):
    """x + W2 dropout(gelu(W1 x)): saves x, W1 x, the mask, the dropped activations."""

    def __init__(self, d: int, f: int, p: float, g: torch.Generator):
        super().__init__()
        self.l1 = nn.Linear(d, f, dtype=torch.float64)
        self.l2 = nn.Linear(f, d, dtype=torch.float64)
        self.drop = nn.Dropout(p)
        with torch.no_grad():
            for q in self.parameters():
                q.copy_(torch.randn(q.shape, generator=g, dtype=torch.float64) * 0.5)

    def forward(self, x):  # x: (B, d) -> (B, d)
        return x + self.l2(self.drop(nn.functional.gelu(self.l1(x))))


def blocks(n: int, d: int, f: int, p: float, seed: int) -> list[Block]:
    g = torch.Generator().manual_seed(seed)
    return [Block(d, f, p, g) for _ in range(n)]


def rng_state(device: str) -> torch.Tensor:
    """The state of the generator dropout draws from on `device`."""
    return torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()


def set_rng_state(state: torch.Tensor, device: str) -> None:
    if device == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state)


def grads_of(model: nn.Module, x: torch.Tensor, rng: torch.Tensor) -> dict:
    """Every parameter's gradient (and x's) after one backward, the generator of x's device set
    to `rng` first; plus that generator's state afterwards."""
    set_rng_state(rng, x.device.type)
    x = x.clone().requires_grad_(True)
    model(x).square().sum().backward()
    out = {f"{i}.grad": q.grad for i, q in enumerate(model.parameters())}
    return {**out, "x.grad": x.grad, "rng after": rng_state(x.device.type)}


class TorchCheckpointed(nn.Module):
    """The independent reference: torch.utils.checkpoint around each block."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = torch_checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def compare(got: dict, want: dict, what: str) -> None:
    for name in want:
        assert torch.equal(got[name], want[name]), (
            f"{what}: {name} differs by {(got[name].double() - want[name].double()).abs().max()}"
        )


@pytest.mark.pure
@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 7),
    policies,
    st.integers(1, 4),
    st.integers(1, 6),
    st.sampled_from([0.0, 0.5]),
    st.integers(0, 10**6),
)
def test_checkpointing_gives_the_same_gradients_bitwise(n, policy, b, d, p, seed):
    same_gradients(n, policy, b, d, p, seed, "cpu")


def same_gradients(n: int, policy, b: int, d: int, p: float, seed: int, device: str) -> None:
    """Plain, checkpointed and torch-checkpointed stacks: bitwise the same gradients."""
    ck = impl("checkpointing.recompute")
    plain = [block.to(device) for block in blocks(n, d, 2 * d, p, seed)]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d, generator=g, dtype=torch.float64).to(device)  # (b, d)
    # dropout reads the device's default generator: leave it as it was afterwards
    with torch.random.fork_rng(devices=[0] if device == "cuda" else []):
        rng = rng_state(device)
        want = grads_of(nn.Sequential(*plain), x, rng)
        got = grads_of(ck.CheckpointedSequential(copy.deepcopy(plain), policy), x, rng)
        compare(got, want, f"CheckpointedSequential(policy={policy!r}) on {device}")
        if p > 0:  # one more reference, independent of this module
            other = grads_of(TorchCheckpointed(copy.deepcopy(plain)), x, rng)
            compare(got, other, f"against torch.utils.checkpoint on {device}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["block", "sqrt", 3])
def test_checkpointing_on_cuda_restores_the_cuda_generator(policy):
    same_gradients(6, policy, 4, 8, 0.5, 7, "cuda")


@pytest.mark.pure
@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 9),
    policies,
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(1, 9),
    st.sampled_from([0.0, 0.3]),
)
def test_peak_saved_bytes_are_what_the_policy_predicts(n, policy, b, d, f, p):
    ck = impl("checkpointing.recompute")
    x = torch.randn(b, d, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    model = ck.CheckpointedSequential(blocks(n, d, f, p, seed=n), policy)
    with torch.random.fork_rng():
        one = blocks(1, d, f, p, seed=0)[0]
        with ck.SavedTensorMeter(exclude=one.parameters()) as meter:
            one(x).sum()  # A: what one block saves, its input included
        block_bytes = meter.peak
        with ck.SavedTensorMeter(exclude=model.parameters()) as meter:
            model(x).sum().backward()  # .sum() saves no tensor: the blocks alone
    k = ck.segment_size(n, policy)
    want = ck.predicted_peak(n, k, block_bytes, x.numel() * x.element_size())
    assert meter.peak == want, f"n={n} k={k}: measured {meter.peak} bytes, predicted {want}"
    assert meter.live == 0, f"{meter.live} bytes still held after backward"
    if k == 0:
        assert want == n * block_bytes


@pytest.mark.pure
def test_sqrt_policy_grows_like_sqrt_n():
    ck = impl("checkpointing.recompute")
    a, b = 1000, 100  # bytes: one block's activations, its input
    for n in (4, 16, 64, 256):
        k = ck.segment_size(n, "sqrt")
        assert k == math.isqrt(n)
        assert ck.predicted_peak(n, k, a, b) <= 2 * math.sqrt(n) * a
        assert ck.predicted_peak(n, 0, a, b) == n * a
        assert ck.predicted_peak(n, 1, a, b) == (n - 1) * b + a


@pytest.mark.pure
def test_segment_plans_tile_the_blocks():
    ck = impl("checkpointing.recompute")
    assert ck.segments(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert ck.segments(5, 0) == []
    assert [ck.segment_size(10, p) for p in ("none", "block", "sqrt", 4)] == [0, 1, 4, 4]
    with pytest.raises(ValueError, match="policy='half' is not 'none', 'block', 'sqrt'"):
        ck.segment_size(4, "half")


@pytest.mark.pure
def test_a_checkpointed_function_gets_gradients_for_inputs_and_params():
    """checkpoint() on a plain function with explicit params; an input without grad."""
    ck = impl("checkpointing.recompute")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 3, generator=g, dtype=torch.float64)  # a constant: no gradient

    def f(x, c):
        return torch.tanh(x @ w) * c

    f(x, c).sum().backward()
    want = (x.grad.clone(), w.grad.clone())
    x.grad, w.grad = None, None
    ck.checkpoint(f, x, c, params=[w]).sum().backward()
    assert torch.equal(x.grad, want[0]) and torch.equal(w.grad, want[1])
    with torch.no_grad():  # outside training nothing is kept nor recomputed
        model = ck.CheckpointedSequential(blocks(3, 3, 4, 0.0, 0), "block")
        assert not model(x).requires_grad


def checkpointed_data_parallel(comm, n: int, policy) -> None:
    """DataParallelBucketed around a checkpointed stack equals the plain stack on one process."""
    ck, dp = impl("checkpointing.recompute"), impl("data_parallel.wrappers")
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4 * comm.world_size, 3, generator=g, dtype=torch.float64)  # (4p, 3)
    ref = nn.Sequential(*blocks(n, 3, 5, 0.0, seed=1))
    ref(x).square().mean().backward()
    local = ck.CheckpointedSequential(blocks(n, 3, 5, 0.0, seed=1), policy)
    model = dp.DataParallelBucketed(local, comm, bucket_bytes=64)
    with ck.SavedTensorMeter(exclude=local.parameters()):  # thread-local: this rank's graph only
        model(x[4 * comm.rank : 4 * comm.rank + 4]).square().mean().backward()
    model.finish_gradient_sync()
    pairs = {
        f"{name}.grad": (q.grad, q_ref.grad)
        for (name, q), q_ref in zip(local.named_parameters(), ref.parameters(), strict=True)
    }
    check_all(comm, pairs, 1e-12, 1e-15, context=f"n={n} policy={policy}")


@pytest.mark.threads
@pytest.mark.parametrize("p, n, policy", [(1, 3, "block"), (3, 5, "sqrt"), (4, 4, 3)])
def test_checkpointing_under_data_parallelism(p, n, policy):
    run_threads(checkpointed_data_parallel, p, n, policy, timeout=60, comm_timeout=20)
