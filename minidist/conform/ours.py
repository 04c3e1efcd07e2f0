"""minidist's own adapter: the kit's checks, pointed at minidist's own code for every capability
in registry.py. Everything passes (`minidist conform minidist`), on threads, gloo and mpi;
minidist.conform.mutants plants one bug at a time in a copy of it.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.collectives import algorithms as C
from minidist.context_parallel import ring_attention as ring
from minidist.data_parallel.wrappers import DataParallelBucketed
from minidist.expert_parallel.moe import ExpertParallelMoE, sync_grads
from minidist.pipeline.schedules import COMPUTE, LETTER, build_schedules
from minidist.pipeline.stage import PipelineStage
from minidist.tensor_parallel.blocks import ParallelMLP
from minidist.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from minidist.zero import cost as zero_cost
from minidist.zero.stages import wrap as zero_wrap

COMM = "minidist"
# the hand-written collectives are built from send/recv: the kit counts their every byte
BYTES = {
    "all_reduce": "ring",
    "reduce_scatter": "ring",
    "all_gather": "ring",
    "broadcast": "tree",
    "all_to_all": "direct",
    "expert_parallel_moe": "direct",  # the all-to-alls of expert parallelism, from send/recv
    "ring_attention": "ring",  # k|v and dk|dv to the next rank, by isend/irecv
}


def all_reduce(comm, tensor, op):
    return C.ring_all_reduce(tensor, comm, op)


def reduce_scatter(comm, tensor, op):
    lo, hi = C.chunk_bounds(tensor.numel(), comm.world_size)[comm.rank]
    return C.ring_reduce_scatter(tensor.new_empty(hi - lo), tensor, comm, op)


def all_gather(comm, chunk, shape):
    return C.ring_all_gather(chunk.new_empty(shape), chunk, comm)


def broadcast(comm, tensor, src):
    return C.broadcast(tensor, comm, src)


def all_to_all(comm, x, send_counts, recv_counts):
    y, _ = C.all_to_all(x, send_counts, comm, recv_counts)
    return y


def data_parallel(comm, module):
    # small buckets: several per model, launched during backward
    return DataParallelBucketed(module, comm, bucket_bytes=64, algorithm="ring")


def data_parallel_buckets(comm, module, bucket_bytes):
    return DataParallelBucketed(module, comm, bucket_bytes=bucket_bytes, algorithm="ring")


def dp_after_backward(model):
    model.finish_gradient_sync()


def dp_no_sync(model):
    return model.no_sync()


def column_parallel_linear(comm, linear, gather_output):
    return ColumnParallelLinear.from_full(linear, comm, gather_output=gather_output)


def row_parallel_linear(comm, linear, input_is_parallel):
    return RowParallelLinear.from_full(linear, comm, input_is_parallel=input_is_parallel)


def parallel_mlp(comm, fc1, fc2):
    d_ff, d_model = fc1.weight.shape
    mlp = ParallelMLP(d_model, d_ff, comm, dtype=fc1.weight.dtype)
    mlp.fc1.load_full_(fc1.weight, fc1.bias)
    mlp.fc2.load_full_(fc2.weight, fc2.bias)
    return mlp


# ---- pipeline parallelism ----------------------------------------------------------------------


def pipeline_schedule(kind, n_stages, n_microbatches):
    programs = build_schedules(kind, n_stages, n_microbatches, place=False)
    return [
        [(LETTER[op.kind], op.microbatch) for op in ops if op.kind in COMPUTE] for ops in programs
    ]


def pipeline_step(comm, kind, stage, n_microbatches, inputs, targets, loss_fn):
    # this rank's program, its sends and receives placed so that blocking ones cannot deadlock
    program = build_schedules(kind, comm.world_size, n_microbatches)[comm.rank]
    return PipelineStage(stage, comm, loss_fn).run(program, inputs, targets)


# ---- expert parallelism ------------------------------------------------------------------------


class _OutputOnly(nn.Module):
    """ExpertParallelMoE, returning y alone (the kit's loss has no auxiliary term)."""

    def __init__(self, layer: ExpertParallelMoE):
        super().__init__()
        self.layer = layer
        self.router = layer.router
        self.experts = layer.experts

    def forward(self, x):
        return self.layer(x)[0]


def expert_parallel_moe(comm, router, experts, k, capacity_factor):
    return _moe_from_full(ExpertParallelMoE, comm, router, experts, k, capacity_factor)


def _moe_from_full(cls, comm, router, experts, k, capacity_factor) -> _OutputOnly:
    """cls (ExpertParallelMoE, or a mutant of it) with the kit's router and this rank's experts."""
    d_ff, d = experts[0].fc1.weight.shape
    n_experts = len(experts)
    dtype = router.weight.dtype
    layer = cls(d, d_ff, n_experts, comm, k, capacity_factor, 0.0, dtype=dtype)
    with torch.no_grad():
        layer.router.weight.copy_(router.weight)
        held = experts[layer.lo : layer.lo + layer.n_local]  # experts r E/p .. (r+1) E/p - 1
        for mine, full in zip(layer.experts, held, strict=True):
            mine.load_state_dict(full.state_dict())
    return _OutputOnly(layer)


def moe_after_backward(layer):
    sync_grads(layer.layer, layer.layer.comm)  # the router over every rank; experts stay


# ---- context parallelism -----------------------------------------------------------------------


def ring_attention(comm, q, k, v, causal):
    return ring.ring_attention(q, k, v, comm, "plain", causal=causal)


# ---- ZeRO ------------------------------------------------------------------------------------


def zero(comm, module, stage, lr, betas, eps, weight_decay):
    kwargs = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    # ZeRO-2: small buckets, several units per model, reduce-scattered during backward
    options = {"bucket_bytes": 64} if stage == 2 else {}
    return zero_wrap(module, comm, torch.optim.AdamW, stage, kwargs, algorithm="ring", **options)


def zero_step(model):
    model.step()
    model.zero_grad()


def zero_parameters(model):
    with model.gathered():  # ZeRO-3: whole inside, freed after
        return {n: q.detach().clone() for n, q in model.module.named_parameters()}


def zero_gradients(model):
    model.finish_gradient_sync()  # the averaged shards; step() finds nothing left to do
    return [(n, lo, hi, t.grad) for n, lo, hi, t in model.shard_pieces() if t.grad is not None]


def zero_optimizer_state(model):
    return [(n, lo, hi, model.optimizer.state[t]) for n, lo, hi, t in model.shard_pieces()]


def zero_memory(model):
    return zero_cost.memory_nbytes(model)
