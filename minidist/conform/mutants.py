"""Mutants: minidist's adapter (ours.py) with one classic bug planted, to show the kit judges
well. Every one must fail at least one check of its capability; the share that does is the
mutation score, printed with the seconds each took:

    .venv/bin/python -m minidist.conform.mutants            # every mutant, on threads
    minidist conform minidist.conform.mutants:avg_as_sum     # one of them, as any adapter

Each mutant is an object holding ours.py's functions with one replaced (the adapter interface
accepts `module:name`); MUTANTS says which capability it belongs to and what the bug is.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from minidist.collectives import algorithms as C
from minidist.comm.protocol import reduce_
from minidist.conform import ours
from minidist.conform.registry import CAPABILITIES
from minidist.conform.runner import run_threads
from minidist.context_parallel import ring_attention as ring
from minidist.data_parallel.wrappers import DataParallelBucketed
from minidist.expert_parallel.moe import AllToAll, ExpertParallelMoE, combine, run_experts
from minidist.memory import storage_nbytes
from minidist.pipeline.schedules import build_schedules
from minidist.pipeline.stage import PipelineStage
from minidist.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from minidist.tensor_parallel.mappings import GatherFromRegion, ScatterToRegion, f, g
from minidist.zero.stages import ZeRO1, ZeRO2, ZeRO3
from minidist.zero.state import make_optimizer


def _like_ours(**changes) -> SimpleNamespace:
    """ours.py's adapter with `changes` in place of its functions."""
    public = {k: v for k, v in vars(ours).items() if not k.startswith("_")}
    return SimpleNamespace(**(public | changes))


# ---- collectives -------------------------------------------------------------------------------


def _avg_as_sum(comm, tensor, op):
    return C.ring_all_reduce(tensor, comm, "sum" if op == "avg" else op)  # bug: never divides


def _remainder_dropped(comm, tensor, op):
    n = tensor.numel() // comm.world_size * comm.world_size  # bug: x.split(N // p)[:p]
    C.ring_all_reduce(tensor.reshape(-1)[:n], comm, op)
    return tensor


def _blocking_ring(comm, tensor, op):
    """A ring all-reduce of whole tensors (p-1 steps) in which every rank sends before it
    receives, with blocking sends: with rendezvous sends every rank waits for its neighbour."""
    p, r = comm.world_size, comm.rank
    acc = tensor.clone()
    passing = tensor.clone()
    got = torch.empty_like(tensor)
    for _ in range(p - 1):
        comm.send(passing, (r + 1) % p)  # bug: everyone sends first
        comm.recv(got, (r - 1) % p)
        reduce_(acc, got, "sum" if op == "avg" else op)
        passing.copy_(got)
    return acc / p if op == "avg" else acc


def _wrong_chunk(comm, tensor, op):
    p, r = comm.world_size, comm.rank
    buf = tensor.detach().clone().reshape(-1)
    C.ring_reduce_scatter_flat(buf, comm, op)
    lo, hi = C.chunk_bounds(buf.numel(), p)[(r + 1) % p]  # bug: the neighbour's, half reduced
    return buf[lo:hi] / p if op == "avg" else buf[lo:hi]


def _reversed_gather(comm, chunk, shape):
    p = comm.world_size
    flat = C.ring_all_gather(chunk.new_empty(shape), chunk, comm).reshape(-1)
    pieces = [flat[lo:hi] for lo, hi in C.chunk_bounds(flat.numel(), p)]
    return torch.cat(pieces[::-1]).reshape(shape)  # bug: rank p-1's chunk first


def _counts_transposed(comm, x, send_counts, recv_counts):
    y, _ = C.all_to_all(x, send_counts, comm, send_counts)  # bug: receives what it sends
    return y


def _broadcast_from_0(comm, tensor, src):
    return C.broadcast(tensor, comm, 0)  # bug: src ignored


# ---- data parallelism --------------------------------------------------------------------------


def _dp_summed(model):
    model.finish_gradient_sync()
    for q in model.module.parameters():
        if q.grad is not None:
            q.grad.mul_(model.comm.world_size)  # bug: the sum, not the average


def _dp_no_broadcast(comm, module):
    own = {k: v.clone() for k, v in module.state_dict().items()}
    model = ours.data_parallel(comm, module)
    module.load_state_dict(own)  # bug: as if the broadcast at wrap time never happened
    return model


def _dp_zero_for_unused(model):
    model.finish_gradient_sync()
    for q in model.module.parameters():
        if q.requires_grad and q.grad is None:
            q.grad = torch.zeros_like(q)  # bug: one process leaves it None


def _dp_no_sync_syncs(model):
    return contextlib.nullcontext()  # bug: backward inside still communicates


def _dp_last_bucket_dropped(comm, module, bucket_bytes):
    model = ours.data_parallel_buckets(comm, module, bucket_bytes)
    if len(model.buckets) > 1:
        model.buckets = model.buckets[:-1]  # bug: the last, partial bucket is never reduced
    return model


# ---- tensor parallelism ------------------------------------------------------------------------


class _RowBiasEveryRank(RowParallelLinear):
    def forward(self, x):
        if not self.input_is_parallel:
            x = ScatterToRegion.apply(x, self.tp_comm, -1)  # (.., I/p)
        return g(F.linear(x, self.weight, self.bias), self.tp_comm)  # bug: bias summed p times


class _ColumnWithoutF(ColumnParallelLinear):
    def forward(self, x):
        y_local = F.linear(x, self.weight, self.bias)  # bug: no f, dL/dx is this rank's part
        if self.gather_output:
            return GatherFromRegion.apply(y_local, self.tp_comm, -1)
        return y_local


class _ColumnGatherReversed(ColumnParallelLinear):
    def forward(self, x):
        y_local = F.linear(f(x, self.tp_comm), self.weight, self.bias)  # (.., O/p)
        if not self.gather_output:
            return y_local
        y = GatherFromRegion.apply(y_local, self.tp_comm, -1)  # (.., O)
        return torch.cat(y.chunk(self.tp_comm.world_size, -1)[::-1], -1)  # bug: order reversed


def _row_with(cls):
    def row_parallel_linear(comm, linear, input_is_parallel):
        return cls.from_full(linear, comm, input_is_parallel=input_is_parallel)

    return row_parallel_linear


def _column_with(cls):
    def column_parallel_linear(comm, linear, gather_output):
        return cls.from_full(linear, comm, gather_output=gather_output)

    return column_parallel_linear


# ---- pipeline parallelism ----------------------------------------------------------------------


def _pp_warmup_plus_one(kind, n_stages, n_microbatches):
    if kind != "1f1b":
        return ours.pipeline_schedule(kind, n_stages, n_microbatches)
    m = n_microbatches
    programs = []
    for s in range(n_stages):
        warmup = min(n_stages - s, m)  # bug: p - s forwards, not p - s - 1
        ops = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [("F", warmup + i), ("B", i)]
        programs.append(ops + [("B", i) for i in range(m - warmup, m)])
    return programs


def _pp_gpipe_backward_reversed(kind, n_stages, n_microbatches):
    programs = ours.pipeline_schedule(kind, n_stages, n_microbatches)
    if kind != "gpipe":
        return programs
    m = n_microbatches
    # bug: odd stages run their backwards last microbatch first, their neighbours first first
    return [ops[:m] + ops[m:][::-1] if s % 2 else ops for s, ops in enumerate(programs)]


def _pp_grads_summed(comm, kind, stage, n_microbatches, inputs, targets, loss_fn):
    losses = ours.pipeline_step(comm, kind, stage, n_microbatches, inputs, targets, loss_fn)
    for q in stage.parameters():
        if q.grad is not None:
            q.grad.mul_(n_microbatches)  # bug: the sum over the microbatches, not their mean
    return losses


class _StashAsStack(PipelineStage):
    def backward(self, op):
        stash = self.step.stash
        mine = (op.microbatch, op.chunk)
        newest = next(reversed(stash))
        stash[mine], stash[newest] = stash[newest], stash[mine]  # bug: the newest saved, a stack
        super().backward(op)


def _pp_stash_as_stack(comm, kind, stage, n_microbatches, inputs, targets, loss_fn):
    program = build_schedules(kind, comm.world_size, n_microbatches)[comm.rank]
    return _StashAsStack(stage, comm, loss_fn).run(program, inputs, targets)


# ---- expert parallelism ------------------------------------------------------------------------


class _MoEBackCountsTransposed(ExpertParallelMoE):
    def forward(self, x):
        p = self.comm.world_size
        routing = self.router(x)
        blocks = [self.n_local] * p
        got = C.all_to_all(routing.counts, blocks, self.comm, blocks)[0].view(p, self.n_local)
        send_counts = routing.counts.view(p, self.n_local).sum(1).tolist()
        recv_counts = got.sum(1).tolist()
        arrived = AllToAll.apply(x[routing.token], send_counts, recv_counts, self.comm)
        out = self.run_local(arrived, got)  # (M, D)
        back = AllToAll.apply(out, send_counts, recv_counts, self.comm)  # bug: the counts of
        return combine(x.shape[0], routing, back), routing.aux  # the way out, not reversed


class _MoEGateNotApplied(ExpertParallelMoE):
    def forward(self, x):
        p = self.comm.world_size
        routing = self.router(x)
        blocks = [self.n_local] * p
        got = C.all_to_all(routing.counts, blocks, self.comm, blocks)[0].view(p, self.n_local)
        send_counts = routing.counts.view(p, self.n_local).sum(1).tolist()
        recv_counts = got.sum(1).tolist()
        arrived = AllToAll.apply(x[routing.token], send_counts, recv_counts, self.comm)
        out = self.run_local(arrived, got)  # (M, D)
        back = AllToAll.apply(out, recv_counts, send_counts, self.comm)  # (m, D)
        y = x.new_zeros(x.shape).index_add(0, routing.token, back)  # bug: no gate weights
        return y, routing.aux


class _MoEArrivalOrderLost(ExpertParallelMoE):
    def run_local(self, arrived, got):
        p = got.shape[0]
        local = torch.arange(self.n_local).repeat(p)  # (p E/p,)
        expert = torch.repeat_interleave(local, got.reshape(-1))  # (M,)
        order = torch.argsort(expert, stable=True)
        return run_experts(self.experts, arrived[order], got.sum(0).tolist())  # bug: sent back
        # grouped by expert, not in the order the rows arrived


def _moe_experts_summed(layer):
    ours.moe_after_backward(layer)
    for q in layer.experts.parameters():  # bug: an expert is not replicated over the ep group
        layer.layer.comm.all_reduce(q.grad, "sum")


def _moe_with(cls):
    def expert_parallel_moe(comm, router, experts, k, capacity_factor):
        return ours._moe_from_full(cls, comm, router, experts, k, capacity_factor)

    return expert_parallel_moe


# ---- ZeRO --------------------------------------------------------------------------------------


class _ZeRO2LocalGradient(ZeRO2):
    def _launch(self, unit):
        r = self.comm.rank
        S = unit.plan.shard_numel
        flat = unit.flat.new_zeros(unit.flat.shape)  # (p S,)
        for i, (q, off) in enumerate(zip(unit.params, unit.plan.offsets, strict=True)):
            unit.used[i] = float(q.grad is not None)
            if q.grad is not None:
                flat[off : off + q.numel()].copy_(q.grad.reshape(-1))
                q.grad = None
        # bug: no reduce-scatter: this rank's own gradient, scaled as if it were the sum
        unit.recv = flat[r * S : (r + 1) * S] * self.comm.world_size  # (S,)
        unit.work = SimpleNamespace(wait=lambda: None)


class _ZeRO1ShiftedShard(ZeRO1):
    def __init__(self, module, comm, optimizer, optimizer_kwargs=None, **options):
        super().__init__(module, comm, optimizer, optimizer_kwargs, **options)
        k = (comm.rank + 1) % comm.world_size
        for u in self.units:
            S = u.plan.shard_numel
            u.shard = u.stepped = u.flat[k * S : (k + 1) * S]  # bug: the neighbour's elements
            u.tensors = [u.stepped[c.at : c.at + c.hi - c.lo] for c in u.pieces]
        self.optimizer, self.group_of = make_optimizer(
            module, self.units, optimizer, optimizer_kwargs, None
        )


class _ZeRO1NoGather(ZeRO1):
    def publish(self):
        pass  # bug: the updated shards are never all-gathered: each rank has its own new


class _ZeRO3KeptWhole(ZeRO3):
    def _on_grad(self, param):
        ZeRO2._on_grad(self, param)  # bug: a unit whose gradients are all in is not freed


class _ZeRO1Unsharded(torch.nn.Module):
    """A ZeRO-1 that shards nothing: the gradients all-reduced, then AdamW over every parameter
    on every rank. Right parameters; p times the optimizer state."""

    def __init__(self, module, comm, kwargs):
        super().__init__()
        self.module = module
        self.dp = DataParallelBucketed(module, comm, bucket_bytes=64, algorithm="ring")
        self.optimizer = torch.optim.AdamW(module.parameters(), **kwargs)  # bug: all of it
        self.synced = False

    def forward(self, x):
        self.synced = False
        return self.dp(x)

    def finish_gradient_sync(self):
        if not self.synced:
            self.dp.finish_gradient_sync()
            self.synced = True

    def step(self):
        self.finish_gradient_sync()
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def gathered(self):
        return contextlib.nullcontext()

    def shard_pieces(self):
        return [(n, 0, q.numel(), q) for n, q in self.module.named_parameters()]


def _zero_with(stages: dict):
    """ours.zero, with the classes of `stages` ({stage: class}) in place of minidist's."""

    def zero(comm, module, stage, lr, betas, eps, weight_decay):
        if stage not in stages:
            return ours.zero(comm, module, stage, lr, betas, eps, weight_decay)
        kwargs = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        options = {"bucket_bytes": 64} if stage == 2 else {}
        return stages[stage](module, comm, torch.optim.AdamW, kwargs, algorithm="ring", **options)

    return zero


def _unsharded(comm, module, stage, lr, betas, eps, weight_decay):
    kwargs = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    return _ZeRO1Unsharded(module, comm, kwargs)


def _unsharded_memory(model):
    state = [v for s in model.optimizer.state.values() for v in s.values() if v.dim() > 0]
    return {
        "params": storage_nbytes(list(model.module.parameters())),
        "grads": storage_nbytes([q.grad for q in model.module.parameters()]),
        "optimizer": storage_nbytes(state),
    }


# ---- context parallelism -----------------------------------------------------------------------


def _ring_module_with(**changes):
    """A fresh copy of minidist's ring_attention module with `changes` among its globals: its
    RingAttention calls them in place of the originals (the original module is untouched)."""
    spec = importlib.util.find_spec("minidist.context_parallel.ring_attention")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    vars(module).update(changes)
    return module


def _plan_local_mask(cp, rank, layout, causal=True):
    pairs = ring.ring_plan(cp, rank, layout, causal=False)  # every pair of chunks
    return [[(a, b, causal) for a, b, _ in step] for step in pairs]  # bug: each block masked
    # by its tokens' local positions, as if every block were on the diagonal


def _merge_not_rescaled(out, lse, out_block, lse_block):
    new = torch.logaddexp(lse, lse_block)  # (B, H, m)
    weight_block = torch.exp(lse_block - new)
    return out + out_block * weight_block.unsqueeze(-1), new  # bug: out kept at its old scale


def _pass_backwards(t, comm, tag):
    cp, rank = comm.world_size, comm.rank
    arriving = torch.empty_like(t)
    works = [comm.irecv(arriving, (rank + 1) % cp, tag), comm.isend(t, (rank - 1) % cp, tag)]
    return arriving, works  # bug: to rank-1, so a rank holds rank+s's block, not rank-s's


def _ring_with(**changes):
    module = _ring_module_with(**changes)

    def ring_attention(comm, q, k, v, causal):
        return module.ring_attention(q, k, v, comm, "plain", causal=causal)

    return ring_attention


# name: (capability, the bug in words, the adapter)
MUTANTS = {
    "avg_as_sum": (
        "collectives",
        "all-reduce avg returns the sum",
        _like_ours(all_reduce=_avg_as_sum),
    ),
    "remainder_dropped": (
        "collectives",
        "all-reduce reduces p*(N//p) elements; the remainder stays local",
        _like_ours(all_reduce=_remainder_dropped),
    ),
    "blocking_ring": (
        "collectives",
        "ring all-reduce in which every rank sends before receiving (blocking)",
        _like_ours(all_reduce=_blocking_ring),
    ),
    "reduce_scatter_wrong_chunk": (
        "collectives",
        "reduce-scatter keeps chunk r+1, only partly reduced",
        _like_ours(reduce_scatter=_wrong_chunk),
    ),
    "all_gather_reversed": (
        "collectives",
        "all-gather puts the chunks in reverse rank order",
        _like_ours(all_gather=_reversed_gather),
    ),
    "all_to_all_counts_transposed": (
        "collectives",
        "all-to-all receives send_counts[i] rows from rank i (the count matrix transposed)",
        _like_ours(all_to_all=_counts_transposed),
    ),
    "broadcast_from_0": (
        "collectives",
        "broadcast always from rank 0",
        _like_ours(broadcast=_broadcast_from_0),
    ),
    "dp_sum_not_average": (
        "dp",
        "gradients summed over ranks, not averaged",
        _like_ours(dp_after_backward=_dp_summed),
    ),
    "dp_no_broadcast_at_wrap": (
        "dp",
        "no broadcast of rank 0's parameters at wrap time",
        _like_ours(data_parallel=_dp_no_broadcast),
    ),
    "dp_unused_zero_grad": (
        "dp",
        "a parameter no rank used gets a zero gradient (one process: None)",
        _like_ours(dp_after_backward=_dp_zero_for_unused),
    ),
    "dp_no_sync_still_syncs": (
        "dp",
        "no_sync does not stop the gradient hooks",
        _like_ours(dp_no_sync=_dp_no_sync_syncs),
    ),
    "dp_last_bucket_dropped": (
        "dp",
        "the last, partial bucket is never reduced (its gradients stay this rank's own)",
        _like_ours(data_parallel_buckets=_dp_last_bucket_dropped),
    ),
    "tp_row_bias_every_rank": (
        "tp",
        "row-parallel bias added on every rank before the all-reduce",
        _like_ours(row_parallel_linear=_row_with(_RowBiasEveryRank)),
    ),
    "tp_column_without_f": (
        "tp",
        "column-parallel input gradient not summed over ranks (no f)",
        _like_ours(column_parallel_linear=_column_with(_ColumnWithoutF)),
    ),
    "tp_gather_output_reversed": (
        "tp",
        "column-parallel gather_output in reverse rank order",
        _like_ours(column_parallel_linear=_column_with(_ColumnGatherReversed)),
    ),
    "pp_1f1b_warmup_plus_one": (
        "pp",
        "1F1B's warm-up is p - s forwards, not p - s - 1",
        _like_ours(pipeline_schedule=_pp_warmup_plus_one),
    ),
    "pp_gpipe_backward_reversed": (
        "pp",
        "GPipe's odd stages run their backwards in reverse microbatch order",
        _like_ours(pipeline_schedule=_pp_gpipe_backward_reversed),
    ),
    "pp_grads_summed": (
        "pp",
        "gradients summed over the microbatches, not averaged (the loss not divided by m)",
        _like_ours(pipeline_step=_pp_grads_summed),
    ),
    "pp_stash_as_stack": (
        "pp",
        "backward takes the newest saved activation (a stack), not its own microbatch's",
        _like_ours(pipeline_step=_pp_stash_as_stack),
    ),
    "moe_back_counts_transposed": (
        "moe",
        "the combine's all-to-all sends with the dispatch's counts (not swapped)",
        _like_ours(expert_parallel_moe=_moe_with(_MoEBackCountsTransposed)),
    ),
    "moe_gate_not_applied": (
        "moe",
        "the combine sums the experts' outputs without the gate weights",
        _like_ours(expert_parallel_moe=_moe_with(_MoEGateNotApplied)),
    ),
    "moe_arrival_order_lost": (
        "moe",
        "outputs sent back grouped by expert, not in the order their rows arrived",
        _like_ours(expert_parallel_moe=_moe_with(_MoEArrivalOrderLost)),
    ),
    "moe_experts_summed_over_ep": (
        "moe",
        "each expert's gradient all-reduced over the ep group, as the router's",
        _like_ours(moe_after_backward=_moe_experts_summed),
    ),
    "cp_causal_mask_local": (
        "cp",
        "the causal mask applied on each block's local positions, not the global ones",
        _like_ours(ring_attention=_ring_with(ring_plan=_plan_local_mask)),
    ),
    "cp_merge_not_rescaled": (
        "cp",
        "the running output not rescaled by exp(lse - new lse) when a block is merged",
        _like_ours(ring_attention=_ring_with(merge=_merge_not_rescaled)),
    ),
    "cp_ring_backwards": (
        "cp",
        "k|v (and dk|dv) passed to rank-1, against the plan's direction",
        _like_ours(ring_attention=_ring_with(pass_on=_pass_backwards)),
    ),
    "zero2_gradient_not_reduced": (
        "zero",
        "ZeRO-2 steps each rank's shard with its own gradient (no reduce-scatter)",
        _like_ours(zero=_zero_with({2: _ZeRO2LocalGradient})),
    ),
    "zero1_shard_offset": (
        "zero",
        "ZeRO-1 steps the elements of shard r+1 with the gradient of shard r",
        _like_ours(zero=_zero_with({1: _ZeRO1ShiftedShard})),
    ),
    "zero1_state_not_sharded": (
        "zero",
        "every rank keeps AdamW's state of every parameter (all-reduce, whole step)",
        _like_ours(zero=_unsharded, zero_memory=_unsharded_memory),
    ),
    "zero_no_all_gather": (
        "zero",
        "ZeRO-1 never all-gathers the updated shards: the ranks diverge",
        _like_ours(zero=_zero_with({1: _ZeRO1NoGather})),
    ),
    "zero3_unit_kept_whole": (
        "zero",
        "ZeRO-3 keeps a unit whole after its backward, until the step",
        _like_ours(zero=_zero_with({3: _ZeRO3KeptWhole})),
    ),
}


def __getattr__(name: str):
    """`minidist.conform.mutants:NAME`: mutant NAME's adapter (PEP 562)."""
    if name in MUTANTS:
        return MUTANTS[name][2]
    raise AttributeError(f"module {__name__!r} has no mutant {name!r}: {list(MUTANTS)}")


def judge(name: str, examples: int = 10) -> tuple[list[str], float]:
    """(the checks of its capability that fail mutant `name` on threads, seconds)."""
    capability, _, adapter = MUTANTS[name]
    start = time.monotonic()
    results = [run_threads(adapter, check, examples) for check in CAPABILITIES[capability]]
    return [r.check for r in results if r.status == "failed"], time.monotonic() - start


def main(names: list[str]) -> int:
    """Print every mutant's verdict and the mutation score; 0 if every mutant is caught."""
    names = names or list(MUTANTS)
    caught = 0
    total = 0.0
    print(f"{'mutant':30} {'capability':12} {'seconds':>7}  caught by")
    for name in names:
        failed, seconds = judge(name)
        caught += bool(failed)
        total += seconds
        shown = ", ".join(failed) if failed else "NOT CAUGHT"
        print(f"{name:30} {MUTANTS[name][0]:12} {seconds:7.2f}  {shown}")
    score = caught / len(names)
    print(
        f"mutation score {caught}/{len(names)} = {score:.0%}, {total / len(names):.2f} s a mutant"
    )
    return 0 if caught == len(names) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
