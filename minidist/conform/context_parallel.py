"""Conformance checks of the capability "cp": ring attention (context parallelism), restated from
tests/test_context_parallel.py.

Equals: softmax attention over the whole sequence in one process, softmax(q k^T / sqrt(d) +
mask) v with the (T, T) scores materialized, the mask causal on global positions (query i sees
keys 0..i, across every chunk boundary) or none: on each rank the output of its own queries and
dL/dq, dL/dk, dL/dv of its own tokens (dk and dv gather every rank's queries), for the loss
sum over ranks of sum(out * g). float64, rtol 1e-12 with atol 1e-13: the log-sum-exp merge adds
the blocks' exponentials in another order than one softmax, and gradients that cancel to near
zero keep the absolute rounding of their O(1) terms. With q scaled by s = 1000 (exp() of a raw
score overflows float64 unless every exponent is taken relative to a maximum or log-sum-exp):
atol 1e-13 s, and 1e-13 s^2 for dL/dk = dS^T q (a score's rounding, eps s, times |q|).
Layout: rank r holds tokens r T/p .. (r+1) T/p - 1 (plain, contiguous); an adapter that declares
CP_LAYOUT = "zigzag" gets chunks r and 2p-1-r of 2p instead (the causal work balanced). q, k
and v are handed over non-contiguous.
Cases: world sizes 1..8 on threads (1..4 over processes), 1..4 tokens a rank (1: every key of
another rank wholly before or after), batch 1..2, heads 1..3, head sizes 1, 2 and 5, causal and
not.
Bytes (where the adapter's BYTES claims {"ring_attention": "ring"}), n = B H (T/p) d elements
of this rank's q, b = 8 bytes: all to rank+1; forward p-1 messages of k|v, 2 (p-1) n b; backward
p-1 of k|v and p of dk|dv (each travels with its block and comes home), 2 (2p-1) n b.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from minidist.conform.adapter import bytes_skip
from minidist.conform.checks import Check, Problem, compare_all, detached

RTOL, ATOL = 1e-12, 1e-13  # float64: see the module docstring
F64 = torch.float64
LAYOUTS = ("plain", "zigzag")


def layout_of(adapter) -> str:
    layout = getattr(adapter, "CP_LAYOUT", "plain")
    if layout not in LAYOUTS:
        raise ValueError(f"CP_LAYOUT = {layout!r} is not one of {LAYOUTS}")
    return layout


def seq_len(case: dict, layout: str) -> int:
    """T: case["m"] tokens a chunk, one chunk a rank (plain) or two (zigzag)."""
    return case["m"] * case["p"] * (2 if layout == "zigzag" else 1)


def positions(t: int, p: int, r: int, layout: str) -> torch.Tensor:
    """The global positions of rank r's tokens, in the order it holds them."""
    if layout == "plain":
        m = t // p
        return torch.arange(r * m, (r + 1) * m)
    m = t // (2 * p)
    late = 2 * p - 1 - r
    return torch.cat([torch.arange(r * m, (r + 1) * m), torch.arange(late * m, (late + 1) * m)])


def problem(case: dict, layout: str) -> list[torch.Tensor]:
    """q, k, v and the upstream gradient g of the whole sequence, (B, H, T, d) each."""
    g = torch.Generator().manual_seed(case["seed"])
    shape = (case["b"], case["h"], seq_len(case, layout), case["d"])
    q, k, v, grad = (torch.randn(shape, generator=g, dtype=F64) for _ in range(4))
    return [q * case["scale"], k, v, grad]


def attention(q, k, v, causal: bool) -> torch.Tensor:
    """The kit's reference: the (T, T) scores, masked, softmax, times v: (B, H, T, d)."""
    t = q.shape[2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if causal:
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v


def leaf(t: torch.Tensor) -> torch.Tensor:
    """t's values as a non-contiguous leaf that requires grad."""
    return t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()


def run_ring(rank, case: dict) -> dict:
    """The adapter's ring attention on this rank's tokens; backward of sum(out * g)."""
    a = rank.adapter
    layout = layout_of(a)
    q, k, v, grad = problem(case, layout)
    mine = positions(seq_len(case, layout), rank.world_size, rank.rank, layout)
    local = [leaf(x.index_select(2, mine)) for x in (q, k, v)]  # (B, H, T/p, d) each
    out = a.ring_attention(rank.comm, *local, case["causal"])
    out.backward(grad.index_select(2, mine))
    sent = rank.sent()
    grads = {f"dL/d{name}": detached(x.grad) for name, x in zip("qkv", local, strict=True)}
    return {"layout": layout, "out": detached(out), **grads, "sent": (sent.total, sent.to)}


def judge_ring(case: dict, outputs: list) -> list[Problem]:
    layout = outputs[0]["layout"]  # the kit's reading of CP_LAYOUT, the same on every rank
    q, k, v, grad = problem(case, layout)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, case["causal"])
    out.backward(grad)
    want = {"out": out.detach(), "dL/dq": q.grad, "dL/dk": k.grad, "dL/dv": v.grad}
    s = case["scale"]
    problems = []
    for r, got in enumerate(outputs):
        mine = positions(seq_len(case, layout), case["p"], r, layout)
        pairs = {f"rank {r} {n}": (got[n], w.index_select(2, mine)) for n, w in want.items()}
        dk = {f"rank {r} dL/dk": pairs.pop(f"rank {r} dL/dk")}
        problems += compare_all(pairs, RTOL, ATOL * s)
        problems += compare_all(dk, RTOL, ATOL * s * s)  # dS^T q: a score's rounding times |q|
    return problems


def judge_bytes(case: dict, outputs: list) -> list[Problem]:
    """Each rank's bytes, forward and backward, all to rank+1, against the docstring's."""
    p = case["p"]
    layout = outputs[0]["layout"]
    n = case["b"] * case["h"] * (seq_len(case, layout) // p) * case["d"]
    want_total = 0 if p == 1 else (2 * (p - 1) + 2 * (2 * p - 1)) * n * 8
    problems = []
    for r, got in enumerate(outputs):
        total, to = got["sent"]
        want = {(r + 1) % p: want_total} if p > 1 else {}
        seen = {j: v for j, v in to.items() if v} if to is not None else None
        if total != want_total or (seen is not None and seen != want):
            shown = seen if seen is not None else total
            gap = None if total is None else float(abs(total - want_total))
            problems.append(Problem(f"rank {r} sent {shown} B, the ring sends {want} B", gap))
    return problems


def cases_of(causal: tuple, scale: float):
    def cases(max_p: int):
        return st.fixed_dictionaries(
            {
                "p": st.integers(1, max_p),
                "m": st.integers(1, 4),  # tokens a chunk
                "b": st.integers(1, 2),
                "h": st.integers(1, 3),
                "d": st.sampled_from([1, 2, 5]),
                "causal": st.sampled_from(causal),
                "scale": st.just(scale),  # of q
                "seed": st.integers(0, 10**6),
            }
        )

    return cases


def hard(causal: tuple, scale: float) -> tuple:
    """One rank; one token a rank on 2, 3 and 8 ranks; three tokens a rank on 4."""
    worlds = [(1, 3, 2), (2, 1, 1), (3, 1, 3), (4, 3, 2), (8, 1, 1)]  # (p, m, heads)
    return tuple(
        {
            "p": p,
            "m": m,
            "b": 1 + i % 2,
            "h": h,
            "d": (5, 2, 1)[i % 3],
            "causal": causal[i % len(causal)],
            "scale": scale,
            "seed": 50 + i,
        }
        for i, (p, m, h) in enumerate(worlds)
    )


def ring_check(name: str, about: str, causal: tuple, scale: float = 1.0, **kw) -> Check:
    return Check(
        "cp",
        name,
        about,
        ("ring_attention",),
        run_ring,
        kw.pop("judge", judge_ring),
        cases_of(causal, scale),
        hard(causal, scale),
        **kw,
    )


CHECKS = [
    ring_check(
        "causal",
        "causal: out, dL/dq, dL/dk, dL/dv of each rank's tokens as one process on the whole "
        "sequence, the mask on global positions across chunk boundaries (1e-12)",
        (True,),
    ),
    ring_check(
        "unmasked",
        "causal=False: every query to every key; out and gradients as one process (1e-12)",
        (False,),
    ),
    ring_check(
        "large_scores",
        "q x 1000, causal and not: exp() of a raw score overflows unless the merge works "
        "relative to the log-sum-exp (1e-13 s, s^2 for dL/dk)",
        (True, False),
        1000.0,
    ),
    ring_check(
        "bytes",
        "forward and backward send 2 (p-1) + 2 (2p-1) blocks of B H T/p d elements, all to "
        "rank+1, exactly (BYTES claims 'ring')",
        (True, False),
        judge=judge_bytes,
        skip=lambda adapter: bytes_skip(adapter, "ring_attention", "ring"),
    ),
]
