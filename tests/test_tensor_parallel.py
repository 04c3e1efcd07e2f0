"""Tensor parallelism equals the same layers in one process, on every rank.

Recipe: every rank builds the whole problem from one seed (full weights, input, upstream
gradient), runs the plain torch reference (nn.Linear; a transformer block computed here with
F.scaled_dot_product_attention, independently of the module's own attention; nn.Embedding;
F.cross_entropy), slices what this rank must hold *here, in the test*, and compares outputs,
input gradients and every parameter and gradient slice with check_all. Shapes are odd multiples
of tp (e.g. 13*tp x 17*tp, batch 7). The modules come from impl(...) inside the rank functions,
so `make lab L=05` grades a learner's tensor_parallel/layers.py.
Tolerance: float64, rtol 1e-12 with atol 1e-13: the all-reduce adds the partial products in
another order than one matmul, and elements that cancel to near zero keep the absolute rounding
error of their O(1) terms (about 1e-16 per term). Cross-entropy with logits scaled by 1000:
atol scaled alike. float32 (test_float32_block): normwise, every element within 1e-5 of its
tensor's largest |element| (float32 rounds at 6e-8; the sums have tens of terms).
Collectives and payload bytes per layer are counted with ObservedComm and checked against the
module docstrings' formulas; the activation memory a block saves for backward is measured and
equals the formula, and sequence parallelism divides it by tp exactly.
Tiers: pure (errors, the master-weight recipe), threads (tp 1..8, hypothesis), processes (4 mpi
or gloo processes started once per test, fixed cases at tp 3 and 4), gpu (CUDA tensors on threads).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minidist import transformer
from minidist.comm.wrappers import Counter, ObservedComm
from minidist.tensor_parallel import mappings
from minidist.testing import check_all, impl, run_ranks, run_threads

RTOL, ATOL = 1e-12, 1e-13  # float64: see the module docstring
FAST = {"timeout": 30, "comm_timeout": 8}  # a collective waiting 8 s here is a deadlock
F64 = torch.float64


def randn(gen, *shape, dtype=F64):
    return torch.randn(*shape, generator=gen, dtype=dtype)


def full_linear(i: int, o: int, bias: bool, gen, dtype=F64) -> nn.Linear:
    lin = nn.utils.skip_init(nn.Linear, i, o, bias, dtype=dtype)  # no global RNG: threads share it
    with torch.no_grad():
        lin.weight.copy_(randn(gen, o, i, dtype=dtype))
        if bias:
            lin.bias.copy_(randn(gen, o, dtype=dtype))
    return lin


def rows(t, r: int, p: int):
    """Rank r's equal share of dim 0."""
    n = t.shape[0] // p
    return t[r * n : (r + 1) * n]


def cols(t, r: int, p: int, dim: int = -1):
    n = t.shape[dim] // p
    return t.narrow(dim, r * n, n)


def leaf(t):
    return t.detach().clone().requires_grad_()


# ---- linear layers ---------------------------------------------------------------------------


def linear_matches(comm, case: dict) -> None:
    """Column- or row-parallel linear (every option) vs nn.Linear: y, dL/dx, W and b and grads."""
    tp = impl("tensor_parallel.layers")
    p = comm.world_size
    r = comm.rank
    kind = case["kind"]
    sp = case["sp"]
    gen = torch.Generator().manual_seed(case["seed"])
    i = case["i"] * p
    o = case["o"] * p
    b = case["b"]
    t = case["t"] * p
    lin = full_linear(i, o, case["bias"], gen)
    x, gy = randn(gen, b, t, i), randn(gen, b, t, o)
    x_ref = leaf(x)
    lin(x_ref).backward(gy)
    y_ref = lin(x).detach()
    seq = (lambda z: cols(z, r, p, 1)) if sp else (lambda z: z)  # this rank's tokens
    if kind == "column":
        layer = tp.ColumnParallelLinear.from_full(
            lin, comm, gather_output=case["gather"] and not sp, sequence_parallel=sp
        )
        x_in, want_dx = seq(x), seq(x_ref.grad)
        out_slice = (lambda z: z) if case["gather"] and not sp else (lambda z: cols(z, r, p))
        want = {
            "weight": rows(lin.weight, r, p),
            "bias": rows(lin.bias, r, p) if case["bias"] else 0,
        }
        want_grad = {"weight": rows(lin.weight.grad, r, p)}
        if case["bias"]:
            want_grad["bias"] = rows(lin.bias.grad, r, p)
    else:
        split = case["gather"]  # reused: the row layer splits x itself
        layer = tp.RowParallelLinear.from_full(
            lin, comm, input_is_parallel=not split, sequence_parallel=sp
        )
        x_in = x if split else cols(x, r, p)
        want_dx = x_ref.grad if split else cols(x_ref.grad, r, p)
        out_slice = seq
        want = {"weight": cols(lin.weight, r, p), "bias": lin.bias if case["bias"] else 0}
        want_grad = {"weight": cols(lin.weight.grad, r, p)}
        if case["bias"]:
            want_grad["bias"] = lin.bias.grad
    if not sp and case["flat"]:  # 2-d input (batch*tokens, features)
        x_in, want_dx, y_ref, gy = (z.reshape(-1, z.shape[-1]) for z in (x_in, want_dx, y_ref, gy))
    x_in = leaf(x_in.transpose(0, 1).contiguous().transpose(0, 1))  # non-contiguous input
    y = layer(x_in)
    y.backward(out_slice(gy))
    pairs = {"y": (y, out_slice(y_ref)), "dL/dx": (x_in.grad, want_dx)}
    for name, q in layer.named_parameters():
        pairs[name] = (q, want[name])
        pairs[f"dL/d{name}"] = (q.grad, want_grad[name])
    check_all(comm, pairs, RTOL, ATOL, context=str(case))


linear_cases = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["column", "row"]),
        "i": st.sampled_from([1, 2, 13]),
        "o": st.sampled_from([1, 3, 17]),
        "b": st.sampled_from([1, 2, 7]),
        "t": st.integers(1, 3),
        "bias": st.booleans(),
        "gather": st.booleans(),  # column: gather_output; row: not input_is_parallel
        "sp": st.booleans(),
        "flat": st.booleans(),
        "seed": st.integers(0, 10**6),
    }
)


@pytest.mark.threads
@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), linear_cases.map(lambda case: case | {"kind": "row"}))
def test_row_parallel_linear_threads(p, case):
    """RowParallelLinear (lab 05.1): its forward's split, matmul, g and bias."""
    run_threads(linear_matches, p, case, **FAST)


@pytest.mark.threads
@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), linear_cases.map(lambda case: case | {"kind": "column"}))
def test_column_parallel_linear_threads(p, case):
    """ColumnParallelLinear; with sequence parallelism its backward is lab 05.3's."""
    run_threads(linear_matches, p, case, **FAST)


def seeded_linear(comm, seed: int) -> None:
    """Built from a seed, a layer holds its slice of the documented master weight."""
    tp = impl("tensor_parallel.layers")
    p, r = comm.world_size, comm.rank
    gen = torch.Generator().manual_seed(seed)
    w = torch.empty(6 * p, 4 * p, dtype=F64).uniform_(-0.5 / p**0.5, 0.5 / p**0.5, generator=gen)
    b = torch.empty(6 * p, dtype=F64).uniform_(-0.5 / p**0.5, 0.5 / p**0.5, generator=gen)
    col = tp.ColumnParallelLinear(4 * p, 6 * p, comm, seed=seed, dtype=F64)
    qkv = tp.ColumnParallelLinear(4 * p, 6 * p, comm, parts=3, seed=seed, dtype=F64)
    row = tp.RowParallelLinear(4 * p, 6 * p, comm, seed=seed, dtype=F64)
    parts = torch.cat([rows(chunk, r, p) for chunk in w.chunk(3)])  # q, k, v: each own slice
    pairs = {
        "column W": (col.weight, rows(w, r, p)),
        "column b": (col.bias, rows(b, r, p)),
        "qkv W": (qkv.weight, parts),
        "qkv b": (qkv.bias, torch.cat([rows(chunk, r, p) for chunk in b.chunk(3)])),
        "row W": (row.weight, cols(w, r, p)),
        "row b": (row.bias, b),
    }
    check_all(comm, pairs)  # exact: the same draws, sliced


@pytest.mark.threads
@pytest.mark.parametrize("p", [1, 2, 3])
def test_seeded_layers_hold_slices_of_the_master_weight(p):
    run_threads(seeded_linear, p, 7, **FAST)


def world_of_one_is_plain_torch(comm) -> None:
    """tp = 1: ColumnParallelLinear runs exactly nn.Linear's op, so bitwise equal."""
    tp = impl("tensor_parallel.layers")
    gen = torch.Generator().manual_seed(3)
    lin = full_linear(5, 7, True, gen)
    x = randn(gen, 4, 5)
    check_all(comm, {"y": (tp.ColumnParallelLinear.from_full(lin, comm)(x), lin(x))})


@pytest.mark.threads
def test_world_size_1_column_is_bitwise_nn_linear():
    run_threads(world_of_one_is_plain_torch, 1, **FAST)


# ---- the conjugate operators -------------------------------------------------------------------


def operators_match(comm, shape: tuple, dim: int, seed: int) -> None:
    """f, g, scatter, gather, reduce-scatter: values and gradients from every rank's data."""
    p, r = comm.world_size, comm.rank
    shape = [n * p if d == dim % 3 else n for d, n in enumerate(shape)]
    big = [n * p if d == dim % 3 else n for d, n in enumerate(shape)]
    xs = [randn(torch.Generator().manual_seed(seed * 100 + q), *shape) for q in range(p)]
    gys = [randn(torch.Generator().manual_seed(seed * 100 + 50 + q), *shape) for q in range(p)]
    gy_big = randn(torch.Generator().manual_seed(seed * 100 + 99 - r), *big)
    x0, gy = xs[r], gys[r]

    def mine(t, q=r):  # rank q's chunk along dim
        return cols(t, q, p, dim)

    ops = {  # name: (op, expected y, upstream gradient, expected dL/dx)
        "f": (lambda z: mappings.f(z, comm), x0, gy, sum(gys)),
        "g": (lambda z: mappings.g(z, comm), sum(xs), gy, gy),
        "scatter": (
            lambda z: mappings.ScatterToRegion.apply(z, comm, dim),
            mine(x0),
            mine(gy),
            torch.cat([mine(gys[q], q) for q in range(p)], dim),
        ),
        "gather": (
            lambda z: mappings.GatherFromRegion.apply(z, comm, dim),
            torch.cat(xs, dim),
            gy_big,
            cols(gy_big, r, p, dim),
        ),
    }
    if dim == 1:
        rs = (lambda z: mappings.ReduceScatterToSequence.apply(z, comm), mine(sum(xs)), mine(gy))
        ops["reduce_scatter"] = (*rs, torch.cat([mine(gys[q], q) for q in range(p)], dim))
    pairs = {}
    for name, (op, want_y, upstream, want_dx) in ops.items():
        x = leaf(x0)
        y = op(x.transpose(0, -1).contiguous().transpose(0, -1))  # a non-contiguous input
        y.backward(upstream)
        pairs[f"{name}(x)"] = (y, want_y)
        pairs[f"{name} dL/dx"] = (x.grad, want_dx)
        pairs[f"{name}: x untouched"] = (x.detach(), x0)
    check_all(comm, pairs, RTOL, ATOL, context=f"shape={shape} dim={dim}")


@pytest.mark.threads
@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.integers(1, 4), min_size=3, max_size=3).map(tuple),
    st.sampled_from([0, 1, -1]),
    st.integers(0, 10**6),
)
def test_conjugate_operators_threads(p, shape, dim, seed):
    run_threads(operators_match, p, shape, dim, seed, **FAST)


# ---- transformer layers ------------------------------------------------------------------------


def reference_block(full, x, part: str):
    """The block's maths written out here with F.scaled_dot_product_attention, from full's
    weights: part "attention" (attention alone), "mlp", or "block" (pre-LayerNorm, residuals)."""
    d = x.shape[-1]

    def attn(h):
        b, t, _ = h.shape
        q, k, v = F.linear(h, full.qkv.weight, full.qkv.bias).split(d, -1)  # each (B, T, D)
        heads = [z.view(b, t, full.n_heads, -1).transpose(1, 2) for z in (q, k, v)]
        y = F.scaled_dot_product_attention(*heads, is_causal=full.causal)  # (B, H, T, hd)
        return F.linear(y.transpose(1, 2).reshape(b, t, d), full.proj.weight, full.proj.bias)

    def mlp(h):
        return F.linear(
            F.gelu(F.linear(h, full.fc1.weight, full.fc1.bias)), full.fc2.weight, full.fc2.bias
        )

    if part == "attention":
        return attn(x)
    if part == "mlp":
        return mlp(x)
    h = x + attn(F.layer_norm(x, (d,), full.ln1.weight, full.ln1.bias))
    return h + mlp(F.layer_norm(h, (d,), full.ln2.weight, full.ln2.bias))


def expected_slices(full, r: int, p: int, grad: bool) -> dict:
    """Rank r's share of every parameter (or its gradient), named as in the parallel block."""

    def get(name):
        q = getattr(full, name.split(".")[0]).get_parameter(name.split(".")[1])
        if not grad:
            return q.detach()
        return torch.zeros_like(q) if q.grad is None else q.grad  # None: a part not under test

    d = full.qkv.weight.shape[1]
    qkv_w, qkv_b = get("qkv.weight"), get("qkv.bias")
    return {
        "ln1.weight": get("ln1.weight"),
        "ln1.bias": get("ln1.bias"),
        "attn.qkv.weight": torch.cat([rows(qkv_w[k * d : (k + 1) * d], r, p) for k in range(3)]),
        "attn.qkv.bias": torch.cat([rows(qkv_b[k * d : (k + 1) * d], r, p) for k in range(3)]),
        "attn.proj.weight": cols(get("proj.weight"), r, p),
        "attn.proj.bias": get("proj.bias"),
        "ln2.weight": get("ln2.weight"),
        "ln2.bias": get("ln2.bias"),
        "mlp.fc1.weight": rows(get("fc1.weight"), r, p),
        "mlp.fc1.bias": rows(get("fc1.bias"), r, p),
        "mlp.fc2.weight": cols(get("fc2.weight"), r, p),
        "mlp.fc2.bias": get("fc2.bias"),
    }


def build_parallel(blocks, full, comm, case: dict, dtype):
    """The parallel part under test: from a seed (the twin's seed) or from_full(full)."""
    kw = {"sequence_parallel": case["sp"], "dtype": dtype}
    d = full.qkv.weight.shape[1]
    h = full.n_heads
    d_ff = full.fc1.weight.shape[0]
    seed = case["seed"]
    if case["part"] == "mlp":
        return blocks.ParallelMLP(d, d_ff, comm, seed + 2, **kw), "mlp."
    if case["part"] == "attention":
        return blocks.ParallelSelfAttention(d, h, comm, full.causal, seed, **kw), "attn."
    if case["from_full"]:
        return blocks.ParallelTransformerBlock.from_full(full, comm, case["sp"]), ""
    return blocks.ParallelTransformerBlock(d, h, d_ff, comm, full.causal, seed, **kw), ""


def block_matches(comm, case: dict, dtype=F64, rtol=RTOL, atol=ATOL) -> None:
    """A parallel MLP, attention or block (sequence-parallel or not) vs the reference maths."""
    blocks = impl("tensor_parallel.blocks")
    p = comm.world_size
    r = comm.rank
    sp = case["sp"]
    h = case["heads"] * p
    hd = case["hd"]
    d_ff = case["ff"] * p
    t = case["t"] * p
    d = h * hd
    full = transformer.TransformerBlock(d, h, d_ff, case["causal"], case["seed"], dtype=dtype)
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    if case["from_full"]:  # LayerNorms away from ones and zeros, so their slices matter
        with torch.no_grad():
            for ln in (full.ln1, full.ln2):
                ln.weight.copy_(randn(gen, d, dtype=dtype))
                ln.bias.copy_(randn(gen, d, dtype=dtype))
    x, gy = randn(gen, case["b"], t, d, dtype=dtype), randn(gen, case["b"], t, d, dtype=dtype)
    x_ref = leaf(x)
    y_ref = reference_block(full, x_ref, case["part"])
    y_ref.backward(gy)
    layer, prefix = build_parallel(blocks, full, comm, case, dtype)
    seq = (lambda z: cols(z, r, p, 1)) if sp else (lambda z: z)  # this rank's tokens
    x_in = leaf(seq(x))
    y = layer(x_in)
    y.backward(seq(gy))
    pairs = {"y": (y, seq(y_ref)), "dL/dx": (x_in.grad, seq(x_ref.grad))}
    want, want_grad = expected_slices(full, r, p, False), expected_slices(full, r, p, True)
    for name, q in layer.named_parameters():
        pairs[prefix + name] = (q, want[prefix + name])
        pairs[f"dL/d{prefix + name}"] = (q.grad, want_grad[prefix + name])
    if case["part"] == "block" and r == 0:  # the twin's own forward, once
        pairs["TransformerBlock(x)"] = (full(x), y_ref)
    if dtype == torch.float32:  # normwise: each tensor over its largest |element|
        pairs = {
            k: (a / e.abs().max().clamp_min(1e-30), e / e.abs().max().clamp_min(1e-30))
            for k, (a, e) in pairs.items()
        }
    check_all(comm, pairs, rtol, atol, context=str(case))


block_cases = st.fixed_dictionaries(
    {
        "part": st.sampled_from(["mlp", "attention", "block"]),
        "heads": st.integers(1, 2),  # per rank
        "hd": st.sampled_from([1, 3]),
        "ff": st.sampled_from([1, 5]),  # per rank
        "b": st.sampled_from([1, 2, 7]),
        "t": st.integers(1, 3),  # tokens per rank
        "causal": st.booleans(),
        "sp": st.booleans(),
        "from_full": st.booleans(),
        "seed": st.integers(0, 10**6),
    }
)


@pytest.mark.threads
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), block_cases)
def test_transformer_layers_threads(p, case):
    run_threads(block_matches, p, case, **FAST)


def float32_block(comm, sp: bool) -> None:
    case = {
        "part": "block",
        "heads": 2,
        "hd": 4,
        "ff": 8,
        "b": 3,
        "t": 5,
        "causal": True,
        "sp": sp,
        "from_full": True,
        "seed": 11,
    }
    block_matches(comm, case, torch.float32, rtol=0.0, atol=1e-5)


@pytest.mark.threads
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_float32_block(p, sp):
    """float32: every element within 1e-5 of its tensor's largest |element| (normwise). float32
    rounds at 6e-8 per operation; the sums here have tens of terms, added in another order than
    the single-process matmuls; measured worst 2e-7. Elementwise relative error means nothing
    for the elements near zero that such sums produce."""
    run_threads(float32_block, p, sp, **FAST)


# ---- vocabulary-parallel embedding and cross-entropy -------------------------------------------


def vocab_matches(comm, case: dict) -> None:
    """VocabParallelEmbedding vs nn.Embedding; vocab_parallel_cross_entropy vs F.cross_entropy."""
    tp, blocks = impl("tensor_parallel.layers"), impl("tensor_parallel.blocks")
    p = comm.world_size
    r = comm.rank
    sp = case["sp"]
    gen = torch.Generator().manual_seed(case["seed"])
    v = case["v"] * p
    d = case["d"]
    b = case["b"]
    t = case["t"] * p
    emb = nn.Embedding(v, d, _weight=randn(gen, v, d))
    ids = torch.randint(0, v, (b, t), generator=gen)
    ge = randn(gen, b, t, d)
    emb(ids).backward(ge)
    seq = (lambda z: cols(z, r, p, 1)) if sp else (lambda z: z)
    layer = blocks.VocabParallelEmbedding.from_full(emb, comm, sequence_parallel=sp)
    e = layer(ids)
    e.backward(seq(ge))
    logits = leaf(randn(gen, b, t, v) * case["scale"])
    target = torch.randint(0, v, (b, t), generator=gen)
    gl = randn(gen, b, t)
    loss_ref = F.cross_entropy(logits.view(-1, v), target.view(-1), reduction="none").view(b, t)
    loss_ref.backward(gl)
    logits_local = leaf(cols(logits, r, p))
    loss = tp.vocab_parallel_cross_entropy(logits_local, target, comm)
    loss.backward(gl)
    mean = tp.vocab_parallel_cross_entropy(logits_local.detach(), target, comm).mean()
    pairs = {
        "embedding(ids)": (e, seq(emb(ids))),
        "embedding W": (layer.weight, rows(emb.weight, r, p)),
        "dL/dW": (layer.weight.grad, rows(emb.weight.grad, r, p)),
        "loss": (loss, loss_ref),
        "mean loss": (mean, F.cross_entropy(logits.view(-1, v), target.view(-1))),
        "dL/dlogits": (logits_local.grad, cols(logits.grad, r, p)),
    }
    check_all(comm, pairs, RTOL, ATOL * case["scale"], context=str(case))


vocab_cases = st.fixed_dictionaries(
    {
        "v": st.sampled_from([1, 2, 13]),  # per rank
        "d": st.sampled_from([1, 17]),
        "b": st.sampled_from([1, 7]),
        "t": st.integers(1, 3),
        "scale": st.sampled_from([1.0, 1000.0]),  # 1000: exp() overflows without the max
        "sp": st.booleans(),
        "seed": st.integers(0, 10**6),
    }
)


@pytest.mark.threads
@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), vocab_cases)
def test_vocab_parallel_threads(p, case):
    run_threads(vocab_matches, p, case, **FAST)


# ---- collectives and bytes per layer, activation memory ----------------------------------------

# T, H and FF divisible by the tp sizes counted below (1, 2, 4)
B = 2
T = 4
D = 8
H = 4
FF = 8


def counted(comm, part: str, sp: bool) -> dict:
    """{"forward": Counter.summary(), "backward": ...} for one part on an ObservedComm."""
    tp, blocks = impl("tensor_parallel.layers"), impl("tensor_parallel.blocks")
    counter = Counter()
    c = ObservedComm(comm, counter)
    p = comm.world_size
    kw = {"sequence_parallel": sp, "dtype": F64}
    t_in = T // p if sp else T
    x = leaf(torch.ones(B, t_in, D, dtype=F64))
    make = {
        "column": lambda: tp.ColumnParallelLinear(D, FF, c, **kw),
        "row": lambda: tp.RowParallelLinear(FF, D, c, input_is_parallel=True, **kw),
        "mlp": lambda: blocks.ParallelMLP(D, FF, c, **kw),
        "attention": lambda: blocks.ParallelSelfAttention(D, H, c, **kw),
        "block": lambda: blocks.ParallelTransformerBlock(D, H, FF, c, **kw),
        "embedding": lambda: blocks.VocabParallelEmbedding(FF, D, c, **kw),
        "cross_entropy": lambda: lambda z: tp.vocab_parallel_cross_entropy(z, ids, c),
    }
    ids = torch.zeros(B, T, dtype=torch.int64)
    if part == "row":
        x = leaf(torch.ones(B, T, FF // p, dtype=F64))
    if part in ("embedding", "cross_entropy"):
        x = ids if part == "embedding" else leaf(torch.ones(B, T, FF // p, dtype=F64))
    layer = make[part]()
    counter.reset()
    y = layer(x)
    out = {"forward": counter.summary()}
    counter.reset()
    y.sum().backward()
    out["backward"] = counter.summary()
    return out


def calls(s: dict) -> dict:
    return {op: (n, s["nbytes"][op]) for op, n in s["calls"].items()}


BTD = B * T * D * 8  # bytes of one (B, T, D) float64 activation


AR = "all_reduce"
AG = "all_gather"
RS = "reduce_scatter"
# (part, sequence parallel): forward, backward: {op: (calls, payload bytes)}, as documented;
# with sequence parallelism an all-gather's payload is this rank's shard, B*T*D/p
COUNTS = {
    ("column", False): lambda p: ({}, {AR: (1, BTD)}),  # f: dL/dx summed
    ("column", True): lambda p: ({AG: (1, BTD // p)}, {AG: (1, BTD // p), RS: (1, BTD)}),
    ("row", False): lambda p: ({AR: (1, BTD)}, {}),  # g
    ("row", True): lambda p: ({RS: (1, BTD)}, {AG: (1, BTD // p), AR: (1, D * 8)}),  # f(bias)
    ("cross_entropy", False): lambda p: ({AR: (3, 3 * B * T * 8)}, {}),  # max, target, sum exp
    ("mlp", False): lambda p: ({AR: (1, BTD)}, {AR: (1, BTD)}),
    ("attention", False): lambda p: ({AR: (1, BTD)}, {AR: (1, BTD)}),
    ("block", False): lambda p: ({AR: (2, 2 * BTD)}, {AR: (2, 2 * BTD)}),
    ("embedding", False): lambda p: ({AR: (1, BTD)}, {}),
    ("mlp", True): lambda p: (
        {AG: (1, BTD // p), RS: (1, BTD)},
        {AG: (2, 2 * BTD // p), RS: (1, BTD), AR: (1, D * 8)},  # + fc2's bias gradient
    ),
    ("block", True): lambda p: (
        {AG: (2, 2 * BTD // p), RS: (2, 2 * BTD)},
        {AG: (4, 4 * BTD // p), RS: (2, 2 * BTD), AR: (6, 6 * D * 8)},  # 2 LN x 2 + 2 bias
    ),
    ("embedding", True): lambda p: ({RS: (1, BTD)}, {AG: (1, BTD // p)}),
}


def check_counts(p: int, parts: list[str]) -> None:
    """Every rank's collectives and bytes, forward and backward, for these parts: COUNTS."""
    for (part, sp), want in COUNTS.items():
        if part not in parts:
            continue
        forward, backward = want(p)
        for got in run_threads(counted, p, part, sp, **FAST):
            assert calls(got["forward"]) == forward, (part, sp, "forward", got["forward"])
            assert calls(got["backward"]) == backward, (part, sp, "backward", got["backward"])


@pytest.mark.threads
@pytest.mark.parametrize("p", [1, 2, 4])
def test_row_parallel_collectives_and_bytes_match_the_docstring(p):
    check_counts(p, ["row"])  # lab 05.1


@pytest.mark.threads
@pytest.mark.parametrize("p", [1, 2, 4])
def test_cross_entropy_collectives_and_bytes_match_the_docstring(p):
    check_counts(p, ["cross_entropy"])  # lab 05.2


@pytest.mark.threads
@pytest.mark.parametrize("p", [1, 2, 4])
def test_column_parallel_collectives_and_bytes_match_the_docstring(p):
    check_counts(p, ["column"])  # with sequence parallelism, lab 05.3's backward


@pytest.mark.threads
@pytest.mark.parametrize("p", [1, 2, 4])
def test_collectives_and_bytes_per_layer_match_the_docstrings(p):
    check_counts(p, ["mlp", "attention", "block", "embedding"])  # the layers made of them


def measured_activations(comm, sp: bool) -> tuple[int, int]:
    """(bytes saved for backward by a block's forward, the module's formula in bytes)."""
    blocks = impl("tensor_parallel.blocks")
    p = comm.world_size
    block = blocks.ParallelTransformerBlock(D, H, FF, comm, sequence_parallel=sp, dtype=F64)
    x = leaf(torch.ones(B, T // p if sp else T, D, dtype=F64))
    nbytes, y = blocks.saved_activation_nbytes(block, lambda: block(x))
    y.sum().backward()  # every rank runs the backward collectives
    return nbytes, blocks.activation_elements(B, T, D, H, FF, p, sp) * 8


@pytest.mark.threads
@pytest.mark.parametrize("p", [1, 2, 4])
def test_activation_memory_matches_the_formula_and_sequence_parallel_divides_it_by_p(p):
    full = 8 * B * T * D + 2 * B * T * FF + B * H * T * T + 4 * B * T  # tp = 1, the docstring's A
    tp_only = 4 * B * T * D + 4 * B * T + (4 * B * T * D + 2 * B * T * FF + B * H * T * T) // p
    for sp, elements in ((False, tp_only), (True, full // p)):
        for measured, formula in run_threads(measured_activations, p, sp, **FAST):
            assert measured == formula == elements * 8, (sp, measured, formula, elements * 8)
    assert full % p == 0  # so A/p is exact: sequence parallelism splits every saved tensor


# ---- errors name the numbers --------------------------------------------------------------------


class FakeComm:  # construction and shard checks talk to nobody
    def __init__(self, world_size: int, rank: int = 0):
        self.world_size, self.rank = world_size, rank


@pytest.mark.pure
def test_indivisible_sizes_are_refused_with_the_numbers():
    tp, blocks = impl("tensor_parallel.layers"), impl("tensor_parallel.blocks")
    c = FakeComm(4)
    refused = {
        "out_features=10 is not divisible by tp=4": lambda: tp.ColumnParallelLinear(3, 10, c),
        "out_features=18 is not divisible by parts=3 x tp=4": lambda: tp.ColumnParallelLinear(
            3, 18, c, parts=3
        ),
        "in_features=10 is not divisible by tp=4": lambda: tp.RowParallelLinear(10, 3, c),
        "d_ff=10 is not divisible by tp=4": lambda: blocks.ParallelMLP(8, 10, c),
        "n_heads=6 is not divisible by tp=4": lambda: blocks.ParallelSelfAttention(12, 6, c),
        "d_model=10 is not divisible by n_heads=4": lambda: blocks.ParallelSelfAttention(10, 4, c),
        "vocab_size=10 is not divisible by tp=4": lambda: blocks.VocabParallelEmbedding(10, 3, c),
        r"x.shape\[1\]=6 is not divisible by tp=4": lambda: mappings.split_along(
            torch.zeros(2, 6, 3), c, 1
        ),
        r"token ids must lie in \[0, 8\), got \[0, 8\]": lambda: blocks.VocabParallelEmbedding(
            8, 3, c
        )(torch.tensor([[0, 8]])),
    }
    for message, build in refused.items():
        with pytest.raises(ValueError, match=message):
            build()
    with pytest.raises(ValueError, match=r"x.shape\[1\]=6 is not divisible by tp=4"):
        mappings.reduce_scatter_along(torch.zeros(2, 6, 3), c, 1)


@pytest.mark.pure
def test_master_linear_draws_as_documented():
    w, b = transformer.master_linear(4, 3, seed=5, dtype=F64)
    gen = torch.Generator().manual_seed(5)
    assert torch.equal(w, torch.empty(3, 4, dtype=F64).uniform_(-0.5, 0.5, generator=gen))
    assert torch.equal(b, torch.empty(3, dtype=F64).uniform_(-0.5, 0.5, generator=gen))


# ---- processes: the same properties over real mpi and gloo processes ----------------------------


# the process tier's fixed cases (the threads tier draws the sweeps), (tp, which, case): both
# linear kinds, uneven sizes, sequence parallel or not; the attention and MLP block; the
# vocabulary-parallel loss with exp() overflowing without its max; on 4 ranks and on 3
LINEAR = {"i": 13, "o": 17, "b": 7, "t": 3, "bias": True, "seed": 1}
BLOCK = {"heads": 2, "hd": 3, "ff": 5, "b": 2, "t": 3, "causal": True, "from_full": True}
HARD = [
    (4, "linear", LINEAR | {"kind": "column", "gather": True, "sp": True, "flat": False}),
    (3, "linear", LINEAR | {"kind": "row", "gather": True, "sp": False, "flat": True}),
    (4, "block", BLOCK | {"part": "block", "sp": True, "seed": 2}),
    (3, "block", BLOCK | {"part": "attention", "sp": False, "causal": False, "seed": 3}),
    (4, "vocab", {"v": 13, "d": 17, "b": 7, "t": 2, "scale": 1000.0, "sp": True, "seed": 4}),
]
MATCHES = {"linear": linear_matches, "block": block_matches, "vocab": vocab_matches}


def properties_in_ranks(comm) -> int:
    """The fixed cases inside every rank, tp = 3 and 4 by splitting."""
    subs = {k: comm.split(int(comm.rank < k)) for k in sorted({k for k, _, _ in HARD})}
    for k, which, case in HARD:
        if comm.rank < k:
            MATCHES[which](subs[k], case)
        comm.barrier()
    return len(HARD)


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_tensor_parallel_processes(backend):
    assert run_ranks(properties_in_ranks, 4, backend, timeout=240) == [len(HARD)] * 4


# ---- gpu: the threads tier with CUDA tensors ----------------------------------------------------


def cuda_block(comm, sp: bool) -> None:
    """A sequence-parallel (or not) block and the vocabulary-parallel loss on cuda:0."""
    blocks, tp = impl("tensor_parallel.blocks"), impl("tensor_parallel.layers")
    p = comm.world_size
    r = comm.rank
    dev = torch.device("cuda")
    full = transformer.TransformerBlock(4 * p, 2 * p, 4 * p, seed=1, dtype=F64, device=dev)
    par = blocks.ParallelTransformerBlock.from_full(full, comm, sequence_parallel=sp)
    x = randn(torch.Generator().manual_seed(2), 3, 2 * p, 4 * p).to(dev)
    y_ref = full(x)
    y = par(cols(x, r, p, 1) if sp else x)
    logits = randn(torch.Generator().manual_seed(3), 3, 5 * p).to(dev) * 1000
    target = torch.arange(3, device=dev)
    loss = tp.vocab_parallel_cross_entropy(cols(logits, r, p), target, comm)
    pairs = {
        "y": (y, cols(y_ref, r, p, 1) if sp else y_ref),
        "loss": (loss, F.cross_entropy(logits, target, reduction="none")),
        "device": (torch.tensor(y.device.type == "cuda"), torch.tensor(True)),
    }
    check_all(comm, pairs, RTOL, ATOL * 1000)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sp", [False, True])
def test_cuda_tensors_on_threads(sp):
    run_threads(cuda_block, 2, sp, **FAST)
