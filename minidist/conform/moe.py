"""Conformance checks of the capability "moe": an expert-parallel mixture-of-experts layer,
restated from tests/test_expert_parallel.py.

Equals: the same layer in one process with all E experts, on every rank's tokens, each rank's
tokens routed as one group (the capacity is per group, as in GShard and Switch): each rank's
outputs and dL/dx (its own tokens), the router's gradient (the whole batch's, on every rank) and
the gradient of every expert a rank holds (every token routed to it, from any rank), the loss
being the sum over ranks of sum(y * gy). float64, rtol 1e-12 with atol 1e-13: an expert sees
its rows in another order and batch, and its gradient sums them in another order. The kit's
reference decides which assignments fit by counting them one at a time (the rule below), runs
every expert on its rows (none: its gradient is zero, and the layer may leave it None), and is
computed by the kit from the case's seed alone.
The layer: probs = softmax(x W^T) (router W: (E, D)); each token's top-k experts (k 1 or 2),
weighted by the probability (k = 1) or the two renormalized to sum to 1 (k = 2); expert e is
fc2(gelu(fc1(x))) (exact gelu); rank r holds experts r E/p .. (r+1) E/p - 1. Capacity factor cf
(None: no limit): an expert takes at most C = ceil(cf k n / E) assignments from a group of n
tokens, counted every token's first choice in token order, then every second choice; one past C
is dropped (adds nothing: a token with every choice dropped gets 0).
Cases: world sizes 1..8 on threads (1..4 over processes), 1..3 experts per rank, 0..9 tokens a
rank (uneven; a rank with none), ranks whose experts no token reaches (a few tokens over many
ranks), top-1 and top-2, capacity factors that drop assignments (0.5) and that keep all.
Bytes (where the adapter's BYTES claims {"expert_parallel_moe": "direct"}), forward and backward
together, D float64 elements a row, a_rj the assignments rank r's group keeps for rank j's
experts: rank r sends to each other rank j 2 (a_rj + a_jr) D 8 bytes of rows (out, back, and
both again in backward) and 8 E/p bytes of counts (an int64 per expert of j), nothing else.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from minidist.conform.adapter import bytes_skip
from minidist.conform.checks import Check, Problem, compare, compare_all, detached

RTOL, ATOL = 1e-12, 1e-13  # float64: see the module docstring
F64 = torch.float64
CAPACITY_FACTORS = (0.5, 1.0, 1.25, 2.0)  # 0.5 always drops an assignment of a full group


class Expert(nn.Module):
    """fc2(gelu(fc1(x))): (rows, D) -> (rows, D); weights from g (not the global generator:
    thread-ranks share it), scaled 1/sqrt(fan-in) so gelu sees both of its sides."""

    def __init__(self, d: int, f: int, g: torch.Generator):
        super().__init__()
        self.fc1 = nn.utils.skip_init(nn.Linear, d, f, dtype=F64)
        self.fc2 = nn.utils.skip_init(nn.Linear, f, d, dtype=F64)
        with torch.no_grad():
            for lin in (self.fc1, self.fc2):
                fan_in = lin.weight.shape[1]
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g, dtype=F64))
                lin.weight.div_(math.sqrt(fan_in))
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=g, dtype=F64) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def n_experts(case: dict) -> int:
    return case["e_local"] * case["p"]


def sizes(case: dict) -> list[int]:
    """Tokens of each rank: case["sizes"] repeated over the ranks."""
    return [case["sizes"][r % len(case["sizes"])] for r in range(case["p"])]


def bounds(case: dict, r: int) -> tuple[int, int]:
    """Rank r's rows of the whole batch."""
    n = sizes(case)
    return sum(n[:r]), sum(n[: r + 1])


def problem(case: dict) -> dict:
    """The whole layer and batch from the seed: the router (nn.Linear(D, E), no bias), the E
    experts, every rank's tokens x (N, D) and the upstream gradient gy (N, D)."""
    g = torch.Generator().manual_seed(case["seed"])
    d, e = case["d"], n_experts(case)
    router = nn.utils.skip_init(nn.Linear, d, e, bias=False, dtype=F64)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, d, generator=g, dtype=F64) / math.sqrt(d))
    experts = [Expert(d, case["f"], g) for _ in range(e)]
    n = sum(sizes(case))
    x = torch.randn(n, d, generator=g, dtype=F64) * 2  # (N, D): spread, so routing varies
    gy = torch.randn(n, d, generator=g, dtype=F64)  # (N, D)
    return {"router": router, "experts": experts, "x": x, "gy": gy}


# ---- what every rank runs ----------------------------------------------------------------------


def run_moe(rank, case: dict) -> dict:
    """The adapter's layer on this rank's tokens; backward of sum(y * gy); what it holds."""
    a = rank.adapter
    r = rank.rank
    full = problem(case)
    layer = a.expert_parallel_moe(rank.comm, full["router"], full["experts"], case["k"], case["cf"])
    lo, hi = bounds(case, r)
    x_local = full["x"][lo:hi].clone().requires_grad_()  # (n_r, D)
    y = layer(x_local)  # (n_r, D)
    (y * full["gy"][lo:hi]).sum().backward()
    sent = rank.sent()  # forward and backward, before any gradient synchronization
    if hasattr(a, "moe_after_backward"):
        a.moe_after_backward(layer)
    held = []
    for expert in layer.experts:
        params = {name: _param(expert, name) for name in PARAMS}
        held.append({k: detached(q) for k, q in params.items()})
        held[-1] |= {f"dL/d{k}": detached(q.grad) for k, q in params.items()}
    return {
        "y": detached(y),
        "dL/dx": detached(x_local.grad),
        "router.weight": detached(layer.router.weight),
        "dL/drouter.weight": detached(layer.router.weight.grad),
        "experts": held,
        "sent": (sent.total, sent.to),
    }


def _param(expert: nn.Module, name: str) -> nn.Parameter:
    part, attribute = name.split(".")
    return getattr(getattr(expert, part), attribute)


# ---- the kit's reference -----------------------------------------------------------------------


def route(probs: torch.Tensor, k: int, cf: float | None) -> list[tuple[int, int, int]]:
    """The kept assignments (token, choice, expert) of one group, counted one at a time in the
    documented order: first choices in token order, then second choices; probs (n, E)."""
    n, e = probs.shape
    cap = k * n if cf is None else math.ceil(cf * k * n / e)
    choice = probs.topk(k, dim=-1).indices  # (n, k), best first
    taken = [0] * e
    kept = []
    for j in range(k):
        for t in range(n):
            expert = int(choice[t, j])
            if taken[expert] < cap:
                taken[expert] += 1
                kept.append((t, j, expert))
    return kept


def reference(case: dict) -> dict:
    """The single-process layer on every group, and backward of sum(y * gy): y, dL/dx, the
    router's and every expert's parameters and gradients, and each group's kept assignments."""
    full = problem(case)
    w = full["router"].weight.requires_grad_()  # (E, D)
    experts = full["experts"]
    x = full["x"].requires_grad_()
    k = case["k"]
    ys = []
    kept = []
    for r in range(case["p"]):
        lo, hi = bounds(case, r)
        xg = x[lo:hi]  # (n, D)
        probs = F.softmax(xg @ w.t(), dim=-1)  # (n, E)
        top = probs.topk(k, dim=-1).values  # (n, k)
        gate = top if k == 1 else top / top.sum(-1, keepdim=True)
        mine = route(probs.detach(), k, case["cf"])
        y = xg.new_zeros(xg.shape)  # (n, D): a token every choice of which dropped stays 0
        for e, expert in enumerate(experts):
            tokens = torch.tensor([t for t, _, ee in mine if ee == e], dtype=torch.int64)
            choices = torch.tensor([j for _, j, ee in mine if ee == e], dtype=torch.int64)
            out = expert(xg[tokens])  # (rows, D), rows maybe 0: its gradient is then zero
            y = y.index_add(0, tokens, out * gate[tokens, choices][:, None])
        ys.append(y)
        kept.append([(t, e) for t, _, e in mine])
    y = torch.cat(ys)  # (N, D)
    (y * full["gy"]).sum().backward()
    params = [{name: _param(expert, name) for name in PARAMS} for expert in experts]
    return {
        "y": y.detach(),
        "dL/dx": x.grad,
        "router.weight": w.detach(),
        "dL/drouter.weight": w.grad,
        "experts": [
            {k: q.detach() for k, q in ps.items()} | {f"dL/d{k}": q.grad for k, q in ps.items()}
            for ps in params
        ],
        "kept": kept,
    }


def judge_moe(case: dict, outputs: list) -> list[Problem]:
    ref = reference(case)
    e_local = case["e_local"]
    problems = []
    for r, got in enumerate(outputs):
        lo, hi = bounds(case, r)
        pairs = {
            f"rank {r} y": (got["y"], ref["y"][lo:hi]),
            f"rank {r} dL/dx": (got["dL/dx"], ref["dL/dx"][lo:hi]),
            f"rank {r} dL/drouter.weight": (got["dL/drouter.weight"], ref["dL/drouter.weight"]),
        }
        problems += compare_all(pairs, RTOL, ATOL)
        held = compare(f"rank {r} router.weight", got["router.weight"], ref["router.weight"])
        problems += [held] if held else []
        if len(got["experts"]) != e_local:
            problems.append(Problem(f"rank {r} holds {len(got['experts'])} experts, not E/p"))
            continue
        for i, mine in enumerate(got["experts"]):
            e = r * e_local + i
            want = ref["experts"][e]
            for name in PARAMS:  # the kit's own weights, copied: exactly
                found = compare(f"rank {r} expert {e} {name}", mine[name], want[name])
                problems += [found] if found else []
                grad = f"dL/d{name}"
                problems += _compare_grad(f"rank {r} expert {e} {grad}", mine[grad], want[grad])
    return problems


def _compare_grad(name: str, got, want: torch.Tensor) -> list[Problem]:
    """compare(), where None stands for zeros: an expert no row reached has a zero gradient,
    and a layer that never ran it may leave it None."""
    if got is None and not want.any():
        return []
    if got is None:
        return [Problem(f"{name}: None, one process has a nonzero gradient")]
    found = compare(name, got, want, RTOL, ATOL)
    return [found] if found else []


def judge_bytes(case: dict, outputs: list) -> list[Problem]:
    """Each rank's bytes sent to each peer, forward and backward, against the docstring's
    formula, from the reference's kept assignments."""
    p, e_local = case["p"], case["e_local"]
    kept = reference(case)["kept"]
    a = [[0] * p for _ in range(p)]  # a[r][j]: group r's kept assignments to rank j's experts
    for r, mine in enumerate(kept):
        for _, e in mine:
            a[r][e // e_local] += 1
    row_nbytes = case["d"] * 8
    problems = []
    for r, got in enumerate(outputs):
        total, to = got["sent"]
        want = {j: 2 * (a[r][j] + a[j][r]) * row_nbytes + 8 * e_local for j in range(p) if j != r}
        seen = {j: v for j, v in to.items() if v} if to is not None else None
        if total != sum(want.values()) or (seen is not None and seen != want):
            shown = seen if seen is not None else total
            gap = None if total is None else float(abs(total - sum(want.values())))
            problems.append(Problem(f"rank {r} sent {shown} B, direct sends {want} B", gap))
    return problems


# ---- cases -------------------------------------------------------------------------------------


def _valid(case: dict) -> dict:
    """k = 2 needs two experts: one rank holds at least two."""
    if case["k"] > n_experts(case):
        return case | {"e_local": case["k"]}
    return case


def cases_of(ks: tuple, cfs: tuple):
    def cases(max_p: int):
        return st.fixed_dictionaries(
            {
                "p": st.integers(1, max_p),
                "e_local": st.integers(1, 3),
                "k": st.sampled_from(ks),
                "cf": st.sampled_from(cfs),
                "sizes": st.lists(st.integers(0, 9), min_size=1, max_size=3),  # cycled
                "d": st.integers(1, 5),
                "f": st.integers(1, 6),
                "seed": st.integers(0, 10**6),
            }
        ).map(_valid)

    return cases


def hard(ks: tuple, cfs: tuple) -> tuple:
    """One rank; three with a rank that has no token; two tokens over four ranks (at least
    two ranks' experts get none); eight ranks, uneven."""
    worlds = [(1, 3, [5]), (3, 2, [5, 0, 9]), (4, 1, [1, 0]), (8, 2, [3, 1, 0, 7])]
    return tuple(
        {
            "p": p,
            "e_local": e_local,
            "k": ks[i % len(ks)],
            "cf": cfs[i % len(cfs)],
            "sizes": n,
            "d": 3,
            "f": 4,
            "seed": 40 + i,
        }
        for i, (p, e_local, n) in enumerate(worlds)
    )


def moe_check(name: str, about: str, ks: tuple, cfs: tuple, judge=judge_moe, skip=None) -> Check:
    return Check(
        "moe",
        name,
        about,
        ("expert_parallel_moe",),
        run_moe,
        judge,
        cases_of(ks, cfs),
        hard(ks, cfs),
        skip=skip,
    )


CHECKS = [
    moe_check(
        "top1",
        "top-1, no capacity limit: y, dL/dx, the router's and each held expert's gradients as "
        "one process on all tokens (1e-12)",
        (1,),
        (None,),
    ),
    moe_check(
        "top2",
        "top-2 (gates renormalized), no capacity limit: as top1 (1e-12)",
        (2,),
        (None,),
    ),
    moe_check(
        "capacity",
        "capacity factor 0.5-2 per rank's tokens, first choices before second: dropped "
        "assignments add nothing (1e-12)",
        (1, 2),
        CAPACITY_FACTORS,
    ),
    moe_check(
        "bytes",
        "forward and backward send each kept row straight to its expert's rank and back, and "
        "8 E/p bytes of counts to each rank, exactly (BYTES claims 'direct')",
        (1, 2),
        (None, 0.5, 1.25),
        judge=judge_bytes,
        skip=lambda adapter: bytes_skip(adapter, "expert_parallel_moe", "direct"),
    ),
]
