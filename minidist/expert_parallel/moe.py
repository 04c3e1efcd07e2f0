"""Expert parallelism: a mixture-of-experts layer whose experts are spread over the ranks of an
`ep` group; each token is sent to the rank of its chosen experts and back, by all-to-all.

Equals: MoE, the same layer in one process with all experts, on the batch cut in the same
groups (one group per rank: capacity and the auxiliary loss are per group, as in GShard and
Switch): outputs, the auxiliary loss, dL/dx, every expert's gradient (on the rank that holds it)
and the router's gradient (summed over the ranks by sync_grads), for dropped and kept tokens
alike. float64: 1e-12 relative (an expert sees its rows in another order and batch).
Communication per step, per rank (p ranks, E experts, E/p on each; n tokens of D elements of b
bytes here; m of its kept assignments go to other ranks, m' arrive from other ranks): forward
an all-to-all of the counts (8 E/p (p-1) bytes), the dispatch (m D b) and the combine (m' D b);
backward the two again, reversed: 8 E/p (p-1) + 2 (m + m') D b in all. Balanced, nothing
dropped: m = m' = (p-1)/p k n, so 4 (p-1)/p k n D b.
Memory per rank: E/p experts (2 D F + F + D parameters each, F the hidden width) and the
router (E D); in flight, the rows it dispatches (its kept assignments, <= k n) and the rows
that arrive (<= C from each rank for each of its E/p experts), D elements each, both ways.
Ladder: Router (top-k, capacity, dropping, Switch's auxiliary loss) -> MoE (every expert here;
the single-process program) -> ExpertParallelMoE (experts over ep_comm; dispatch and combine
by all-to-all, through autograd) -> sync_grads (the router over every rank, the experts only
over their replicas: the dp x ep composition).
Paper: Fedus, Zoph, Shazeer, "Switch Transformers" (JMLR 2022), section 2.2 (capacity factor;
the auxiliary loss, equations 4-6); Lepikhin et al., "GShard" (ICLR 2021), section 2.2 (top-2,
groups, dispatch order; its second choice goes only at random, here always).
Lesson: lessons/14_expert_parallel/.
Run: minidist run -n 4 --backend mpi lessons/14_expert_parallel/demo.py

Which tokens drop. An expert takes at most C = ceil(capacity_factor * k * n / E) assignments
from a group of n tokens (capacity_factor None: no limit). Assignments are counted in priority
order: every token's first choice in token order, then every token's second choice (k = 2), so
a second choice never pushes out a first choice. An assignment past C is dropped: it adds
nothing to the token's output (a token with all its choices dropped gets 0 here, and only the
residual connection around the layer carries it on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minidist.collectives.algorithms import all_to_all

SWITCH_ALPHA = 0.01  # the auxiliary loss's weight: Switch Transformers, section 2.2 ("10^-2")


def capacity(capacity_factor: float | None, k: int, n: int, n_experts: int) -> int:
    """C = ceil(capacity_factor * k * n / E): the most assignments an expert takes from a group
    of n tokens; with capacity_factor None, every assignment (k n)."""
    if capacity_factor is None:
        return k * n
    return math.ceil(capacity_factor * k * n / n_experts)


@dataclass
class Routing:
    """Where a group's tokens go: the kept assignments, sorted by expert (then priority).

    token, expert: (m,) int64; gate: (m,) the weight of each output (differentiable);
    counts: (E,) int64, assignments kept per expert; dropped: assignments dropped; aux: the
    auxiliary loss (0-d, differentiable); first: (E,) tokens whose first choice is each expert."""

    token: torch.Tensor
    expert: torch.Tensor
    gate: torch.Tensor
    counts: torch.Tensor
    dropped: int
    aux: torch.Tensor
    first: torch.Tensor


def keep_mask(choices: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """(n, k) bool: which assignments fit in their expert's capacity, in the documented order.

    choices: (n, k) expert ids, column j the j-th choice of each token."""
    # lab 14.1 begin: count each expert's assignments in priority order; keep those before cap
    order = choices.t().reshape(-1)  # (k n,): first choices in token order, then the second
    seen = F.one_hot(order, n_experts).cumsum(0)  # (k n, E): assignments so far per expert
    position = seen.gather(1, order[:, None]).squeeze(1) - 1  # (k n,): this one's place in line
    keep = position < cap
    # lab 14.1 end
    return keep.view(choices.shape[1], -1).t()  # (n, k)


def switch_aux_loss(probs: torch.Tensor, first: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha E sum_i f_i P_i (Switch, eq. 4): f_i the fraction of tokens whose first choice is
    expert i (counted before dropping; no gradient), P_i the mean router probability of i.

    probs: (n, E); first: (E,) counts. Smallest, alpha, when both are uniform (1/E); a
    collapsed router (every token to one expert) pays alpha E. An empty group pays 0."""
    n, n_experts = probs.shape
    if n == 0:
        return probs.sum() * 0.0  # 0-d, still connected to the router
    # lab 14.2 begin: f_i and P_i per expert; the loss alpha E sum_i f_i P_i
    f = first.to(probs.dtype) / n  # (E,)
    p_mean = probs.mean(0)  # (E,)
    return alpha * n_experts * (f * p_mean).sum()
    # lab 14.2 end


class Router(nn.Module):
    """A linear gate (E, D) and top-k routing with capacity; replicated on every rank."""

    def __init__(
        self,
        d: int,
        n_experts: int,
        k: int,
        capacity_factor: float | None,
        alpha: float = SWITCH_ALPHA,
        seed: int = 0,
        dtype=torch.float64,
    ):
        super().__init__()
        if k not in (1, 2) or k > n_experts:
            raise ValueError(f"k={k} must be 1 or 2 and at most n_experts={n_experts}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None)")
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(n_experts, d, generator=gen, dtype=dtype) / math.sqrt(d)
        self.weight = nn.Parameter(weight)  # (E, D)
        self.k = k
        self.capacity_factor = capacity_factor
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> Routing:
        """The routing of a group x: (n, D). k = 1 weighs the output by the chosen expert's
        probability (Switch: it is the router's only gradient); k = 2 by the two probabilities
        renormalized to sum to 1 (GShard, Mixtral)."""
        n_experts = self.weight.shape[0]
        probs = F.softmax(x @ self.weight.t(), dim=-1)  # (n, E)
        top, choices = probs.topk(self.k, dim=-1)  # (n, k) each, best first
        gates = top if self.k == 1 else top / top.sum(-1, keepdim=True)  # (n, k)
        cap = capacity(self.capacity_factor, self.k, x.shape[0], n_experts)
        keep = keep_mask(choices, n_experts, cap)  # (n, k)
        token = torch.arange(x.shape[0]).unsqueeze(1).expand_as(choices)[keep]  # (m,)
        expert, gate = choices[keep], gates[keep]  # (m,) each, in (token, choice) order
        order = torch.argsort(expert, stable=True)  # by expert; each expert's in token order
        first = torch.bincount(choices[:, 0], minlength=n_experts)  # (E,)
        aux = switch_aux_loss(probs, first, self.alpha)
        counts = torch.bincount(expert, minlength=n_experts)  # (E,)
        dropped = int(keep.numel() - keep.sum())
        return Routing(token[order], expert[order], gate[order], counts, dropped, aux, first)


class Expert(nn.Module):
    """One expert: Linear(D, F) -> GeLU -> Linear(F, D), drawn from (seed, its index) alone, so
    every rank builds the same expert e without building the others."""

    def __init__(self, d: int, d_ff: int, seed: int, e: int, dtype=torch.float64):
        super().__init__()
        gen = torch.Generator().manual_seed(seed * 1_000_003 + e + 1)
        self.fc1 = nn.utils.skip_init(nn.Linear, d, d_ff, dtype=dtype)  # no global RNG
        self.fc2 = nn.utils.skip_init(nn.Linear, d_ff, d, dtype=dtype)
        with torch.no_grad():
            for lin in (self.fc1, self.fc2):
                fan_in = lin.weight.shape[1]
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / math.sqrt(fan_in))
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (rows, D) -> (rows, D)


def run_experts(experts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Expert i applied to the next counts[i] rows of rows (m, D): (m, D), in rows' order."""
    chunks = rows.split(counts)
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks, strict=True)])


def combine(n: int, routing: Routing, out: torch.Tensor) -> torch.Tensor:
    """(n, D): each token's sum of gate * its experts' outputs; out (m, D) in routing's order."""
    y = out.new_zeros(n, out.shape[1])  # (n, D): dropped tokens stay 0
    return y.index_add(0, routing.token, out * routing.gate[:, None])


class MoE(nn.Module):
    """The single-process program: a router and all E experts.

    forward(x, groups) -> (y, aux): x (N, D) cut into consecutive groups of the given sizes
    (default: one group), each routed with its own capacity and auxiliary loss; y (N, D), aux
    the sum of the groups' losses."""

    def __init__(
        self,
        d: int,
        d_ff: int,
        n_experts: int,
        k: int = 1,
        capacity_factor: float | None = 1.25,
        alpha: float = SWITCH_ALPHA,
        seed: int = 0,
        dtype=torch.float64,
    ):
        super().__init__()
        self.router = Router(d, n_experts, k, capacity_factor, alpha, seed, dtype)
        self.experts = nn.ModuleList(Expert(d, d_ff, seed, e, dtype) for e in range(n_experts))

    def forward(self, x: torch.Tensor, groups: list[int] | None = None):
        ys, aux = [], x.new_zeros(())
        for xg in x.split(groups or [x.shape[0]]):  # (n_g, D) each
            routing = self.router(xg)
            out = run_experts(self.experts, xg[routing.token], routing.counts.tolist())
            ys.append(combine(xg.shape[0], routing, out))
            aux = aux + routing.aux
        return torch.cat(ys), aux


class AllToAll(torch.autograd.Function):
    """all_to_all with autograd: the backward sends each row's gradient back where the row
    came from, the same all-to-all with the counts swapped (both known: no counts exchanged)."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, comm):
        ctx.counts, ctx.comm = (send_counts, recv_counts), comm
        return all_to_all(x, send_counts, comm, recv_counts)[0]

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return all_to_all(grad, recv_counts, ctx.comm, send_counts)[0], None, None, None


class ExpertParallelMoE(nn.Module):
    """MoE with the router on every rank and experts lo .. lo + E/p - 1 on this rank of ep_comm.

    forward(x) -> (y, aux): x (n, D), this rank's tokens (its group; n may differ by rank);
    y (n, D); aux this group's auxiliary loss. Collective on ep_comm: three all-to-alls forward,
    two backward; every rank calls it the same number of times, and x requires grad on every
    rank or on none (autograd skips the dispatch's backward all-to-all where it does not).
    Built from the same seed as MoE, expert e here is MoE's expert e."""

    def __init__(
        self,
        d: int,
        d_ff: int,
        n_experts: int,
        ep_comm,
        k: int = 1,
        capacity_factor: float | None = 1.25,
        alpha: float = SWITCH_ALPHA,
        seed: int = 0,
        dtype=torch.float64,
    ):
        super().__init__()
        p = ep_comm.world_size
        if n_experts % p:
            raise ValueError(f"n_experts={n_experts} is not divisible by ep={p}")
        self.comm, self.n_local = ep_comm, n_experts // p
        self.lo = ep_comm.rank * self.n_local  # this rank's first expert
        self.router = Router(d, n_experts, k, capacity_factor, alpha, seed, dtype)
        mine = range(self.lo, self.lo + self.n_local)
        self.experts = nn.ModuleList(Expert(d, d_ff, seed, e, dtype) for e in mine)

    def forward(self, x: torch.Tensor):
        p = self.comm.world_size
        n_local = self.n_local
        comm = self.comm
        routing = self.router(x)  # sorted by expert, so by destination rank too
        # lab 14.3 begin: exchange the counts per expert, dispatch the rows, run, send them back
        blocks = [n_local] * p
        # got[i, e]: rows rank i sends to this rank's expert lo + e (every rank sends E/p counts
        # to every rank: the receivers need them per expert, not only per rank)
        got = all_to_all(routing.counts, blocks, comm, blocks)[0].view(p, n_local)  # (p, E/p)
        send_counts = routing.counts.view(p, n_local).sum(1).tolist()
        recv_counts = got.sum(1).tolist()
        arrived = AllToAll.apply(x[routing.token], send_counts, recv_counts, comm)  # (M, D)
        out = self.run_local(arrived, got)  # (M, D)
        back = AllToAll.apply(out, recv_counts, send_counts, comm)  # (m, D), routing's order
        # lab 14.3 end
        return combine(x.shape[0], routing, back), routing.aux

    def run_local(self, arrived: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
        """This rank's experts on arrived (M, D): rank 0's rows for expert lo, lo + 1, ..., then
        rank 1's, ... (got (p, E/p) counts them); the outputs in arrival order."""
        p = got.shape[0]
        local = torch.arange(self.n_local).repeat(p)  # (p E/p,): the expert of each block
        expert = torch.repeat_interleave(local, got.reshape(-1))  # (M,)
        order = torch.argsort(expert, stable=True)  # grouped by expert, each in arrival order
        out = run_experts(self.experts, arrived[order], got.sum(0).tolist())
        return out[torch.argsort(order)]  # (M, D), back in arrival order


def sync_grads(layer: nn.Module, ep_comm, dp_comm=None) -> None:
    """Sum the gradients one step left on each rank into those of the whole batch (the loss the
    sum of every rank's loss; divide it by the number of ranks before backward for a mean).

    The router is replicated on every rank: its gradient is summed over ep_comm, then dp_comm.
    An expert lives on one rank of each ep group, and the backward all-to-all already brought
    it every token's gradient from that group: it is summed over dp_comm only, its replicas."""
    for q in layer.router.parameters():
        for comm in (ep_comm, dp_comm):
            if comm is not None:
                comm.all_reduce(_grad(q), "sum")
    if dp_comm is not None:
        for q in layer.experts.parameters():
            dp_comm.all_reduce(_grad(q), "sum")


def _grad(q: nn.Parameter) -> torch.Tensor:
    """q.grad, zeros if backward left none (every rank must reduce the same tensors)."""
    if q.grad is None:
        q.grad = torch.zeros_like(q)
    return q.grad


def step_nbytes(sent_rows: int, received_rows: int, d: int, b: int, n_local: int, p: int) -> int:
    """Bytes a rank sends in one forward and backward: 8 E/p (p-1) + 2 (m + m') D b, where m
    (sent_rows) of its kept assignments go to experts on other ranks and m' (received_rows)
    arrive from other ranks; the rows for its own experts never leave it."""
    return 8 * n_local * (p - 1) + 2 * (sent_rows + received_rows) * d * b
