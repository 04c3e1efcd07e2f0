"""Context parallelism: causal self-attention with the sequence split over a cp group; keys and
values travel around a ring while each rank merges its queries' attention block by block.

Equals: causal softmax attention over the whole sequence in one process, softmax(q k^T / sqrt(d)
+ mask) v with the (T, T) scores materialized (causal=False: without the mask): the output and
the gradients of q, k and v, on each rank its own tokens; ContextParallelSelfAttention: also its
weights' gradients, summed over cp. float64: 1e-12 relative (the log-sum-exp merge adds the
blocks' exponentials in another order than one softmax); at cp = 1 no message is sent.
Communication per attention call, per rank (cp ranks on cp_comm, n = B*H*(T/cp)*d elements in
each of this rank's q, k, v; b bytes each), point to point, to the next rank on the ring only:
  forward   cp-1 messages of k|v (2n elements):               2 (cp-1) n b
  backward  cp-1 of k|v again, cp of dk|dv (2n elements each): 2 (2cp-1) n b   (none at cp = 1)
  Every k|v message is started before the block before it is computed, so the two overlap.
  ContextParallelSelfAttention: + one all-reduce of its 4D^2 + 4D weight gradients (sum_gradients).
Memory per rank: saved for backward q, k, v, out (B, H, T/cp, d) and the log-sum-exp (B, H, T/cp):
(4d + 1) B H T/cp elements, 1/cp of the same algorithm in one process (the (T, T) scores are never
kept). In flight in forward (inflight_nbytes, measured by memory.LiveTensorMeter): two k|v
blocks, the one in use and the one arriving (4n elements; one, 2n, at cp = 1), and three
(B, H, T/c, T/c) tensors of one chunk pair's scores for c chunks (the scores, the scores minus
their row maximum or log-sum-exp, and its exponential): 3 B H (T/c)^2 elements.
Causal work per rank, in query-key pairs (c chunks of m = T/c tokens; a chunk against an earlier
one m^2 pairs, against itself m(m+1)/2):
  plain  (c = cp, rank r holds chunk r):            r m^2 + m(m+1)/2; the last rank does
         ((cp-1) m^2 + m(m+1)/2) / (m(T+1)/2) of the mean, 2 - 1/cp as m grows
  zigzag (c = 2cp, rank r holds chunks r, 2cp-1-r): (2cp-1) m^2 + m(m+1), every rank the same
Ladder: merge (two partial attentions of the same queries, by their log-sum-exps) -> ring_plan
(which chunk pairs each step computes: data) -> RingAttention.forward (k|v around the ring, an
online softmax) -> RingAttention.backward (k|v around again, dk|dv travelling with them) -> the
zigzag layout (the causal mask's work spread evenly) -> ContextParallelSelfAttention (the
projections, weights replicated over cp, their gradients summed).
Paper: Liu, Zaharia and Abbeel, Ring Attention with Blockwise Transformers for Near-Infinite
Context (2023), section 3; Dao, FlashAttention-2 (2023), algorithms 1 and 2 (the online softmax,
and the backward recomputing the probabilities from the log-sum-exp); Llama Team, The Llama 3
Herd of Models (2024), section 3.3.2 (rank i holds chunks i and 2cp-1-i).
Lesson: lessons/15_context_parallel/.   Run: minidist run -n 4 lessons/15_context_parallel/demo.py

Usage (q, k, v: this rank's tokens, as shard_sequence cuts them from the whole sequence):

    out = ring_attention(q, k, v, cp_comm, layout="zigzag")    # (B, H, T/cp, d)

Every rank of cp_comm must call it with the same shapes and layout (messages match by order):
a block of another size is a CommError naming both sides, another layout a CommTimeout naming
the tag.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

LAYOUTS = ("plain", "zigzag")
# (k|v, dk|dv) message tags. Both kinds come from the previous rank: tags tell them apart. A
# rank called with another layout than its neighbours waits on other tags and times out naming
# them, instead of merging blocks it misreads.
TAGS = {"plain": (0, 1), "zigzag": (2, 3)}


# ---- the layout and the plan: pure data ---------------------------------------------------------


def chunks_of(cp: int, rank: int, layout: str) -> list[int]:
    """The chunks of the sequence rank holds, in order: plain [rank] of cp chunks; zigzag
    [rank, 2cp-1-rank] of 2cp chunks (an early one and a late one: the same causal work)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    return [rank] if layout == "plain" else [rank, 2 * cp - 1 - rank]


def chunk_size(t: int, cp: int, layout: str) -> int:
    """Tokens per chunk, or ValueError naming the numbers (a remainder is never dropped)."""
    n_chunks = cp * len(chunks_of(cp, 0, layout))
    if t % n_chunks != 0:
        by = f"2*cp={n_chunks} (zigzag: two chunks per rank)" if layout == "zigzag" else f"cp={cp}"
        raise ValueError(f"sequence length T={t} is not divisible by {by}")
    return t // n_chunks


def shard_sequence(x: torch.Tensor, cp_comm, layout: str = "zigzag", dim: int = 2):
    """This rank's tokens of the whole sequence x, its chunks concatenated along dim:
    (.., T, ..) -> (.., T/cp, ..), a new tensor."""
    cp, rank = cp_comm.world_size, cp_comm.rank
    m = chunk_size(x.shape[dim], cp, layout)
    parts = [x.narrow(dim, i * m, m) for i in chunks_of(cp, rank, layout)]
    return torch.cat(parts, dim)


def ring_plan(
    cp: int, rank: int, layout: str, causal: bool = True
) -> list[list[tuple[int, int, bool]]]:
    """For each ring step s (rank holds the k|v of rank (rank - s) mod cp): the pairs
    (query slot, key slot, diagonal) it computes; slot i is the i-th chunk a rank holds.
    A query chunk sees a key chunk that comes before it wholly, itself under the causal mask,
    and a later one not at all (skipped: the work the mask saves). causal=False: every pair,
    wholly (diagonal False: nothing masked)."""
    mine = chunks_of(cp, rank, layout)
    plan = []
    for step in range(cp):
        theirs = chunks_of(cp, (rank - step) % cp, layout)
        pairs = [(a, b, qa == kb) for a, qa in enumerate(mine) for b, kb in enumerate(theirs)]
        if not causal:
            plan.append([(a, b, False) for a, b, _ in pairs])
            continue
        plan.append([(a, b, diagonal) for a, b, diagonal in pairs if mine[a] >= theirs[b]])
    return plan


def causal_pairs(t: int, cp: int, rank: int, layout: str) -> int:
    """The query-key pairs rank computes in one forward: its share of the causal work."""
    m = chunk_size(t, cp, layout)
    return sum(_work(pairs, m) for pairs in ring_plan(cp, rank, layout))


def inflight_nbytes(b: int, h: int, t: int, d: int, cp: int, layout: str, itemsize: int) -> dict:
    """{"kv": bytes of k|v blocks, "scores": bytes of score-sized tensors} a rank holds at once
    in forward, at most (the module docstring's formula): kv 4n b (2n b at cp = 1), n =
    B H (T/cp) d; scores 3 B H m^2 b, m = T/c the tokens of a chunk."""
    m = chunk_size(t, cp, layout)
    n = b * h * (t // cp) * d
    return {"kv": (4 if cp > 1 else 2) * n * itemsize, "scores": 3 * b * h * m * m * itemsize}


# ---- one block, and the merge -------------------------------------------------------------------


def scores(q: torch.Tensor, k: torch.Tensor, diagonal: bool, scale: float) -> torch.Tensor:
    """q k^T * scale, on a diagonal block the future at -inf: (B, H, m, d) -> (B, H, m, m)."""
    s = q @ k.transpose(-2, -1) * scale  # (B, H, m, m)
    if diagonal:  # query i of the chunk sees keys 0..i of the same chunk
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, -math.inf)
    return s


def attend_block(q, k, v, diagonal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): q's attention to this block of keys alone, and the log-sum-exp of its scores:
    q (B, H, m, d), k, v (B, H, m, d) -> out (B, H, m, d), lse (B, H, m)."""
    s = scores(q, k, diagonal, scale)
    lse = torch.logsumexp(s, -1)  # (B, H, m); finite: every query sees at least one key
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def merge(out, lse, out_block, lse_block) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of the same queries to two disjoint sets of keys, from each one's:
    out = softmax-weighted mix of the two, lse = log(exp(lse) + exp(lse_block)).

    out, out_block: (B, H, m, d); lse, lse_block: (B, H, m). lse = -inf (no keys yet) is allowed
    on one side: that side gets weight 0."""
    # lab 15.1 begin: the new log-sum-exp, then each side weighted by exp(its lse - the new one)
    new = torch.logaddexp(lse, lse_block)  # (B, H, m): log of the two normalizers' sum
    weight, weight_block = torch.exp(lse - new), torch.exp(lse_block - new)  # sum to 1
    mixed = out * weight.unsqueeze(-1) + out_block * weight_block.unsqueeze(-1)  # (B, H, m, d)
    return mixed, new
    # lab 15.1 end


def block_grads(q, k, v, grad_out, lse, delta, diagonal: bool, scale: float):
    """(dq, dk, dv) of one block, its probabilities recomputed from the final log-sum-exp
    (FlashAttention-2, algorithm 2): q, k, v, grad_out (B, H, m, d); lse, delta (B, H, m),
    delta = rowsum(grad_out * out). dS = P * (dP - delta) is the softmax's backward."""
    # lab 15.3 begin: P from the saved lse, then dv, dP, dS, and dq, dk from dS
    p = torch.exp(scores(q, k, diagonal, scale) - lse.unsqueeze(-1))  # (B, H, m, m); masked: 0
    grad_v = p.transpose(-2, -1) @ grad_out  # (B, H, m, d)
    grad_p = grad_out @ v.transpose(-2, -1)  # (B, H, m, m)
    grad_s = p * (grad_p - delta.unsqueeze(-1)) * scale
    return grad_s @ k, grad_s.transpose(-2, -1) @ q, grad_v
    # lab 15.3 end


# ---- the ring -----------------------------------------------------------------------------------


def pass_on(t: torch.Tensor, comm, tag: int) -> tuple[torch.Tensor, list]:
    """Start sending t to the next rank and receiving the previous rank's into a new buffer;
    (the buffer, the handles to wait on). t is only read until the handles are waited on."""
    cp, rank = comm.world_size, comm.rank
    arriving = torch.empty_like(t)
    works = [comm.irecv(arriving, (rank - 1) % cp, tag), comm.isend(t, (rank + 1) % cp, tag)]
    return arriving, works


def wait_all(works: list) -> None:
    """Wait for every handle (a receive's buffer is filled when its wait returns)."""
    for work in works:
        work.wait()


def _rows(t: torch.Tensor, slot: int, m: int) -> torch.Tensor:
    """Slot `slot`'s m tokens of a (.., T/cp, ..) tensor whose dim 2 holds the slots in order."""
    return t[:, :, slot * m : (slot + 1) * m]


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries to the whole sequence, k|v passed around the ring
    (causal=False: unmasked, every query to every key).

    q, k, v: (B, H, T/cp, d), this rank's chunks in order (shard_sequence) -> out (B, H, T/cp, d).
    Forward: cp steps; at step s this rank holds rank (rank - s)'s k|v, sends it on while it
    computes the pairs ring_plan names, and merges them into its running (out, lse). Saves
    q, k, v, out, lse. Backward: k|v go around again; each rank adds its dk|dv for the block it
    holds to the sum that travels with that block, which comes home after cp hops."""

    @staticmethod
    def forward(ctx, q, k, v, comm, layout: str, stats, causal: bool):
        cp = comm.world_size
        plan = ring_plan(cp, comm.rank, layout, causal)
        m = q.shape[2] // len(chunks_of(cp, 0, layout))
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros_like(q)  # (B, H, T/cp, d)
        lse = torch.full(q.shape[:3], -math.inf, dtype=q.dtype, device=q.device)  # (B, H, T/cp)
        kv, kv_tag = torch.stack([k, v]), TAGS[layout][0]  # (2, B, H, T/cp, d): one message a step
        # lab 15.2 begin: each step of plan: pass kv on (not after the last), merge the pairs, wait
        for step, pairs in enumerate(plan):
            if step < cp - 1:  # started first: the transfer overlaps this step's compute
                kv_next, works = pass_on(kv, comm, kv_tag)
            started = time.perf_counter()
            for a, b, diagonal in pairs:
                # kv's rows go unnamed: a name would keep this block alive into the next step
                block = attend_block(
                    _rows(q, a, m), _rows(kv[0], b, m), _rows(kv[1], b, m), diagonal, scale
                )
                out_a, lse_a = merge(_rows(out, a, m), _rows(lse, a, m), *block)
                _rows(out, a, m).copy_(out_a)
                _rows(lse, a, m).copy_(lse_a)
            _record(stats, pairs, m, started)
            if step < cp - 1:
                wait_all(works)
                kv, works = kv_next, []  # a send's handle may hold the old block: drop both
        # lab 15.2 end
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm = comm
        ctx.plan = plan
        ctx.m = m
        ctx.scale = scale
        ctx.stats = stats
        ctx.tags = TAGS[layout]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, cp = ctx.comm, ctx.comm.world_size
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1)  # (B, H, T/cp): rowsum(dO * O)
        grad_q = torch.zeros_like(q)
        kv = torch.stack([k, v])  # (2, B, H, T/cp, d)
        grad_in, grad_works = None, []
        for step, pairs in enumerate(ctx.plan):
            if step < cp - 1:
                kv_next, works = pass_on(kv, comm, ctx.tags[0])
            started = time.perf_counter()
            grad_kv = _step_grads(ctx, pairs, q, kv, grad_out, lse, delta, grad_q)
            _record(ctx.stats, pairs, ctx.m, started)
            if step > 0:  # the sum this block's earlier holders built: needed only now
                wait_all(grad_works)
                grad_kv += grad_in
            if cp > 1:  # on to the block's next holder; after the last step, home
                grad_in, grad_works = pass_on(grad_kv, comm, ctx.tags[1])
            if step < cp - 1:
                wait_all(works)
                kv = kv_next
        if cp > 1:
            wait_all(grad_works)
            grad_kv = grad_in  # this rank's own block: every rank's part summed
        return grad_q, grad_kv[0], grad_kv[1], None, None, None, None


def _step_grads(ctx, pairs, q, kv, grad_out, lse, delta, grad_q) -> torch.Tensor:
    """One backward ring step: add the pairs' dq into grad_q, return this rank's dk|dv of the
    k|v block it holds: (2, B, H, T/cp, d)."""
    m, scale = ctx.m, ctx.scale
    grad_kv = torch.zeros_like(kv)
    for a, b, diagonal in pairs:
        q_a, grad_out_a = _rows(q, a, m), _rows(grad_out, a, m)
        k_b, v_b = _rows(kv[0], b, m), _rows(kv[1], b, m)
        lse_a, delta_a = _rows(lse, a, m), _rows(delta, a, m)
        dq, dk, dv = block_grads(q_a, k_b, v_b, grad_out_a, lse_a, delta_a, diagonal, scale)
        _rows(grad_q, a, m).add_(dq)
        _rows(grad_kv[0], b, m).add_(dk)
        _rows(grad_kv[1], b, m).add_(dv)
    return grad_kv


def _work(pairs, m: int) -> int:
    """Query-key pairs in a list of chunk pairs of m tokens: m^2 each, m(m+1)/2 on the diagonal."""
    return sum(m * (m + 1) // 2 if diagonal else m * m for _, _, diagonal in pairs)


def _record(stats: dict | None, pairs, m: int, started: float) -> None:
    """Add the pairs' query-key count and the seconds since started to stats (a measurement)."""
    if stats is not None:
        stats["pairs"] = stats.get("pairs", 0) + _work(pairs, m)
        stats["seconds"] = stats.get("seconds", 0.0) + time.perf_counter() - started


def ring_attention(
    q, k, v, cp_comm, layout: str = "zigzag", stats: dict | None = None, causal: bool = True
):
    """Causal softmax attention of the whole sequence, split over cp_comm (see RingAttention);
    causal=False: no mask (every query attends to every key).

    q, k, v: (B, H, T/cp, d), this rank's tokens (shard_sequence) -> (B, H, T/cp, d).
    stats, if given, gains "pairs" (query-key pairs computed, forward and backward) and
    "seconds" (time spent computing them): the causal mask's load per rank, measured."""
    if not (q.shape == k.shape == v.shape) or q.dim() != 4:
        shapes = [tuple(t.shape) for t in (q, k, v)]
        raise ValueError(f"q, k, v must share one (B, H, T/cp, d) shape, got {shapes}")
    cp, n = cp_comm.world_size, q.shape[2]
    try:
        chunk_size(n * cp, cp, layout)
    except ValueError as e:
        raise ValueError(f"q, k, v hold {n} tokens per rank: {e}") from None
    return RingAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), cp_comm, layout, stats, causal
    )


# ---- a layer: projections around the ring ------------------------------------------------------


class ContextParallelSelfAttention(nn.Module):
    """Multi-head causal self-attention on this rank's tokens, x_local (B, T/cp, D) ->
    (B, T/cp, D): the q|k|v projection, ring_attention over cp_comm, the output projection.

    The weights are whole on every rank, which applies them to its own tokens only: after
    backward, sum_gradients(layer, cp_comm) adds every rank's part (one all-reduce of each
    gradient over cp, as data parallelism does over dp). Weights drawn as nn.Linear draws them,
    U(-1/sqrt(D), 1/sqrt(D)), from torch.Generator(seed): the same on every rank."""

    def __init__(
        self, d_model: int, n_heads: int, cp_comm, layout: str = "zigzag", seed: int = 0, dtype=None
    ):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.cp_comm = cp_comm
        self.layout = layout
        self.qkv = nn.Linear(d_model, 3 * d_model, dtype=dtype)
        self.proj = nn.Linear(d_model, d_model, dtype=dtype)
        gen, bound = torch.Generator().manual_seed(seed), 1.0 / math.sqrt(d_model)
        with torch.no_grad():  # not the global generator: thread-ranks would race for it
            for t in (self.qkv.weight, self.qkv.bias, self.proj.weight, self.proj.bias):
                t.uniform_(-bound, bound, generator=gen)

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        b, n, d = x_local.shape
        qkv = self.qkv(x_local).view(b, n, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, T/cp, D/H)
        y = ring_attention(q, k, v, self.cp_comm, self.layout)  # (B, H, T/cp, D/H)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))  # (B, T/cp, D)


def sum_gradients(module: nn.Module, cp_comm) -> None:
    """Sum each parameter's gradient over cp_comm, in place (each rank saw its tokens only)."""
    for param in module.parameters():
        if param.grad is not None:
            cp_comm.all_reduce(param.grad, "sum")
