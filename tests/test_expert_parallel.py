"""Expert parallelism equals the mixture-of-experts layer in one process, on every rank.

Recipe: every rank builds the whole problem from one seed (every group's tokens, the upstream
gradient, the router and all E experts of a single-process MoE), and computes the reference
here, independently of the module's routing code: `naive_moe` decides which assignments fit by
counting them one at a time in the documented order (first choices in token order, then second
choices), runs each expert on its kept tokens and computes Switch's auxiliary loss from its
definition. Each rank takes its own group's tokens (the test slices them), runs
ExpertParallelMoE, backward of the sum of every rank's loss, sync_grads, and compares with
check_all: y, the auxiliary loss, dL/dx, its experts' weights and gradients, the router's
gradient. Hypothesis draws world sizes, experts per rank, k, capacity factors (dropping
assignments or not), group sizes that differ by rank (0 included) and widths. The module comes
from impl(...) inside the rank functions, so `make lab L=14` grades a learner's file.
Tolerance: float64, rtol 1e-12, atol 1e-13: an expert sees its rows in another order and
batch, and its gradient sums them in another order.
Bytes: each rank sends exactly step_nbytes of its counted assignments (the formula in the
module docstring), counted with ObservedComm around forward and backward.
Tiers: pure (errors, capacity), threads (ep 1..8, dp x ep), processes (4 mpi or gloo processes
started once per test, fixed cases at ep 3 and 4).
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
FAST = {"timeout": 40, "comm_timeout": 8}  # a collective waiting 8 s here is a deadlock
F64 = torch.float64


# ---- the reference, computed here from the definitions -------------------------------------


def naive_moe(full, x: torch.Tensor, groups: list[int], cap_factor, k: int, alpha: float):
    """(y, auxes, kept): the single-process MoE by its definition, group by group; kept[g] lists
    group g's kept (token, expert) pairs. Uses full's router weight and experts, nothing else."""
    w, n_experts = full.router.weight, len(full.experts)
    ys = []
    auxes = []
    kept = []
    start = 0
    for n in groups:
        xg = x[start : start + n]  # (n, D)
        start += n
        probs = F.softmax(xg @ w.t(), dim=-1)  # (n, E)
        top, choice = probs.topk(k, dim=-1)  # (n, k)
        gate = top if k == 1 else top / top.sum(-1, keepdim=True)
        cap = k * n if cap_factor is None else math.ceil(cap_factor * k * n / n_experts)
        taken, mine = [0] * n_experts, []
        for j in range(k):  # first choices of all tokens, then second choices
            for t in range(n):
                e = int(choice[t, j])
                if taken[e] < cap:
                    taken[e] += 1
                    mine.append((t, j, e))
        y = xg.new_zeros(xg.shape)
        for e in range(n_experts):
            rows = [(t, j) for t, j, ee in mine if ee == e]
            if rows:
                ts = torch.tensor([t for t, _ in rows])
                gs = torch.stack([gate[t, j] for t, j in rows])
                y = y.index_add(0, ts, full.experts[e](xg[ts]) * gs[:, None])
        ys.append(y)
        firsts = torch.bincount(choice[:, 0], minlength=n_experts).to(F64) / max(n, 1)
        auxes.append(alpha * n_experts * (firsts * probs.mean(0)).sum() if n else probs.sum() * 0)
        kept.append([(t, e) for t, _, e in mine])
    return torch.cat(ys), auxes, kept


def problem(case: dict, n_groups: int):
    """Every group's tokens and upstream gradient, and the single-process MoE, from one seed."""
    ep = impl("expert_parallel.moe")
    gen = torch.Generator().manual_seed(case["seed"])
    groups = [case["sizes"][g % len(case["sizes"])] for g in range(n_groups)]
    x = torch.randn(sum(groups), case["d"], generator=gen, dtype=F64) * 2  # (N, D)
    gy = torch.randn(sum(groups), case["d"], generator=gen, dtype=F64)  # (N, D)
    full = ep.MoE(
        case["d"],
        case["f"],
        case["n_experts"],
        case["k"],
        case["cf"],
        alpha=case["alpha"],
        seed=case["seed"],
    )
    x_ref = x.clone().requires_grad_()
    y_ref, auxes, kept = naive_moe(full, x_ref, groups, case["cf"], case["k"], case["alpha"])
    ((y_ref * gy).sum() + sum(auxes)).backward()  # the loss: the sum over every group
    return groups, x, gy, full, x_ref.grad, y_ref.detach(), auxes, kept


def ep_matches(comm, case: dict, dp: int = 1, mesh: bool = False) -> None:
    """A world of dp x ep ranks (ep ranks adjacent), one group each: ExpertParallelMoE on the ep
    group, sync_grads over ep and dp, equals naive_moe on all groups; bytes as the formula.
    The comms are split here, or (mesh) taken from make_mesh(Layout(dp ep, 1, 1, ep))."""
    ep_mod = impl("expert_parallel.moe")
    p_all, r = comm.world_size, comm.rank
    ep = p_all // dp
    n_experts = case["e_local"] * ep
    case = dict(case, n_experts=n_experts, k=min(case["k"], n_experts))
    groups, x, gy, full, dx_ref, y_ref, auxes, kept = problem(case, p_all)
    d_coord, e_coord = divmod(r, ep)
    # dp = 1: the whole comm is the ep group (process tests split nothing per example)
    ep_comm, dp_comm = (comm, None) if dp == 1 else (comm.split(d_coord), comm.split(e_coord))
    if mesh:
        made = impl("mesh").make_mesh(comm, impl("mesh").Layout(p_all, 1, 1, ep))
        ep_comm, dp_comm = made.ep_comm, made.edp_comm
    counter = Counter()
    args = (case["d"], case["f"], n_experts, ObservedComm(ep_comm, counter), case["k"], case["cf"])
    layer = ep_mod.ExpertParallelMoE(*args, case["alpha"], seed=case["seed"])
    lo, hi = sum(groups[:r]), sum(groups[: r + 1])  # this rank's group, sliced here
    x_in = x[lo:hi].clone().requires_grad_()
    y, aux = layer(x_in)
    ((y * gy[lo:hi]).sum() + aux).backward()
    sent = counter.bytes_sent
    ep_ops, dp_ops = Counter(), Counter()
    ep_mod.sync_grads(
        layer, ObservedComm(ep_comm, ep_ops), ObservedComm(dp_comm, dp_ops) if dp_comm else None
    )
    first = e_coord * case["e_local"]  # this rank's first expert
    pairs = {
        "y": (y, y_ref[lo:hi]),
        "aux": (aux, auxes[r].detach()),
        "dL/dx": (x_in.grad, dx_ref[lo:hi]),
    }
    pairs["dL/drouter"] = (layer.router.weight.grad, full.router.weight.grad)
    for i, expert in enumerate(layer.experts):
        for (name, q), q_ref in zip(
            expert.named_parameters(), full.experts[first + i].parameters(), strict=True
        ):
            pairs[f"expert {first + i} {name}"] = (q, q_ref)
            # an expert no token reached: the reference never ran it (grad None); the layer ran
            # it on 0 rows (grad 0)
            q_grad = torch.zeros_like(q_ref) if q_ref.grad is None else q_ref.grad
            pairs[f"dL/d expert {first + i} {name}"] = (q.grad, q_grad)
    context = f"dp={dp} ep={ep} groups={groups} {case}"
    check_all(comm, pairs, RTOL, ATOL, context=context)
    # bytes: assignments of this group to experts elsewhere, and of other groups (in this ep
    # group) to this rank's experts, counted from the reference
    owner = lambda e: e // case["e_local"]  # noqa: E731
    mates = range(d_coord * ep, (d_coord + 1) * ep)  # the world ranks of this ep group
    out_rows = sum(owner(e) != e_coord for _, e in kept[r])
    in_rows = sum(owner(e) == e_coord for g in mates if g != r for _, e in kept[g])
    want = ep_mod.step_nbytes(out_rows, in_rows, case["d"], 8, case["e_local"], ep)
    n_experts_params = len(list(layer.experts.parameters()))
    calls = (ep_ops.calls["all_reduce"], dp_ops.calls["all_reduce"])
    want_calls = (1, (1 + n_experts_params) if dp > 1 else 0)  # experts: over dp only
    ok = sent == want and calls == want_calls
    verdict(
        comm, ok, f"{context}: sent {sent} B (want {want}); all-reduces {calls} (want {want_calls})"
    )


cases = st.fixed_dictionaries(
    {
        "e_local": st.integers(1, 3),
        "k": st.sampled_from([1, 2]),
        "cf": st.sampled_from([None, 0.5, 1.0, 1.25, 2.0]),
        "sizes": st.lists(st.integers(0, 9), min_size=1, max_size=3),
        "d": st.integers(1, 5),
        "f": st.integers(1, 6),
        "alpha": st.sampled_from([0.0, 0.01, 0.5]),
        "seed": st.integers(0, 10**6),
    }
)


@pytest.mark.threads
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), cases)
def test_expert_parallel_threads(p, case):
    run_threads(ep_matches, p, case, **FAST)


DP_X_EP_CASE = {"e_local": 2, "k": 2, "cf": 1.0, "sizes": [5, 3], "d": 3, "f": 4}
DP_X_EP_CASE.update(alpha=0.01, seed=4)


@pytest.mark.threads
@pytest.mark.parametrize("dp, ep, mesh", [(2, 1, False), (2, 2, False), (3, 2, True), (2, 3, True)])
def test_dp_x_ep_reduces_experts_over_their_replicas_only(dp, ep, mesh):
    run_threads(ep_matches, dp * ep, DP_X_EP_CASE, dp, mesh, **FAST)


def drops(comm) -> list[int]:
    """How many assignments each rank drops at a capacity factor of 0.5 (some must)."""
    ep = impl("expert_parallel.moe")
    layer = ep.ExpertParallelMoE(4, 4, 2 * comm.world_size, comm, 2, 0.5, seed=1)
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(comm.rank), dtype=F64)
    return layer.router(x).dropped


@pytest.mark.threads
def test_a_small_capacity_drops_assignments_and_the_equality_cases_include_them():
    # 12 tokens x 2 choices into 4 experts of capacity ceil(0.5 * 2 * 12 / 4) = 3: 12 kept
    assert run_threads(drops, 2, **FAST) == [12, 12]
    ep = impl("expert_parallel.moe")
    assert ep.capacity(1.25, 1, 10, 4) == 4 and ep.capacity(None, 2, 7, 3) == 14
    assert ep.capacity(0.5, 2, 0, 4) == 0


# ---- pure: the router's rule and the auxiliary loss ----------------------------------------


@pytest.mark.pure
def test_keep_mask_counts_first_choices_before_second_choices():
    ep = impl("expert_parallel.moe")
    choices = torch.tensor([[0, 1], [1, 0], [0, 1], [0, 2]])  # (4 tokens, k=2)
    keep = ep.keep_mask(choices, 3, 2)
    # expert 0 takes the first choices of tokens 0 and 2; token 3's first choice and token 1's
    # second choice come too late. Expert 1: token 1 (first), then token 0's second choice
    want = torch.tensor([[True, True], [True, False], [True, False], [False, True]])
    assert torch.equal(keep, want), keep


@pytest.mark.pure
def test_switch_aux_loss_is_alpha_when_balanced_and_alpha_e_when_collapsed():
    ep = impl("expert_parallel.moe")
    n_experts = 4
    uniform = torch.full((8, n_experts), 1 / n_experts, dtype=F64)
    balanced = torch.full((n_experts,), 2)
    assert ep.switch_aux_loss(uniform, balanced, 0.01).item() == pytest.approx(0.01, rel=1e-12)
    onehot = F.one_hot(torch.zeros(8, dtype=torch.int64), n_experts).to(F64)
    collapsed = torch.tensor([8, 0, 0, 0])
    assert ep.switch_aux_loss(onehot, collapsed, 0.01).item() == pytest.approx(0.04, rel=1e-12)


@pytest.mark.pure
def test_bad_layouts_are_refused_with_the_numbers():
    ep = impl("expert_parallel.moe")

    class Three:
        rank, world_size = 0, 3

    with pytest.raises(ValueError, match="n_experts=4 is not divisible by ep=3"):
        ep.ExpertParallelMoE(2, 2, 4, Three())
    with pytest.raises(ValueError, match="k=3 must be 1 or 2 and at most n_experts=4"):
        ep.MoE(2, 2, 4, k=3)
    with pytest.raises(ValueError, match="k=2 must be 1 or 2 and at most n_experts=1"):
        ep.MoE(2, 2, 1, k=2)
    with pytest.raises(ValueError, match="capacity_factor=0 must be > 0"):
        ep.MoE(2, 2, 4, capacity_factor=0)


# ---- processes: the same property over real mpi and gloo processes -------------------------


# the process tier's fixed cases (test_expert_parallel_threads draws the sweep), (ep, case):
# top-2 with a rank sending no tokens, tokens dropped at capacity 0.5 on an odd world, no cap
HARD = [
    (4, {"e_local": 2, "k": 2, "cf": 1.25, "sizes": [5, 0, 9], "d": 3, "f": 4, "alpha": 0.01,
         "seed": 1}),
    (3, {"e_local": 1, "k": 1, "cf": 0.5, "sizes": [7, 2], "d": 5, "f": 6, "alpha": 0.5,
         "seed": 2}),
    (4, {"e_local": 3, "k": 1, "cf": None, "sizes": [1], "d": 2, "f": 3, "alpha": 0.0,
         "seed": 3}),
]  # fmt: skip


def properties_in_ranks(comm, max_examples: int) -> int:
    """The fixed cases (then max_examples drawn, the same on every rank), ep = 1..4 by
    splitting; then dp 2 x ep 2 on the mesh, experts' gradients reduced over their replicas
    only."""
    explicit = [(min(k, comm.world_size), case) for k, case in HARD]
    count = in_subworlds(comm, ep_matches, cases, max_examples, None, explicit)
    ep_matches(comm, DP_X_EP_CASE, 2, True)
    return count


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_expert_parallel_processes(backend):
    assert run_ranks(properties_in_ranks, 4, backend, 0, timeout=180) == [len(HARD)] * 4
