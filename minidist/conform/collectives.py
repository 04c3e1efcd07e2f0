"""Conformance checks of the capability "collectives": all-reduce, reduce-scatter, all-gather,
broadcast and all-to-all from the adapter's own code, restated from tests/test_collectives.py.

Equals: the reduction (or the copy) computed by the kit in one process, on every rank.
Exactly for sum, max, min, the gathers, broadcast and all-to-all: the data are small integers,
so any order of additions gives the same result in every dtype. "avg" within rtol 1e-12 (float64)
or 1e-6 (float32): the division may come before or after the sum. All-reduce results must also
be bitwise the same on every rank. Cases: world sizes 1..8 on threads (1..4 over processes),
shapes with 0 to 3 dimensions (0-d, empty, sides that do not divide by p), float64, float32,
int64 and int32; the reduce-scatter and all-gather come in two checks, N divisible by p and not.
Bytes (where the adapter's BYTES claims a formula, N = k p float32 elements of b = 4 bytes):
    ring all-reduce      each rank sends 2 (p-1)/p N b, all to rank+1
    ring reduce-scatter, ring all-gather     (p-1)/p N b each, all to rank+1
    tree broadcast       (p-1) N b over all ranks together (each rank but src receives N b once)
    direct all-to-all    exactly its rows for other ranks, each to its destination
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from minidist.conform.adapter import bytes_skip
from minidist.conform.checks import (
    Check,
    Problem,
    compare,
    compare_all,
    detached,
    integer_valued,
    same_on_every_rank,
)

DTYPES = (torch.float64, torch.float32, torch.int64, torch.int32)
FLOATS = (torch.float64, torch.float32)
AVG_TOLERANCE = {torch.float64: (1e-12, 1e-13), torch.float32: (1e-6, 1e-5)}  # (rtol, atol)


def bounds(n: int, p: int, r: int) -> tuple[int, int]:
    """Rank r's chunk of n elements, as the adapter interface says: [r*n//p, (r+1)*n//p)."""
    return r * n // p, (r + 1) * n // p


def shapes(max_dims: int = 3, max_side: int = 9):
    """Awkward shapes: 0-d, empty, sides of 1, odd sides."""
    return st.lists(st.integers(0, max_side), max_size=max_dims).map(tuple)


def reduced(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of every rank's tensor: exact in float64 (small integers), cast once; "avg"
    divides the exact sum once."""
    wide = torch.stack([x.to(torch.float64) for x in xs])  # (p, ...)
    if op in ("sum", "avg") or wide.numel() == 0:
        out = wide.sum(0)  # amax/amin refuse empty inputs; the result is empty anyway
    else:
        out = wide.amax(0) if op == "max" else wide.amin(0)
    out = out.to(xs[0].dtype)
    return out / len(xs) if op == "avg" else out


def inputs(case: dict) -> list[torch.Tensor]:
    """Every rank's input of a case, as each rank builds its own."""
    shape = case["shape"]
    dtype = case["dtype"]
    seed = case["seed"]
    return [integer_valued(shape, dtype, seed, rank=r) for r in range(case["p"])]


def tolerance(case: dict) -> tuple[float, float]:
    return AVG_TOLERANCE[case["dtype"]] if case.get("op") == "avg" else (0.0, 0.0)


# ---- all-reduce ------------------------------------------------------------------------------


def run_all_reduce(rank, case: dict):
    x = integer_valued(case["shape"], case["dtype"], case["seed"], rank=rank.rank)
    return detached(rank.adapter.all_reduce(rank.comm, x, case["op"]))


def judge_all_reduce(case: dict, outputs: list) -> list[Problem]:
    want = reduced(inputs(case), case["op"])
    pairs = {f"rank {r}'s result": (out, want) for r, out in enumerate(outputs)}
    return compare_all(pairs, *tolerance(case)) or same_on_every_rank("the result", outputs)


def all_reduce_cases(op: str):
    dtypes = FLOATS if op == "avg" else DTYPES

    def cases(max_p: int):
        return st.fixed_dictionaries(
            {
                "p": st.integers(1, max_p),
                "shape": shapes(),
                "dtype": st.sampled_from(dtypes),
                "seed": st.integers(0, 10**6),
                "op": st.just(op),
            }
        )

    return cases


def hard(op: str, dtypes=DTYPES) -> tuple:
    """The fixed cases: one rank, an uneven split, empty, 0-d, fewer elements than ranks."""
    shapes_ = [(7,), (5, 3), (0,), (), (3,), (2, 0, 3), (9, 2)]
    worlds = [1, 3, 4, 2, 8, 3, 4]
    return tuple(
        {"p": p, "shape": s, "dtype": dtypes[i % len(dtypes)], "seed": i, "op": op}
        for i, (p, s) in enumerate(zip(worlds, shapes_, strict=True))
    )


def all_reduce_check(op: str) -> Check:
    dtypes = FLOATS if op == "avg" else DTYPES
    return Check(
        "collectives",
        f"all_reduce.{op}",
        f"all_reduce(op={op!r}) equals the {op} of every rank's tensor on every rank, bitwise "
        "alike" + (" (rtol 1e-12 float64, 1e-6 float32)" if op == "avg" else ", exactly"),
        ("all_reduce",),
        run_all_reduce,
        judge_all_reduce,
        all_reduce_cases(op),
        hard(op, dtypes),
    )


# ---- reduce-scatter and all-gather ---------------------------------------------------------------


def run_reduce_scatter(rank, case: dict):
    x = integer_valued(case["shape"], case["dtype"], case["seed"], rank=rank.rank)
    return detached(rank.adapter.reduce_scatter(rank.comm, x, case["op"]))


def judge_reduce_scatter(case: dict, outputs: list) -> list[Problem]:
    full = reduced(inputs(case), case["op"]).reshape(-1)  # (N,)
    problems = []
    for r, out in enumerate(outputs):
        lo, hi = bounds(full.numel(), case["p"], r)
        got = out.reshape(-1) if isinstance(out, torch.Tensor) and out.numel() == hi - lo else out
        found = compare(f"rank {r}'s chunk [{lo}:{hi}]", got, full[lo:hi], *tolerance(case))
        problems += [found] if found else []
    return problems


def run_all_gather(rank, case: dict):
    full = integer_valued(case["shape"], case["dtype"], case["seed"])  # rank i holds chunk i
    lo, hi = bounds(full.numel(), case["p"], rank.rank)
    chunk = full.reshape(-1)[lo:hi].clone()
    return detached(rank.adapter.all_gather(rank.comm, chunk, tuple(case["shape"])))


def judge_all_gather(case: dict, outputs: list) -> list[Problem]:
    full = integer_valued(case["shape"], case["dtype"], case["seed"])
    return compare_all({f"rank {r}'s result": (out, full) for r, out in enumerate(outputs)})


def even_cases(op: str | None):
    """N divisible by p: the shape is (p, *drawn)."""

    def cases(max_p: int):
        base = {
            "p": st.integers(1, max_p),
            "shape": shapes(max_dims=2),
            "dtype": st.sampled_from(DTYPES if op != "avg" else FLOATS),
            "seed": st.integers(0, 10**6),
        }
        drawn = st.fixed_dictionaries(base | ({"op": st.just(op)} if op else {}))
        return drawn.map(lambda c: c | {"shape": (c["p"], *c["shape"])})

    return cases


def uneven_cases(op: str | None):
    """N not divisible by p: N = k p + extra, 1 <= extra < p (so p >= 2); some chunks empty."""

    def cases(max_p: int):
        base = {
            "p": st.integers(2, max(2, max_p)),
            "k": st.integers(0, 4),
            "extra": st.integers(1, 7),
            "dtype": st.sampled_from(DTYPES),
            "seed": st.integers(0, 10**6),
            "wide": st.booleans(),  # (N, 1) rather than (N,)
        }

        def shaped(c: dict) -> dict:
            n = c["k"] * c["p"] + 1 + (c["extra"] - 1) % (c["p"] - 1)
            case = {k: c[k] for k in ("p", "dtype", "seed")}
            return case | {"shape": (n, 1) if c["wide"] else (n,)} | ({"op": op} if op else {})

        return st.fixed_dictionaries(base).map(shaped)

    return cases


def scatter_gather_hard(op: str | None, even: bool) -> tuple:
    if even:
        worlds_shapes = [(1, (1,)), (3, (3, 2)), (4, (4, 0)), (2, (2,)), (8, (8, 3))]
    else:
        worlds_shapes = [(3, (7,)), (4, (5, 3)), (3, ()), (8, (3,)), (2, (9, 1))]
    extra = {"op": op} if op else {}
    dtypes = FLOATS if op == "avg" else DTYPES
    return tuple(
        {"p": p, "shape": s, "dtype": dtypes[i % len(dtypes)], "seed": 10 + i} | extra
        for i, (p, s) in enumerate(worlds_shapes)
    )


def reduce_scatter_check(op: str, even: bool) -> Check:
    name = f"reduce_scatter.{op}" if even else "reduce_scatter.uneven"
    split = "p divides N" if even else "N not divisible by p, chunks [r*N//p, (r+1)*N//p)"
    return Check(
        "collectives",
        name,
        f"reduce_scatter(op={op!r}): rank r gets chunk r of the reduction ({split})",
        ("reduce_scatter",),
        run_reduce_scatter,
        judge_reduce_scatter,
        even_cases(op) if even else uneven_cases(op),
        scatter_gather_hard(op, even),
    )


def all_gather_check(even: bool) -> Check:
    split = "p divides N" if even else "N not divisible by p, chunks [r*N//p, (r+1)*N//p)"
    return Check(
        "collectives",
        "all_gather" if even else "all_gather.uneven",
        f"all_gather: every rank gets every chunk in rank order, exactly ({split})",
        ("all_gather",),
        run_all_gather,
        judge_all_gather,
        even_cases(None) if even else uneven_cases(None),
        scatter_gather_hard(None, even),
    )


# ---- broadcast and all-to-all ----------------------------------------------------------------


def run_broadcast(rank, case: dict):
    x = integer_valued(case["shape"], case["dtype"], case["seed"], rank=rank.rank)
    src = case["seed"] % case["p"]
    return detached(rank.adapter.broadcast(rank.comm, x, src))


def judge_broadcast(case: dict, outputs: list) -> list[Problem]:
    src = case["seed"] % case["p"]
    want = inputs(case)[src]
    return compare_all({f"rank {r}'s tensor": (out, want) for r, out in enumerate(outputs)})


def plain_cases(max_p: int):
    return st.fixed_dictionaries(
        {
            "p": st.integers(1, max_p),
            "shape": shapes(),
            "dtype": st.sampled_from(DTYPES),
            "seed": st.integers(0, 10**6),
        }
    )


def split_counts(p: int, seed: int) -> list[list[int]]:
    """counts[i][j]: the rows rank i sends rank j, 0..3, from the seed alone."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (p, p), generator=g).tolist()


def all_to_all_inputs(case: dict) -> tuple[list[list[int]], list[torch.Tensor]]:
    counts = split_counts(case["p"], case["seed"])
    row = case["row"]
    dtype = case["dtype"]
    seed = case["seed"]
    xs = [integer_valued((sum(counts[i]), *row), dtype, seed, rank=i) for i in range(case["p"])]
    return counts, xs


def run_all_to_all(rank, case: dict):
    counts, xs = all_to_all_inputs(case)
    r = rank.rank
    recv = [counts[i][r] for i in range(case["p"])]
    y = rank.adapter.all_to_all(rank.comm, xs[r].clone(), list(counts[r]), recv)
    return detached(y), rank.sent()


def judge_all_to_all(case: dict, outputs: list) -> list[Problem]:
    counts, xs = all_to_all_inputs(case)
    p = case["p"]
    pairs = {}
    for r, (y, _) in enumerate(outputs):
        want = torch.cat([xs[i].split(counts[i])[r] for i in range(p)])  # (sum recv, *row)
        pairs[f"rank {r}'s rows"] = (y, want)
    return compare_all(pairs)


def all_to_all_cases(max_p: int):
    return st.fixed_dictionaries(
        {
            "p": st.integers(1, max_p),
            "row": shapes(max_dims=2, max_side=3),
            "dtype": st.sampled_from(DTYPES),
            "seed": st.integers(0, 10**6),
        }
    )


ALL_TO_ALL_HARD = tuple(
    {"p": p, "row": row, "dtype": DTYPES[i % 4], "seed": 20 + i}
    for i, (p, row) in enumerate([(1, (2,)), (3, ()), (4, (2, 3)), (4, (0,)), (8, (1,))])
)


# ---- bytes -------------------------------------------------------------------------------------


def run_counted(rank, case: dict):
    """One collective on N = k p float32 ones; (this rank's bytes sent, to each peer)."""
    p = case["p"]
    r = rank.rank
    n = case["k"] * case["p"]
    x = torch.ones(n, dtype=torch.float32)
    what, a = case["collective"], rank.adapter
    if what == "all_reduce":
        a.all_reduce(rank.comm, x, "sum")
    elif what == "reduce_scatter":
        a.reduce_scatter(rank.comm, x, "sum")
    elif what == "all_gather":
        lo, hi = bounds(n, p, r)
        a.all_gather(rank.comm, x[lo:hi].clone(), (n,))
    else:
        a.broadcast(rank.comm, x, case["k"] % p)
    sent = rank.sent()
    return sent.total, sent.to


def judge_ring_bytes(case: dict, outputs: list) -> list[Problem]:
    p, n = case["p"], case["k"] * case["p"]
    halves = 2 if case["collective"] == "all_reduce" else 1
    want = halves * (p - 1) * (n // p) * 4  # N/p float32 elements per step
    problems = []
    for r, (total, to) in enumerate(outputs):
        right = {} if p == 1 else {(r + 1) % p: want}
        if total != want or (to is not None and {k: v for k, v in to.items() if v} != right):
            shown = to if to is not None else total
            problems.append(
                Problem(
                    f"rank {r} sent {shown} B, the ring sends {right or 0} B", _gap(total, want)
                )
            )
    return problems


def judge_tree_bytes(case: dict, outputs: list) -> list[Problem]:
    p, n = case["p"], case["k"] * case["p"]
    total = sum(t for t, _ in outputs if t is not None)
    want = (p - 1) * n * 4
    if any(t is None for t, _ in outputs) or total != want:
        return [Problem(f"all ranks sent {total} B together, the tree (p-1) N b = {want} B")]
    return []


def judge_all_to_all_bytes(case: dict, outputs: list) -> list[Problem]:
    counts, xs = all_to_all_inputs(case)
    row_nbytes = math.prod(case["row"]) * xs[0].element_size()
    problems = []
    for r, (_, sent) in enumerate(outputs):
        want = {j: c * row_nbytes for j, c in enumerate(counts[r]) if j != r and c * row_nbytes}
        total = sum(want.values())
        got = {k: v for k, v in sent.to.items() if v} if sent.to is not None else None
        if sent.total != total or (got is not None and got != want):
            shown = got if got is not None else sent.total
            problems.append(
                Problem(f"rank {r} sent {shown} B, direct sends {want} B", _gap(sent.total, total))
            )
    return problems


def _gap(got, want) -> float | None:
    return None if got is None else float(abs(got - want))


def bytes_cases(collective: str):
    def cases(max_p: int):
        return st.fixed_dictionaries(
            {"p": st.integers(1, max_p), "k": st.integers(1, 12), "collective": st.just(collective)}
        )

    return cases


def bytes_check(collective: str, formula: str) -> Check:
    judge = judge_tree_bytes if formula == "tree" else judge_ring_bytes
    return Check(
        "collectives",
        f"{collective}.bytes",
        f"{collective} sends the {formula} formula's bytes, exactly (BYTES claims {formula!r})",
        (collective,),
        run_counted,
        judge,
        bytes_cases(collective),
        tuple({"p": p, "k": 12, "collective": collective} for p in (1, 2, 3, 4, 8)),
        skip=lambda adapter: bytes_skip(adapter, collective, formula),
    )


CHECKS = [
    *(all_reduce_check(op) for op in ("sum", "avg", "max", "min")),
    reduce_scatter_check("sum", even=True),
    reduce_scatter_check("avg", even=True),
    reduce_scatter_check("sum", even=False),
    all_gather_check(even=True),
    all_gather_check(even=False),
    Check(
        "collectives",
        "broadcast",
        "broadcast(src): every rank ends with src's tensor, exactly",
        ("broadcast",),
        run_broadcast,
        judge_broadcast,
        plain_cases,
        tuple({k: v for k, v in c.items() if k != "op"} for c in hard("sum")),
    ),
    Check(
        "collectives",
        "all_to_all",
        "all_to_all with uneven counts (0..3 rows to each rank): the rows, in source order",
        ("all_to_all",),
        run_all_to_all,
        judge_all_to_all,
        all_to_all_cases,
        ALL_TO_ALL_HARD,
    ),
    bytes_check("all_reduce", "ring"),
    bytes_check("reduce_scatter", "ring"),
    bytes_check("all_gather", "ring"),
    bytes_check("broadcast", "tree"),
    Check(
        "collectives",
        "all_to_all.bytes",
        "all_to_all sends each row straight to its destination, nothing else "
        "(BYTES claims 'direct')",
        ("all_to_all",),
        run_all_to_all,
        judge_all_to_all_bytes,
        all_to_all_cases,
        ALL_TO_ALL_HARD,
        skip=lambda adapter: bytes_skip(adapter, "all_to_all", "direct"),
    ),
]
