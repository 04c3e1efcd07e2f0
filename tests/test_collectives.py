"""The hand-written collectives (minidist/collectives/algorithms.py), exactly, on every backend.

Every rank rebuilds every rank's input from one seed (integer-valued, so any order of additions
gives the exact result in every dtype), computes the expected result itself with plain torch,
and the verdict is combined across ranks. Inputs are laid out non-contiguously in half the
examples, inside a larger buffer whose other elements must come back untouched. The module is
fetched with impl("collectives.algorithms") inside each rank, so `make lab L=02` grades a learner's
file. Tiers: threads (world sizes 1..8, many examples), processes (4 mpi or gloo processes started
once per test, fixed cases on 3 and 4 ranks). Byte counts are checked against the formulas in
the module docstring. all_to_all (uneven counts drawn from the seed) is also compared, byte for
byte, with the library's own in the process tier: MPI_Alltoallv on mpi; on gloo
torch.distributed.all_to_all_single, which Gloo runs with uneven splits (its list form,
all_to_all, refuses blocks of different sizes). Speed is measured by `minidist bench`, never
asserted here.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from minidist.collectives.overlap import Launcher
from minidist.comm.protocol import OPS
from minidist.comm.wrappers import Counter, ObservedComm
from minidist.testing import (
    DTYPES,
    RANK_SETTINGS,
    all_dtypes,
    check_all,
    impl,
    in_subworlds,
    integer_valued,
    ops,
    reduce_expected,
    run_ranks,
    run_threads,
    seeds,
    shapes,
    verdict,
)

ALL_REDUCE = ("naive", "recursive_doubling", "ring", "auto")
# threads tier: an operation that waits 4 s is a deadlock (a correct one takes milliseconds);
# failing fast matters because hypothesis reruns a failing case many times while shrinking
FAST = {"timeout": 20, "comm_timeout": 4}

# ---- what every rank computes itself: inputs, layouts, expected results ------------------


def bounds(n: int, p: int, i: int) -> tuple[int, int]:
    """Chunk i of n elements over p ranks, as documented: [i*n//p, (i+1)*n//p)."""
    return i * n // p, (i + 1) * n // p


def placed(t: torch.Tensor, strided: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, base): t's values in a fresh buffer; if strided, every other element of a buffer
    twice as large (a non-contiguous view), the elements in between set to a sentinel."""
    if not strided:
        base = t.clone()
        return base, base
    base = torch.stack([t, torch.ones_like(t)], dim=-1)  # (..., 2): [..., 1] must stay 1
    return base[..., 0], base


def untouched(base: torch.Tensor, strided: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The sentinel elements of a strided buffer, paired with what they must still be."""
    gaps = base[..., 1] if strided else base.new_ones(())
    return gaps, torch.ones_like(gaps)


def edged(x: torch.Tensor, seed: int, rank: int) -> torch.Tensor:
    """x (integer-valued) with IEEE edge values at a few positions, for floating dtypes: zeros
    of a sign that differs from rank to rank, +inf, and small multiples of the smallest
    subnormal. The positions depend on the seed alone (the same on every rank), so every
    reduction stays exact in any order: sums of signed zeros, of +inf with finite values, and
    of a few subnormal multiples are exact. Which zero max/min keep depends on the order of
    their operands: a collective that folds in a different order on different ranks gives
    +0.0 on one rank and -0.0 on another."""
    if not x.dtype.is_floating_point or x.numel() < 4:
        return x
    g = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 4, x.shape, generator=g)  # (...,): 0 keep, 1 zero, 2 inf, 3 tiny
    mine = torch.Generator().manual_seed(seed * 1000 + rank)
    sign = torch.randint(0, 2, x.shape, generator=mine).to(x.dtype) * 2 - 1  # -1 or +1
    tiny = torch.finfo(x.dtype).smallest_normal * torch.finfo(x.dtype).eps  # least subnormal
    units = torch.randint(-4, 5, x.shape, generator=mine).to(torch.float64) * tiny
    x = torch.where(kind == 1, sign * 0.0, x)
    x = torch.where(kind == 2, torch.full_like(x, float("inf")), x)
    return torch.where(kind == 3, units.to(x.dtype), x)


def same_bits_everywhere(comm, t: torch.Tensor) -> str:
    """'' if t has the same bits on every rank (-0.0 and +0.0 differ), else what differs."""
    if not t.dtype.is_floating_point or t.numel() == 0:
        return ""
    # bytes (gloo takes them), from a copy with unit stride: a one-element view of a strided
    # buffer counts as contiguous, and .contiguous() would keep its stride of 2
    flat = t.detach().cpu().reshape(-1).clone(memory_format=torch.contiguous_format)
    bits = flat.view(torch.uint8)
    everyone = torch.empty(comm.world_size * bits.numel(), dtype=bits.dtype)
    comm.all_gather(everyone, bits.contiguous())
    rows = everyone.view(comm.world_size, -1)
    differ = [i for i in range(comm.world_size) if not torch.equal(rows[i], rows[0])]
    return f"bits differ from rank 0's on ranks {differ} (a signed zero?)" if differ else ""


def valid(op: str, dtype: torch.dtype) -> bool:
    return op != "avg" or dtype.is_floating_point


def refuses(call) -> str:
    """'' if call() raises ValueError (a bad op for the dtype), else what went wrong."""
    try:
        call()
    except ValueError:
        return ""
    return "accepted an invalid op/dtype"


# ---- the property functions, run on every rank of any backend -----------------------------


def all_reduce_case(comm, algorithm, op, dtype, shape, seed, strided) -> None:
    """all_reduce(algorithm) of every rank's input, in place, equals the reduction of all."""
    C = impl("collectives.algorithms")
    p, r = comm.world_size, comm.rank
    xs = [edged(integer_valued(shape, dtype, seed, rank=i), seed, i) for i in range(p)]
    x, base = placed(xs[r], strided)
    context = f"all_reduce {algorithm} p={p} {shape} {dtype} op={op} strided={strided}"
    if not valid(op, dtype):
        problem = refuses(lambda: C.all_reduce(x, comm, op, algorithm))
        return verdict(comm, not problem, f"{context}: {problem}")
    time.sleep(0.001 * ((seed + r) % 3 == 0))  # some ranks arrive late: nothing may assume sync
    out = C.all_reduce(x, comm, op, algorithm)
    want = reduce_expected(xs, op)
    pairs = {"in place": (x, want), "returned": (out, want), "gaps": untouched(base, strided)}
    check_all(comm, pairs, context=context)
    differ = same_bits_everywhere(comm, x)
    verdict(comm, not differ, f"{context}: {differ}")


def reduce_scatter_case(comm, op, dtype, shape, seed, strided) -> None:
    """ring_reduce_scatter: rank r gets chunk r (uneven sizes allowed) of the reduction."""
    C = impl("collectives.algorithms")
    p, r = comm.world_size, comm.rank
    xs = [edged(integer_valued(shape, dtype, seed, rank=i), seed, i) for i in range(p)]
    n = xs[0].numel()
    lo, hi = bounds(n, p, r)
    inp, inp_base = placed(xs[r], strided)
    out, out_base = placed(torch.zeros(hi - lo, dtype=dtype), strided)
    context = f"ring_reduce_scatter p={p} {shape} {dtype} op={op} strided={strided}"
    if not valid(op, dtype):
        problem = refuses(lambda: C.ring_reduce_scatter(out, inp, comm, op))
        return verdict(comm, not problem, f"{context}: {problem}")
    got = C.ring_reduce_scatter(out, inp, comm, op)
    want = reduce_expected([x.reshape(-1)[lo:hi] for x in xs], op)
    pairs = {
        f"chunk [{lo}:{hi}]": (out, want),
        "returned": (got, want),
        "input unchanged": (inp, xs[r]),
        "gaps": untouched(out_base, strided),
        "input gaps": untouched(inp_base, strided),
    }
    check_all(comm, pairs, context=context)


def all_gather_case(comm, dtype, shape, seed, strided) -> None:
    """ring_all_gather: everyone gets every rank's chunk in rank order (uneven sizes allowed)."""
    C = impl("collectives.algorithms")
    p, r = comm.world_size, comm.rank
    full = integer_valued(shape, dtype, seed)  # the gathered result; rank i holds chunk i
    lo, hi = bounds(full.numel(), p, r)
    inp, _ = placed(full.reshape(-1)[lo:hi], strided)
    out, base = placed(torch.zeros(shape, dtype=dtype), strided)
    got = C.ring_all_gather(out, inp, comm)
    pairs = {"out": (out, full), "returned": (got, full), "gaps": untouched(base, strided)}
    check_all(comm, pairs, context=f"ring_all_gather p={p} {shape} {dtype} strided={strided}")


def broadcast_case(comm, dtype, shape, seed, strided) -> None:
    """broadcast from src = seed % p: everyone ends with src's tensor."""
    C = impl("collectives.algorithms")
    p, r = comm.world_size, comm.rank
    src = seed % p
    x, base = placed(integer_valued(shape, dtype, seed, rank=r), strided)
    got = C.broadcast(x, comm, src)
    want = integer_valued(shape, dtype, seed, rank=src)
    pairs = {"in place": (x, want), "returned": (got, want), "gaps": untouched(base, strided)}
    check_all(comm, pairs, context=f"broadcast from {src} p={p} {shape} {dtype}")


def split_counts(p: int, seed: int) -> list[list[int]]:
    """counts[i][j]: the rows rank i sends rank j, 0..3, from the seed alone: every rank knows
    the whole matrix, so each computes what it must receive itself."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (p, p), generator=g).tolist()


def all_to_all_case(comm, dtype, row, seed, strided, known) -> None:
    """all_to_all: rank r gets, in source rank order, the rows each rank sends it; it sends
    8 (p-1) bytes of counts (none when it is told recv_counts) + its rows for other ranks."""
    C = impl("collectives.algorithms")
    p, r = comm.world_size, comm.rank
    counts = split_counts(p, seed)
    xs = [integer_valued((sum(counts[i]), *row), dtype, seed, rank=i) for i in range(p)]
    x, base = placed(xs[r], strided)
    recv = [counts[i][r] for i in range(p)]
    counter = Counter()
    observed = ObservedComm(comm, counter)
    y, got = C.all_to_all(x, counts[r], observed, recv if known else None)
    want = torch.cat([xs[i].split(counts[i])[r] for i in range(p)])  # (sum(recv), *row)
    row_nbytes = math.prod(row) * x.element_size()
    nbytes = 8 * (p - 1) * (not known) + (sum(counts[r]) - counts[r][r]) * row_nbytes
    context = f"all_to_all p={p} row={row} {dtype} counts={counts} strided={strided}"
    pairs = {"y": (y, want), "input unchanged": (x, xs[r]), "gaps": untouched(base, strided)}
    check_all(comm, pairs, context=context)
    sent = counter.bytes_sent
    ok = got == recv and sent == nbytes
    verdict(comm, ok, f"{context}: recv_counts {got} (want {recv}), sent {sent} B (want {nbytes})")
    return y, recv


# ---- tier 1: threads, world sizes 1..8 ---------------------------------------------------

layouts = st.booleans()  # strided or not


@pytest.mark.threads
@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.sampled_from(ALL_REDUCE), ops, all_dtypes, shapes(), seeds, layouts)
def test_all_reduce_threads(p, algorithm, op, dtype, shape, seed, strided):
    run_threads(all_reduce_case, p, algorithm, op, dtype, shape, seed, strided, **FAST)


@pytest.mark.threads
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 8), ops, all_dtypes, shapes(), seeds, layouts)
@example(4, "max", torch.float32, (16,), 5, False)  # signed zeros, p = q
@example(6, "min", torch.bfloat16, (16,), 2, True)  # ... and p > q
def test_recursive_doubling_all_reduce_threads(p, op, dtype, shape, seed, strided):
    """Recursive doubling alone (lab 02.3); test_all_reduce_threads draws every algorithm."""
    run_threads(all_reduce_case, p, "recursive_doubling", op, dtype, shape, seed, strided, **FAST)


@pytest.mark.threads
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), ops, all_dtypes, shapes(), seeds, layouts)
def test_ring_reduce_scatter_threads(p, op, dtype, shape, seed, strided):
    run_threads(reduce_scatter_case, p, op, dtype, shape, seed, strided, **FAST)


@pytest.mark.threads
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 8), all_dtypes, shapes(), seeds, layouts)
def test_ring_all_gather_threads(p, dtype, shape, seed, strided):
    run_threads(all_gather_case, p, dtype, shape, seed, strided, **FAST)


@pytest.mark.threads
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 8), all_dtypes, shapes(), seeds, layouts)
def test_broadcast_threads(p, dtype, shape, seed, strided):
    run_threads(broadcast_case, p, dtype, shape, seed, strided, **FAST)


@pytest.mark.threads
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), all_dtypes, shapes(max_dims=2, max_side=3), seeds, layouts, st.booleans())
def test_all_to_all_threads(p, dtype, row, seed, strided, known):
    run_threads(all_to_all_case, p, dtype, row, seed, strided, known, **FAST)


def bad_all_to_all(comm) -> list[str]:
    C = impl("collectives.algorithms")
    messages = []
    for x, counts in [
        (torch.ones(5, 2), [2, 2]),
        (torch.ones(4), [1, 1, 1]),
        (torch.ones(()), [0] * 3),
    ]:
        try:
            C.all_to_all(x, counts, comm)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


@pytest.mark.threads
def test_all_to_all_refuses_counts_that_do_not_fit_naming_them():
    for short, wrong_len, scalar in run_threads(bad_all_to_all, 3, **FAST):
        assert "send_counts=[2, 2]" in short and "3 counts" in short and "x.shape[0]=5" in short
        assert "send_counts=[1, 1, 1]" in wrong_len and "x.shape[0]=4" in wrong_len
        assert "0-d" in scalar


def mirrors_library(comm, n_per_rank: int) -> None:
    """When p divides N, the ring collectives give what comm.reduce_scatter/all_gather give."""
    C = impl("collectives.algorithms")
    p, r = comm.world_size, comm.rank
    inp = integer_valued((p * n_per_rank,), torch.float32, 7, rank=r)
    ours, lib = torch.empty(n_per_rank), torch.empty(n_per_rank)
    C.ring_reduce_scatter(ours, inp, comm, "sum")
    comm.reduce_scatter(lib, inp, "sum")
    gathered, lib_gathered = torch.empty(p * n_per_rank), torch.empty(p * n_per_rank)
    C.ring_all_gather(gathered, ours, comm)
    comm.all_gather(lib_gathered, lib)
    check_all(comm, {"reduce_scatter": (ours, lib), "all_gather": (gathered, lib_gathered)})


@pytest.mark.threads
@pytest.mark.parametrize("p", [1, 3, 4])
def test_ring_mirrors_library_semantics(p):
    run_threads(mirrors_library, p, 5)


def launched(comm, n_per_rank: int) -> None:
    """Launcher: the library and the ring, started without waiting (two in flight at once),
    give the same sums and gathers (integer-valued: exact); every Work has is_completed."""
    p, r = comm.world_size, comm.rank
    inp = integer_valued((p * n_per_rank,), torch.float32, 3, rank=r)  # (p n,)
    got = {}
    for algorithm in ("library", "ring"):
        launcher = Launcher(comm, algorithm)
        summed = inp.clone()
        shard = torch.empty(n_per_rank)
        whole = torch.empty(p * n_per_rank)
        works = [launcher.all_reduce(summed), launcher.reduce_scatter(shard, inp)]
        for work in works:
            work.wait()
        last = launcher.all_gather(whole, shard)
        last.wait()
        verdict(comm, last.is_completed(), f"{algorithm}: waited, yet not completed")
        got[algorithm] = (summed, shard, whole)
    names = ("all_reduce", "reduce_scatter", "all_gather")
    check_all(comm, {n: (a, b) for n, a, b in zip(names, *got.values(), strict=True)})


@pytest.mark.threads
@pytest.mark.parametrize("p", [1, 3, 4])
def test_launcher_ring_matches_library(p):
    run_threads(launched, p, 5, **FAST)
    with pytest.raises(ValueError, match="algorithm='tree' is not 'library' or 'ring'"):
        Launcher(None, "tree")


def bad_arguments(comm) -> list[str]:
    """The ValueError message of each bad call (every rank makes the same bad calls)."""
    C = impl("collectives.algorithms")
    calls = [
        lambda: C.all_reduce(torch.ones(3), comm, "mean"),
        lambda: C.all_reduce(torch.ones(3, dtype=torch.int32), comm, "avg", "ring"),
        lambda: C.all_reduce(torch.ones(3), comm, "sum", "tree"),
        lambda: C.ring_reduce_scatter(torch.empty(2), torch.ones(9), comm),
        lambda: C.ring_all_gather(torch.empty(9), torch.ones(4), comm),
        lambda: C.broadcast(torch.ones(3), comm, 5),
    ]
    messages = []
    for call in calls:
        try:
            call()
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


@pytest.mark.threads
def test_bad_arguments_name_the_numbers():
    for messages in run_threads(bad_arguments, 3):
        mean, avg_int, tree, rs, ag, src = messages
        assert "'mean'" in mean
        assert "avg" in avg_int and "int32" in avg_int
        assert "'tree'" in tree
        assert "3 x torch.float32" in rs and "got 2" in rs and "world_size=3" in rs, rs
        assert "3 x torch.float32" in ag and "got 4" in ag, ag
        assert "src=5" in src and "world_size=3" in src


# ---- byte accounting: every p2p byte counted, against the module docstring's formulas ----


def counted(comm, what: str, n: int) -> dict:
    """Run one collective on a counting comm; this rank's message and byte tallies."""
    C = impl("collectives.algorithms")
    counter = Counter()
    observed = ObservedComm(comm, counter)
    x = torch.ones(n, dtype=torch.float32)
    if what == "broadcast":
        C.broadcast(x, observed, 0)
    elif what == "reduce_scatter":
        lo, hi = bounds(n, comm.world_size, comm.rank)
        C.ring_reduce_scatter(torch.zeros(hi - lo), x, observed)
    elif what == "all_gather":
        lo, hi = bounds(n, comm.world_size, comm.rank)
        C.ring_all_gather(x, torch.ones(hi - lo), observed)
    else:
        C.all_reduce(x, observed, "sum", what)
    return {"sent_to": dict(counter.sent_to), "messages_to": dict(counter.messages_to)}


@pytest.mark.threads
@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("fragments", [1, 3])
def test_ring_sends_2_p_minus_1_over_p_of_the_bytes_to_the_right_only(p, fragments, monkeypatch):
    n = 12 * p  # divisible by p: 2 (p-1) chunks of 12 float32s
    # reduce-scatter chunks go in `fragments` messages each, all-gather chunks in one
    monkeypatch.setattr(impl("collectives.algorithms"), "FRAGMENT_BYTES", 12 * 4 // fragments)
    for r, tally in enumerate(run_threads(counted, p, "ring", n)):
        right = (r + 1) % p
        expected = {} if p == 1 else {right: 2 * (p - 1) * n * 4 // p}
        assert tally["sent_to"] == expected, f"rank {r}"
        messages = (p - 1) * fragments + (p - 1)
        assert tally["messages_to"] == ({} if p == 1 else {right: messages}), f"rank {r}"


@pytest.mark.threads
@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("fragments", [1, 3])
def test_ring_reduce_scatter_sends_p_minus_1_over_p_of_the_bytes_to_the_right_only(
    p, fragments, monkeypatch
):
    """The reduce-scatter half alone (lab 02.1): (p-1) chunks of n/p, each in `fragments`."""
    n = 12 * p
    monkeypatch.setattr(impl("collectives.algorithms"), "FRAGMENT_BYTES", 12 * 4 // fragments)
    for r, tally in enumerate(run_threads(counted, p, "reduce_scatter", n)):
        right = (r + 1) % p
        assert tally["sent_to"] == ({} if p == 1 else {right: (p - 1) * n * 4 // p}), f"rank {r}"
        messages = {} if p == 1 else {right: (p - 1) * fragments}
        assert tally["messages_to"] == messages, f"rank {r}"


@pytest.mark.threads
@pytest.mark.parametrize("p", range(1, 9))
def test_ring_all_gather_sends_p_minus_1_over_p_of_the_bytes_to_the_right_only(p):
    """The all-gather half alone (lab 02.2): (p-1) chunks of n/p, one message each."""
    n = 12 * p
    for r, tally in enumerate(run_threads(counted, p, "all_gather", n)):
        right = (r + 1) % p
        assert tally["sent_to"] == ({} if p == 1 else {right: (p - 1) * n * 4 // p}), f"rank {r}"
        assert tally["messages_to"] == ({} if p == 1 else {right: p - 1}), f"rank {r}"


@pytest.mark.threads
@pytest.mark.parametrize("p", [2, 3, 5])
def test_ring_in_many_fragments(p, monkeypatch):
    # 12 bytes a fragment: 1 to 12 elements per message, chunks not a multiple of a fragment
    monkeypatch.setattr(impl("collectives.algorithms"), "FRAGMENT_BYTES", 12)
    for op, dtype, shape in [
        ("sum", torch.float32, (7, 5)),
        ("avg", torch.float64, (23,)),
        ("max", torch.bfloat16, (4, 5)),
        ("sum", torch.int8, (3, 31)),
    ]:
        run_threads(all_reduce_case, p, "ring", op, dtype, shape, 11, True, **FAST)
        run_threads(reduce_scatter_case, p, op, dtype, shape, 12, True, **FAST)


@pytest.mark.threads
@pytest.mark.parametrize("p", range(1, 9))
def test_recursive_doubling_message_counts(p):
    n = 10
    q = 1 << (p.bit_length() - 1)  # the largest power of two <= p
    e, rounds = p - q, q.bit_length() - 1
    for r, tally in enumerate(run_threads(counted, p, "recursive_doubling", n)):
        if r < 2 * e:  # paired: even sends its data in; odd also sends the result back
            want = 1 if r % 2 == 0 else rounds + 1
        else:
            want = rounds
        assert sum(tally["messages_to"].values()) == want, f"rank {r}: {tally}"
        assert sum(tally["sent_to"].values()) == want * n * 4, f"rank {r}"


@pytest.mark.threads
@pytest.mark.parametrize("p", range(1, 9))
def test_naive_and_broadcast_message_counts(p):
    naive = run_threads(counted, p, "naive", 6)
    assert naive[0]["messages_to"] == {dst: 1 for dst in range(1, p)}
    assert all(t["messages_to"] == {0: 1} for t in naive[1:])
    tree = run_threads(counted, p, "broadcast", 6)
    assert sum(sum(t["messages_to"].values()) for t in tree) == p - 1
    assert sum(tree[0]["messages_to"].values()) == (p - 1).bit_length()  # ceil(log2 p) rounds


@pytest.mark.threads
def test_auto_picks_recursive_doubling_below_the_threshold_and_the_ring_above():
    C = impl("collectives.algorithms")
    n_small = C.RING_FROM_BYTES // 4 - 4  # float32 elements just below / at the threshold
    small = run_threads(counted, 4, "auto", n_small)
    large = run_threads(counted, 4, "auto", C.RING_FROM_BYTES // 4)
    assert all(sum(t["messages_to"].values()) == 2 for t in small)  # log2(4) exchanges
    assert all(t["messages_to"] == {(r + 1) % 4: 6} for r, t in enumerate(large))  # 2 (p-1)


# ---- tier 2: real processes, started once per test -----------------------------------------


# the process tier's fixed cases (the threads tier draws the sweep): every dtype once, each op
# in turn, on 4 ranks and on 3 (a ring over an odd world), strided or not, shapes that split
# unevenly over the ranks, an empty one and a 0-d one
SHAPES = ((7, 3), (5,), (), (2, 0, 3), (9,), (3, 5), (1,), (4, 2), (6, 1))
HARD = [
    dict(k=4 - i % 2, op=OPS[i % 4], dtype=dtype, shape=SHAPES[i], seed=i, strided=i % 3 == 0)
    for i, dtype in enumerate(DTYPES)
]


def properties_in_ranks(comm, max_examples: int) -> int:
    """The fixed cases inside every rank, then max_examples drawn (the same cases everywhere);
    world sizes 1..p by splitting.

    Each example runs every collective (all four all-reduce algorithms) on a sub-world of k
    ranks. Its verdict, or the error a rank raised, is folded into one over the whole world, so
    every rank passes or fails each example together and hypothesis stays in step.
    """
    subs = {k: comm.split(int(comm.rank < k)) for k in range(1, comm.world_size + 1)}
    for sub in subs.values():
        sub.timeout = 15.0  # a correct case takes milliseconds: fail a deadlock fast
    examples = [0]

    # no shrinking: a failing case may cost a timeout per try; the threads tier shrinks
    phases = [Phase.explicit, Phase.generate] if max_examples else [Phase.explicit]

    @settings(RANK_SETTINGS, max_examples=max(max_examples, 1), phases=phases)
    @given(st.integers(1, comm.world_size), ops, all_dtypes, shapes(max_side=5), seeds, layouts)
    # an empty tensor with stride 2 counts as contiguous in torch, and MPI cannot view it as bytes
    @example(k=2, op="avg", dtype=torch.float64, shape=(0,), seed=114, strided=True)
    def prop(k, op, dtype, shape, seed, strided):
        examples[0] += 1
        problem = ""
        if comm.rank < k:  # the ranks outside the sub-world sit this example out
            sub = subs[k]
            # every other case moves the ring's chunks in fragments of 8 bytes: many messages in
            # a row between two ranks must arrive in order on every backend
            impl("collectives.algorithms").FRAGMENT_BYTES = 8 if seed % 2 else 1 << 20
            try:
                for algorithm in ALL_REDUCE:
                    all_reduce_case(sub, algorithm, op, dtype, shape, seed, strided)
                reduce_scatter_case(sub, op, dtype, shape, seed, strided)
                all_gather_case(sub, dtype, shape, seed, strided)
                broadcast_case(sub, dtype, shape, seed, strided)
            except Exception as e:  # reported through the verdict below
                # ASCII, and short: verdict cuts messages at 4096 bytes, and a cut through a
                # multi-byte character (gloo's errors carry an emoji) would fail to decode
                problem = f"{type(e).__name__}: {e}"[:3000].encode("ascii", "replace").decode()
        verdict(comm, not problem, problem)

    for case in HARD:
        prop = example(**case)(prop)
    prop()
    return examples[0]


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_collectives_processes(backend):
    counts = run_ranks(properties_in_ranks, 4, backend, 0, timeout=240)
    assert counts == [len(HARD) + 1] * 4, counts  # every rank ran the same cases


def library_all_to_all(comm, x, send_counts, recv_counts) -> torch.Tensor:
    """The library's all-to-all of x's rows, moved as bytes (every dtype, bool included):
    MPI_Alltoallv on mpi; torch.distributed.all_to_all_single on gloo, which Gloo implements
    with uneven splits (its list form, all_to_all, refuses blocks of different sizes)."""
    row = math.prod(x.shape[1:]) * x.element_size()
    send = x.contiguous().reshape(-1).view(torch.uint8)  # (N row,)
    out = torch.empty(sum(recv_counts) * row, dtype=torch.uint8)  # (M row,)
    sizes, recv_sizes = [c * row for c in send_counts], [c * row for c in recv_counts]
    if comm.backend == "gloo":
        import torch.distributed as dist

        dist.all_to_all_single(out, send, recv_sizes, sizes, group=comm.group)
        return out
    from mpi4py import MPI

    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    recv_starts = [sum(recv_sizes[:j]) for j in range(len(recv_sizes))]
    comm.mpi_comm.Alltoallv(
        [send.numpy(), (sizes, starts), MPI.BYTE],
        [out.numpy(), (recv_sizes, recv_starts), MPI.BYTE],
    )
    return out


def all_to_all_in_ranks(comm, max_examples: int) -> int:
    """Hypothesis inside every rank, world sizes 1..p by splitting: all_to_all is exact, sends
    the formula's bytes, and gives the library's all-to-all byte for byte."""

    def check(sub, case):
        y, recv = all_to_all_case(sub, *case)
        x = integer_valued(
            (sum(split_counts(sub.world_size, case[2])[sub.rank]), *case[1]),
            case[0],
            case[2],
            rank=sub.rank,
        )
        lib = library_all_to_all(sub, x, split_counts(sub.world_size, case[2])[sub.rank], recv)
        ours = y.contiguous().reshape(-1).view(torch.uint8)
        check_all(sub, {"library": (ours, lib)}, context=f"vs the library: {case}")

    cases = st.tuples(all_dtypes, shapes(max_dims=2, max_side=3), seeds, layouts, st.booleans())
    return in_subworlds(comm, check, cases, max_examples, None, ALL_TO_ALL_HARD)


# (k, (dtype, row shape, seed, strided, recv_counts known)): the fixed cases of the process tier
ALL_TO_ALL_HARD = [
    (4, (torch.bool, (3,), 1, True, False)),
    (4, (torch.bfloat16, (2, 3), 2, False, True)),
    (3, (torch.int8, (), 3, True, True)),
    (4, (torch.float64, (0,), 4, False, False)),
    (3, (torch.float16, (3, 1), 5, False, False)),
]


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_all_to_all_processes(backend):
    counts = run_ranks(all_to_all_in_ranks, 4, backend, 0, timeout=120)
    assert counts == [len(ALL_TO_ALL_HARD)] * 4, counts
