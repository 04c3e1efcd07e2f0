"""Context parallelism (ring attention) equals causal attention over the whole sequence in one
process, on every rank (and, with causal=False, attention without the mask).

Recipe: every rank builds q, k, v and the upstream gradient of the whole sequence from one seed,
runs plain causal attention (the (T, T) scores materialized, torch.softmax, autograd; checked
once against F.scaled_dot_product_attention), cuts this rank's tokens *here* from the layout's
positions (chunk r; or chunks r and 2cp-1-r), and compares the output and dL/dq, dL/dk, dL/dv
with check_all. The module comes from impl("context_parallel.ring_attention") inside the rank
functions, so `make lab L=15` grades a learner's lab.
Tolerance: float64, rtol 1e-12 with atol 1e-13: the log-sum-exp merge adds the blocks'
exponentials in another order than one softmax, and gradients that cancel to near zero keep the
absolute rounding of their O(1) terms (about 1e-16 each). With q scaled by s = 1000 (exp() of
a raw score would overflow): atol 1e-13 s, and 1e-13 s^2 for dL/dk = dS^T q (a score's rounding,
eps s, times |q|, up to s).
Bytes sent per rank (counted with ObservedComm), the tensors saved for backward (measured by the
saved-tensor hooks) and the causal work per rank are checked against the docstring's formulas.
Tiers: pure (the plan, the work formulas, refusals), threads (cp 1..6, hypothesis), processes
(4 mpi or gloo processes started once per test, fixed cases at cp 3 and 4), gpu (CUDA tensors on
threads; skipped without a GPU).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist.comm.wrappers import Counter, ObservedComm
from minidist.testing import check_all, impl, in_subworlds, run_ranks, run_threads, verdict

RTOL, ATOL = 1e-12, 1e-13  # float64: see the module docstring
FAST = {"timeout": 30, "comm_timeout": 8}  # a message waiting 8 s here is a deadlock
F64 = torch.float64


def positions(t: int, cp: int, rank: int, layout: str) -> torch.Tensor:
    """The global positions of rank's tokens, written out here from the layout's definition."""
    if layout == "plain":
        m = t // cp
        return torch.arange(rank * m, (rank + 1) * m)
    m = t // (2 * cp)
    late = 2 * cp - 1 - rank
    return torch.cat(
        [torch.arange(rank * m, (rank + 1) * m), torch.arange(late * m, (late + 1) * m)]
    )


def causal_attention(q, k, v, causal: bool = True):
    """softmax(q k^T / sqrt(d) + causal mask) v, one process: (B, H, T, d) -> (B, H, T, d);
    causal=False: without the mask."""
    t = q.shape[2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if causal:
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v


def leaf(t):
    return t.detach().clone().requires_grad_()


def ring_matches(comm, case: dict) -> None:
    """ring_attention vs causal_attention: the output and the gradients of q, k, v, this rank's
    tokens; q, k, v handed over non-contiguous. q x 1000: exp() of a score overflows float64
    unless every exponent is taken relative to a log-sum-exp. case["causal"] False (default
    True): both without the mask."""
    cp_module = impl("context_parallel.ring_attention")
    cp = comm.world_size
    r = comm.rank
    layout = case["layout"]
    chunks = 2 * cp if layout == "zigzag" else cp
    t, dev = case["m"] * chunks, torch.device(case.get("device", "cpu"))
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (case["b"], case["h"], t, case["d"])
    q, k, v, grad = (torch.randn(shape, generator=gen, dtype=F64).to(dev) for _ in range(4))
    q = q * case["scale"]
    full = [leaf(x) for x in (q, k, v)]
    causal = case.get("causal", True)
    y_ref = causal_attention(*full, causal)
    y_ref.backward(grad)
    mine = positions(t, cp, r, layout).to(dev)
    cut = lambda x: x.index_select(2, mine)  # noqa: E731
    local = [leaf(cut(x).transpose(1, 2).contiguous().transpose(1, 2)) for x in (q, k, v)]
    y = cp_module.ring_attention(*local, comm, layout, causal=causal)
    y.backward(cut(grad))
    pairs = {"y": (y, cut(y_ref))}
    for name, got, want in zip(("q", "k", "v"), local, full, strict=True):
        pairs[f"dL/d{name}"] = (got.grad, cut(want.grad))
    if r == 0:  # the reference itself, once: torch's own causal attention
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        pairs["reference vs sdpa"] = (y_ref.detach(), sdpa)
    pairs["y on the inputs' device"] = (torch.tensor(y.device.type == dev.type), torch.tensor(True))
    # q x s: a score carries the rounding of eps x |score|, about eps x s, and dL/dk = dS^T q
    # multiplies it by |q|, up to s: atol s^2 there, s elsewhere
    dk = {"dL/dk": pairs.pop("dL/dk")}
    check_all(comm, pairs, RTOL, ATOL * case["scale"], context=str(case))
    check_all(comm, dk, RTOL, ATOL * case["scale"] ** 2, context=str(case))


ring_cases = st.fixed_dictionaries(
    {
        "layout": st.sampled_from(["plain", "zigzag"]),
        "m": st.integers(1, 4),  # tokens per chunk
        "b": st.integers(1, 3),
        "h": st.integers(1, 3),
        "d": st.sampled_from([1, 2, 5]),
        "scale": st.sampled_from([1.0, 1000.0]),  # of q: 1000 overflows exp() without the lse
        "seed": st.integers(0, 10**6),
    }
)


@pytest.mark.threads
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), ring_cases)
def test_ring_attention_threads(cp, case):
    run_threads(ring_matches, cp, case, **FAST)


@pytest.mark.threads
@settings(max_examples=10, deadline=None)
@given(st.integers(1, 6), ring_cases)
def test_ring_attention_without_the_mask_threads(cp, case):
    run_threads(ring_matches, cp, case | {"causal": False}, **FAST)


def layer_matches(comm, case: dict) -> None:
    """ContextParallelSelfAttention (+ sum_gradients) vs the same projections and attention on
    the whole sequence: the output, dL/dx and every weight's gradient."""
    cp_module = impl("context_parallel.ring_attention")
    cp = comm.world_size
    r = comm.rank
    layout = case["layout"]
    h = case["h"]
    t, d = case["m"] * (2 * cp if layout == "zigzag" else cp), h * case["d"]
    layer = cp_module.ContextParallelSelfAttention(d, h, comm, layout, case["seed"], dtype=F64)
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    x, grad = (torch.randn(case["b"], t, d, generator=gen, dtype=F64) for _ in range(2))
    weights = {name: leaf(w) for name, w in layer.named_parameters()}
    x_ref = leaf(x)
    qkv = F.linear(x_ref, weights["qkv.weight"], weights["qkv.bias"])  # (B, T, 3D)
    q, k, v = qkv.view(case["b"], t, 3, h, case["d"]).permute(2, 0, 3, 1, 4)  # (B, H, T, d)
    heads = causal_attention(q, k, v).transpose(1, 2).reshape(case["b"], t, d)
    y_ref = F.linear(heads, weights["proj.weight"], weights["proj.bias"])
    y_ref.backward(grad)
    mine = positions(t, cp, r, layout)
    cut = lambda z: z.index_select(1, mine)  # noqa: E731
    x_local = leaf(cut(x))
    y = layer(x_local)
    y.backward(cut(grad))
    cp_module.sum_gradients(layer, comm)
    pairs = {"y": (y, cut(y_ref)), "dL/dx": (x_local.grad, cut(x_ref.grad))}
    for name, w in layer.named_parameters():
        pairs[f"dL/d{name}"] = (w.grad, weights[name].grad)
    check_all(comm, pairs, RTOL, ATOL, context=str(case))


@pytest.mark.threads
@settings(max_examples=15, deadline=None)
@given(st.integers(1, 4), ring_cases)
def test_layer_and_its_weight_gradients_threads(cp, case):
    run_threads(layer_matches, cp, case, **FAST)


# ---- the plan, the causal work, refusals -----------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize("layout", ["plain", "zigzag"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 7])
def test_the_plan_computes_every_causal_pair_once(cp, layout):
    """Over all ranks and steps, each (query chunk, key chunk) with query >= key, exactly once."""
    cpm = impl("context_parallel.ring_attention")
    seen = []
    for rank in range(cp):
        mine = cpm.chunks_of(cp, rank, layout)
        for step, pairs in enumerate(cpm.ring_plan(cp, rank, layout)):
            theirs = cpm.chunks_of(cp, (rank - step) % cp, layout)
            seen += [(mine[a], theirs[b], diagonal) for a, b, diagonal in pairs]
    c = 2 * cp if layout == "zigzag" else cp
    want = [(i, j, i == j) for i in range(c) for j in range(i + 1)]
    assert sorted(seen) == sorted(want)


@pytest.mark.pure
@pytest.mark.parametrize("layout", ["plain", "zigzag"])
@pytest.mark.parametrize("cp", [1, 3, 4])
def test_the_plan_without_the_mask_computes_every_pair_once_unmasked(cp, layout):
    cpm = impl("context_parallel.ring_attention")
    seen = []
    for rank in range(cp):
        mine = cpm.chunks_of(cp, rank, layout)
        for step, pairs in enumerate(cpm.ring_plan(cp, rank, layout, causal=False)):
            theirs = cpm.chunks_of(cp, (rank - step) % cp, layout)
            seen += [(mine[a], theirs[b], diagonal) for a, b, diagonal in pairs]
    c = 2 * cp if layout == "zigzag" else cp
    assert sorted(seen) == [(i, j, False) for i in range(c) for j in range(c)]


@pytest.mark.pure
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_causal_work_per_rank_matches_the_docstring(cp, m):
    cpm = impl("context_parallel.ring_attention")
    plain = [cpm.causal_pairs(cp * m, cp, r, "plain") for r in range(cp)]
    assert plain == [r * m * m + m * (m + 1) // 2 for r in range(cp)]
    t = 2 * cp * m
    zigzag = [cpm.causal_pairs(t, cp, r, "zigzag") for r in range(cp)]
    assert zigzag == [(2 * cp - 1) * m * m + m * (m + 1)] * cp
    assert sum(zigzag) == t * (t + 1) // 2  # the causal mask's pairs, split evenly
    t = cp * m
    assert max(plain) / (sum(plain) / cp) == ((cp - 1) * m * m + m * (m + 1) / 2) / (
        m * (t + 1) / 2
    )


class FakeComm:  # refusals talk to nobody
    def __init__(self, world_size: int, rank: int = 0):
        self.world_size, self.rank = world_size, rank


@pytest.mark.pure
def test_bad_input_is_refused_with_the_numbers():
    cpm = impl("context_parallel.ring_attention")
    c, z = FakeComm(4), torch.zeros(1, 2, 5, 3)
    refused = {
        r"sequence length T=10 is not divisible by cp=4": lambda: cpm.shard_sequence(
            torch.zeros(1, 1, 10, 2), c, "plain"
        ),
        r"T=12 is not divisible by 2\*cp=8 \(zigzag": lambda: cpm.shard_sequence(
            torch.zeros(1, 1, 12, 2), c
        ),
        r"hold 5 tokens per rank: sequence length T=20 is not divisible by 2\*cp=8": lambda: (
            cpm.ring_attention(z, z, z, c)
        ),
        r"must share one \(B, H, T/cp, d\) shape, got \[\(1, 2, 5, 3\), \(1, 2, 4, 3\)": lambda: (
            cpm.ring_attention(z, z[:, :, :4], z, c)
        ),
        r"layout='ring' is not one of": lambda: cpm.chunks_of(4, 0, "ring"),
        r"d_model=10 is not divisible by n_heads=4": lambda: cpm.ContextParallelSelfAttention(
            10, 4, c
        ),
    }
    for message, call in refused.items():
        with pytest.raises(ValueError, match=message):
            call()


def mixed_layouts(comm) -> None:
    cpm = impl("context_parallel.ring_attention")
    x = torch.ones(1, 1, 2, 2, dtype=F64)
    cpm.ring_attention(x, x, x, comm, "plain" if comm.rank == 0 else "zigzag")


@pytest.mark.threads
def test_ranks_with_different_layouts_fail_naming_the_message_never_wrong_numbers():
    # each rank waits for a message the other sent with another tag: a deadlock, named at once
    named = r"rank 0 waits in recv\(from 1, tag [02],.*rank 1 sent this rank 8 x torch.float64"
    with pytest.raises(AssertionError, match=named):
        run_threads(mixed_layouts, 2, timeout=10, comm_timeout=2)


# ---- bytes, saved tensors and measured work per rank ----------------------------------------

# batch, heads, head dim, tokens per chunk
B = 2
H = 3
D = 4
M = 2


def measured(comm, layout: str) -> dict:
    """Bytes sent forward and backward, messages' peers, saved bytes and work, on one rank."""
    cpm = impl("context_parallel.ring_attention")
    counter = Counter()
    saved = {}
    stats = {}
    c = ObservedComm(comm, counter)
    n = M * (2 if layout == "zigzag" else 1)  # tokens per rank
    gen = torch.Generator().manual_seed(comm.rank)
    q, k, v = (leaf(torch.randn(B, H, n, D, generator=gen, dtype=F64)) for _ in range(3))

    def pack(t):  # every tensor autograd saves for backward, by storage
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = cpm.ring_attention(q, k, v, c, layout, stats)
    forward = counter.summary()
    counter.reset()
    y.sum().backward()
    return {
        "forward": forward,
        "backward": counter.summary(),
        "saved": sum(saved.values()),
        "pairs": stats["pairs"],
        "n": B * H * n * D,
    }


@pytest.mark.pure
@pytest.mark.parametrize("m", [1, 4])
def test_merge_of_two_key_halves_equals_one_softmax(m):
    """Lab 15.1 alone: each half's attention and log-sum-exp, merged, is the attention to all
    the keys, in either order; a side with no keys yet (lse = -inf) weighs nothing."""
    cpm = impl("context_parallel.ring_attention")
    gen = torch.Generator().manual_seed(15 + m)
    q = torch.randn(2, 3, m, 4, generator=gen, dtype=F64)  # (B, H, m, d)
    k, v = (torch.randn(2, 3, 2 * m, 4, generator=gen, dtype=F64) for _ in range(2))
    s = q @ k.transpose(-2, -1) / 2  # (B, H, m, 2m); scale 1/sqrt(d)
    want, want_lse = torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)
    halves = [
        (torch.softmax(h, -1) @ w, torch.logsumexp(h, -1))
        for h, w in ((s[..., :m], v[:, :, :m]), (s[..., m:], v[:, :, m:]))
    ]
    for first, second in (halves, halves[::-1]):
        out, lse = cpm.merge(*first, *second)
        assert torch.allclose(out, want, RTOL, ATOL), (out - want).abs().max()
        assert torch.allclose(lse, want_lse, RTOL, ATOL), (lse - want_lse).abs().max()
    nothing = (torch.zeros_like(want), torch.full_like(want_lse, -math.inf))
    out, lse = cpm.merge(*nothing, want, want_lse)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.pure
@pytest.mark.parametrize("diagonal", [False, True])
def test_block_grads_equal_autograd_on_one_block(diagonal):
    """Lab 15.3 alone: one block's dq, dk, dv from the saved log-sum-exp equal autograd's
    through softmax(q k^T * scale) v (on a diagonal block, the future masked)."""
    cpm = impl("context_parallel.ring_attention")
    gen = torch.Generator().manual_seed(153)
    q, k, v, grad_out = (torch.randn(2, 3, 5, 4, generator=gen, dtype=F64) for _ in range(4))
    q = leaf(q)
    k = leaf(k)
    v = leaf(v)
    s = q @ k.transpose(-2, -1) * 0.5  # (B, H, m, m)
    if diagonal:
        s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -math.inf)
    out = torch.softmax(s, -1) @ v
    (out * grad_out).sum().backward()
    lse, delta = torch.logsumexp(s, -1).detach(), (grad_out * out).sum(-1).detach()
    got = cpm.block_grads(q.detach(), k.detach(), v.detach(), grad_out, lse, delta, diagonal, 0.5)
    for name, a, b in zip(("dq", "dk", "dv"), got, (q.grad, k.grad, v.grad), strict=True):
        assert torch.allclose(a, b, RTOL, ATOL), (name, (a - b).abs().max())


@pytest.mark.threads
@pytest.mark.parametrize("layout", ["plain", "zigzag"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_bytes_saved_tensors_and_work_match_the_formulas(cp, layout):
    cpm = impl("context_parallel.ring_attention")
    for r, got in enumerate(run_threads(measured, cp, layout, **FAST)):
        n = got["n"]
        b = 8
        nxt = (r + 1) % cp
        fwd, bwd = got["forward"], got["backward"]
        assert fwd["sent_to"] == ({nxt: 2 * (cp - 1) * n * b} if cp > 1 else {}), (r, fwd)
        assert fwd["calls"].get("send", 0) == cp - 1, (r, fwd)
        want = {nxt: 2 * (2 * cp - 1) * n * b} if cp > 1 else {}
        assert bwd["sent_to"] == want, (r, bwd)
        assert bwd["calls"].get("send", 0) == (2 * cp - 1 if cp > 1 else 0), (r, bwd)
        assert set(fwd["received_from"]) | set(bwd["received_from"]) <= {(r - 1) % cp}
        t = n // D // B // H * cp  # the whole sequence
        assert got["saved"] == (4 * D + 1) * B * H * (t // cp) * b, (r, got["saved"])
        assert got["pairs"] == 2 * cpm.causal_pairs(t, cp, r, layout), (r, got["pairs"])


@pytest.mark.threads
@pytest.mark.parametrize("cp", [2, 4])
def test_saved_activations_fall_as_one_over_cp(cp):
    """The same sequence (T = 2 cp M tokens) on one rank and on cp ranks: 1/cp of the bytes."""
    alone = run_threads(measured_whole, 1, 2 * cp * M, **FAST)[0]
    split = run_threads(measured_whole, cp, 2 * cp * M, **FAST)
    assert all(s * cp == alone for s in split), (alone, split)


def in_flight(comm, layout: str) -> dict:
    """Peak bytes of k|v blocks and score-sized tensors alive at once in one forward, the comm's
    own buffers (the threads backend's copies) left out."""
    from minidist.context_parallel.bench import Unmetered, kind_of
    from minidist.memory import LiveTensorMeter

    cpm = impl("context_parallel.ring_attention")
    n = M * (2 if layout == "zigzag" else 1)  # tokens per rank
    q, k, v = (torch.ones(B, H, n, D, dtype=F64) for _ in range(3))
    with LiveTensorMeter(kind_of((B, H, n, D), M)) as meter:
        cpm.ring_attention(q, k, v, Unmetered(comm, meter), layout)
    return meter.peak


@pytest.mark.threads
@pytest.mark.parametrize("layout", ["plain", "zigzag"])
def test_peak_memory_in_flight_matches_the_formula(layout):
    """Two k|v blocks (one at cp = 1) and three (B, H, m, m) score tensors, measured for every
    op's output as it is made and freed, on every rank, cp = 1..4; inflight_nbytes says so."""
    per_rank = M * (2 if layout == "zigzag" else 1)  # tokens; chunks of M either way
    for cp in (1, 2, 3, 4):
        want = impl("context_parallel.ring_attention").inflight_nbytes(
            B, H, cp * per_rank, D, cp, layout, 8
        )
        n = B * H * per_rank * D  # elements of this rank's q
        assert want == {"kv": (4 if cp > 1 else 2) * n * 8, "scores": 3 * B * H * M * M * 8}
        for r, peak in enumerate(run_threads(in_flight, cp, layout, **FAST)):
            got = {key: peak.get(key, 0) for key in want}
            assert got == want, (cp, r, got, want)


def measured_whole(comm, t: int) -> int:
    cpm = impl("context_parallel.ring_attention")
    n = t // comm.world_size
    q, k, v = (leaf(torch.ones(B, H, n, D, dtype=F64)) for _ in range(3))
    saved = {}

    def pack(x):
        saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        y = cpm.ring_attention(q, k, v, comm)
    y.sum().backward()
    return sum(saved.values())


def layer_all_reduce(comm) -> dict:
    cpm = impl("context_parallel.ring_attention")
    counter = Counter()
    c = ObservedComm(comm, counter)
    layer = cpm.ContextParallelSelfAttention(H * D, H, c, dtype=F64)
    layer(leaf(torch.ones(B, 2 * M, H * D, dtype=F64))).sum().backward()
    counter.reset()
    cpm.sum_gradients(layer, c)
    return counter.summary()


@pytest.mark.threads
@pytest.mark.parametrize("cp", [1, 3])
def test_the_layer_sums_its_weight_gradients_in_one_all_reduce_each(cp):
    width = H * D
    for got in run_threads(layer_all_reduce, cp, **FAST):
        assert got["calls"] == {"all_reduce": 4}, got  # qkv and proj, weight and bias
        assert got["nbytes"] == {"all_reduce": (4 * width * width + 4 * width) * 8}, got


# ---- processes: the same properties over real mpi and gloo processes ------------------------


# the process tier's fixed cases (the threads tier draws the sweep): (world, (the layer?, case))
# both layouts, the layer and the bare ring, exp() overflowing without the lse, an odd world
HARD = [
    (4, (False, {"layout": "plain", "m": 3, "b": 2, "h": 2, "d": 5, "scale": 1000.0, "seed": 3})),
    (4, (True, {"layout": "zigzag", "m": 2, "b": 2, "h": 2, "d": 2, "scale": 1.0, "seed": 4})),
    (3, (False, {"layout": "zigzag", "m": 1, "b": 1, "h": 3, "d": 1, "scale": 1000.0, "seed": 5})),
]


def properties_in_ranks(comm, max_examples: int) -> int:
    cases = st.tuples(st.booleans(), ring_cases)  # (the layer?, the case)
    check = lambda sub, c: (layer_matches if c[0] else ring_matches)(sub, c[1])  # noqa: E731
    explicit = [(min(k, comm.world_size), case) for k, case in HARD]
    count = in_subworlds(comm, check, cases, max_examples, None, explicit)
    # in flight over real processes too: a backend that holds a buffer past its wait (a
    # reference cycle only gc frees) shows here as a third k|v block
    cp, per_rank = comm.world_size, 2 * M
    want = impl("context_parallel.ring_attention").inflight_nbytes(
        B, H, cp * per_rank, D, cp, "zigzag", 8
    )
    peak = in_flight(comm, "zigzag")
    got = {key: peak.get(key, 0) for key in want}
    verdict(comm, got == want, f"rank {comm.rank} in flight: {got}, want {want}")
    return count


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_ring_attention_processes(backend):
    assert run_ranks(properties_in_ranks, 4, backend, 0, timeout=180) == [len(HARD)] * 4


# ---- gpu: the threads tier with CUDA tensors ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["plain", "zigzag"])
def test_cuda_tensors_on_threads(layout):
    case = {"layout": layout, "m": 3, "b": 2, "h": 2, "d": 4, "scale": 1.0, "seed": 5}
    run_threads(ring_matches, 3, dict(case, device="cuda"), **FAST)
