"""3D parallelism: the small GPT of model.py trained with data, pipeline and tensor parallelism
(plus context and expert parallelism, ZeRO, mixed precision and recomputation) composed in one
place, in a fixed order.

Equals: train_full, the same model, batches, AdamW (weight decay on the weight matrices only:
optimizer.decay_groups) and learning-rate schedule in one process, the loss the mean over the
full batch. float64: losses and final parameters to 1e-12 relative (tests/test_train.py);
float32 about 1e-5 (sums in another order); bf16/fp16 with the reference run in the same
precision, within that format's rounding.
Communication per step, per rank (m microbatches of b = B/(dp m) sequences of T tokens, D the
width, L_s blocks on this stage, e bytes an activation element, Psi_s this stage's parameters
per tp rank, f bytes a gradient element):
  tp: 4 all-reduces of b T D e per block and microbatch (2 forward, 2 backward), plus the
      embedding's and the cross-entropy's: ring bytes 2 (tp-1)/tp each.
  pp: one activation b T D e to the next stage and one gradient back, per microbatch and chunk.
  dp: the gradients once per step: 2 (dp-1)/dp Psi_s f (data parallel, ZeRO-1); ZeRO-2/3 with
      pp > 1 reduce-scatter after every microbatch's backward (m times that), and ZeRO-3
      gathers parameters per microbatch.
Memory per rank: Psi_s parameters with their gradients and optimizer state (ZeRO divides them
by dp; see zero/stages.py), plus the activations the schedule keeps (pipeline/stage.py).
The composition (build_job), as torchtitan's parallelize: the mesh, the plain model built
once, full, then each technique's own apply function on what the one before left:
  mesh            the rank grid: dp_comm, pp_comm, tp_comm (cp, ep)  mesh.py
  1. tensor       every layer sliced over tp_comm                   tensor_parallel/parallelize.py
  2. context      every attention a ring over cp_comm               context_parallel/parallelize.py
  3. expert       every block's experts shared out over ep_comm     expert_parallel/moe_block.py
     (recompute   every block's activations recomputed in backward  checkpointing/blocks.py)
  4. pipeline     this stage's layers, as chunks for the schedule    pipeline/chunks.py
  5. data         data parallel or ZeRO over dp (dp x cp)            data_parallel/replicas.py,
                  (with experts: every gradient over its replicas)   zero/replicas.py,
  6. precision    in the run's precision: amp's masters and scale    mixed_precision/replicas.py
One interface (minidist/replicas.py: Replicas) whichever step 5 is; expert_parallel/moe_block.py
holds the experts' apply_expert_dp.
The cuts come first: data parallelism and ZeRO must see the parameters each rank really holds.
The data-parallel step comes after the whole pipeline step: the pipeline accumulates each
chunk's gradients over its microbatches first. The skip of a step whose gradients overflowed
(fp16) is agreed by the whole world, not only dp: every stage and tp rank must skip the same.
Paper: Narayanan et al., Megatron-LM on GPU clusters (SC 2021), sections 2-3.
Lesson: lessons/12_3d_parallel/.   Run: minidist train --dp 2 --pp 2 --tp 2 --check
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from minidist.checkpointing.blocks import apply_recompute
from minidist.context_parallel.parallelize import apply_cp
from minidist.data_parallel.replicas import apply_dp
from minidist.expert_parallel.moe_block import MoEBlock, apply_ep, apply_expert_dp, group_blocks
from minidist.gpt import model as gpt
from minidist.gpt import moe
from minidist.gpt.config import DTYPES, TrainConfig
from minidist.gpt.data import load_bytes
from minidist.gpt.loop import run, train_step
from minidist.gpt.optimizer import decay_groups, grouped_optimizer, make_optimizer, make_scaler
from minidist.large_batches.lr import WarmupDecay
from minidist.mesh import Mesh, make_mesh
from minidist.mixed_precision.replicas import apply_amp
from minidist.pipeline.chunks import apply_pp
from minidist.pipeline.schedules import build_schedules
from minidist.pipeline.stage import PipelineStage
from minidist.replicas import Replicas
from minidist.tensor_parallel.layers import vocab_parallel_cross_entropy
from minidist.tensor_parallel.parallelize import apply_tp
from minidist.zero.replicas import apply_zero


@dataclass
class Job:
    """One rank's composed training: its mesh, chunks (and their layer numbers), replicas,
    pipeline stage and program; built by build_job, stepped by loop.train_step. elements[i]:
    which of layer i's full parameter elements this rank holds (each cut's recording_cut, in
    turn), cut_over[i]: the mesh's axes it was cut over ("tp", "ep"), for this stage's layers
    i."""

    config: TrainConfig
    mesh: Mesh
    layer_ids: list[list[int]]
    chunks: list[nn.Module]
    elements: dict[int, torch.Tensor]
    cut_over: dict[int, list[str]]
    replicas: Replicas
    stage: PipelineStage
    program: list
    schedule: WarmupDecay
    data: torch.Tensor
    device: torch.device
    step: int = 0


def build_job(comm, config: TrainConfig, data=None, tracer=None, observe=None, device=None) -> Job:
    """This rank's composed job, in the order of the module's docstring (collective: every rank
    of comm calls it). observe(axis, comm), when given, wraps each sub-comm (e.g. in an
    ObservedComm, to count its bytes). device: where the model and its batches live; default
    the comm's (NCCL: this rank's GPU), else the CPU."""
    device = torch.device(device or getattr(comm, "device", "cpu"))
    config.check(comm.world_size)
    mesh = make_mesh(comm, config.layout)
    if observe is not None:
        mesh = _observed(mesh, observe)
    _, s, _ = mesh.coords
    scaler = make_scaler(config.amp)  # the loss scale every loss carries (fp16: dynamic)
    layers = gpt.GPT(config.model, DTYPES[config.dtype]).layers  # the plain model, full, once
    elements = {i: torch.arange(n) for i, n in enumerate(gpt.layer_costs(config.model))}
    cut_over = {i: [] for i in elements}
    # lab 12.4 begin: the techniques in order, each applied to what the one before left
    held = {"tp": apply_tp(layers, mesh.tp_comm)}  # 1: first, so every later step sees slices
    if mesh.cp_comm is not None:
        apply_cp(layers, mesh.cp_comm)  # 2
    if mesh.ep_comm is not None:
        held["ep"] = apply_ep(layers, mesh.ep_comm)  # 3
    if config.checkpointing:
        apply_recompute(layers)  # before the replicas: ZeRO-3 hooks the modules it finds
    layer_ids = gpt.stage_layer_ids(config.model, config.pp, config.chunks, s)
    chunks = apply_pp(layers, layer_ids, device)  # 4: this stage's layers, and their executor

    def loss_fn(logits_local: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # logits_local: (b, T, V/tp); the loss in float32 at least, scaled for fp16
        logits = logits_local.to(torch.promote_types(logits_local.dtype, torch.float32))
        return vocab_parallel_cross_entropy(logits, targets, mesh.tp_comm).mean() * scaler.scale

    stage = PipelineStage(chunks, mesh.pp_comm, loss_fn, tracer=tracer)
    module = nn.ModuleList(chunks)  # 5, 6: the replicas of the stage, in the run's precision
    if config.model.experts:
        replicas = apply_expert_dp(module, mesh, grouped_optimizer(config, module)(), scaler)
    elif config.zero:
        replicas = apply_zero(
            module,
            mesh.grad_comm,
            make_optimizer(config),
            config.zero,
            param_groups=decay_groups(module),
            precision=config.precision,
            scaler=scaler,
            overflow_comm=mesh.world,
        )
    elif config.amp == "fp32":
        replicas = apply_dp(module, mesh.grad_comm, grouped_optimizer(config, module)(), scaler)
    else:
        replicas = apply_amp(
            module,
            grouped_optimizer(config, module),
            config.precision,
            scaler,
            mesh.grad_comm,
            mesh.world,
        )
    # lab 12.4 end
    stage.on_backward = replicas.on_backward  # after every backward op (ZeRO-2/3 reduce)
    for axis, cuts in held.items():  # which full elements each cut left this rank, in turn
        for i, mine in cuts.items():
            elements[i] = elements[i][mine]
            cut_over[i].append(axis)
    # each microbatch's auxiliary loss weighs 1/m, as its loss (pipeline/stage.py); the replicas
    group_blocks(module, None, 1 / config.microbatches)  # divide by dp cp
    ids = sum(layer_ids, [])
    return Job(
        config,
        mesh,
        layer_ids,
        chunks,
        elements={i: elements[i] for i in ids},
        cut_over={i: cut_over[i] for i in ids},
        replicas=replicas,
        stage=stage,
        program=build_schedules(config.schedule, config.pp, config.microbatches, config.chunks)[s],
        schedule=WarmupDecay(replicas.optimizer, config.warmup, config.steps),
        data=load_bytes() if data is None else data,
        device=device,
    )


def train(comm, config: TrainConfig, data=None, on_step: Callable | None = None, device=None):
    """Build the job and train config.steps steps (loop.run, on_step(job, loss, stepped) after
    each): (job, run's result), the same losses on every rank. gather.parameters_full(job)
    puts the model together."""
    job = build_job(comm, config, data, device=device)
    return job, run(job, train_step, config.steps, on_step)


def predicted_nbytes(job: Job) -> dict[str, int | None]:
    """Payload bytes this rank issues per step on each sub-comm (collective inputs and sends),
    as the docstring's formulas give them; None where no formula is written (dp: ZeRO-2/3).

    n = b T tokens a microbatch (b = B / (dp m)), a = n D e bytes an activation (e: compute
    dtype), x = 4 or 8 bytes a loss element. tp per microbatch: 4 a per block (6 a when
    recomputed: the forward's two all-reduces run again), a for the embedding's g, a + 3 n x
    for the head (f's backward; the cross-entropy's max, target logit and sum of exps).
    pp: a per microbatch to each neighbour (activations on, gradients back), a 64-byte header
    per chunk and step, 8 for the loss's broadcast. dp: the all-reduce of Psi_s + P_s
    (gradients and "used" flags) in the master dtype (data parallel; mixed precision: Psi_s
    in the reduce dtype and no flags); ZeRO-1 reduce-scatters the padded Psi_s, all-gathers
    the shard in the compute dtype, all-reduces the P_s flags (master dtype); 8 for the loss.
    cp > 1: n = b T / cp tokens, dp counts dp x cp ranks; cp per microbatch and block: ring
    attention's 2 (cp-1) + 2 (2cp-1) messages of a / tp (k|v on, then k|v and dk|dv), the
    forward's again when recomputed, and with experts the routers' and experts' gradients (f
    each); dp then moe.dp_nbytes, ep None (routed: no formula). Keys: dp, pp, tp, cp/ep if > 1."""
    c, (_, s, _) = job.config, job.mesh.coords
    m = c.microbatches
    e = c.precision.compute.itemsize  # bytes of an activation element
    x = torch.promote_types(c.precision.compute, torch.float32).itemsize  # of a loss element
    f = c.precision.master.itemsize  # of a gradient element (the reduce dtype)
    n = c.batch // (c.dp * m) * c.model.seq_len // c.cp  # tokens in a microbatch, here
    a = n * c.model.d_model * e  # bytes of one activation
    params = [q for q in job.replicas.module.parameters() if q.requires_grad]
    blocks = sum(1 for i in sum(job.layer_ids, []) if 1 <= i <= c.model.n_layers)
    ring = 2 * (c.cp - 1) * (2 if c.checkpointing else 1) + 2 * (2 * c.cp - 1)
    found = {
        "dp": moe.dp_nbytes(params, f) if c.model.experts else _dp_nbytes(c, params, e, f),
        "pp": _pp_nbytes(c, s, m * a),
        "tp": m * _tp_nbytes(c, sum(job.layer_ids, []), a, n * x),
    }
    if c.cp > 1:
        routed = [
            q
            for x in job.replicas.module.modules()
            if isinstance(x, MoEBlock)
            for q in x.moe.parameters()
        ]
        found["cp"] = m * blocks * ring * a // c.tp + sum(q.numel() for q in routed) * f
    if c.ep > 1:
        found["ep"] = None  # the all-to-alls carry what the routers decide: no formula
    return found


def _tp_nbytes(c: TrainConfig, ids: list[int], a: int, loss_row: int) -> int:
    """tp bytes per microbatch of the layers ids (0: embedding, L + 1: head), a an activation,
    loss_row the bytes of one loss element per token (x n)."""
    # lab 12.5 begin: 4 a per block (6 a recomputed), a for the embedding, a + 3 n x for the head
    blocks = sum(1 for i in ids if 1 <= i <= c.model.n_layers)
    per_block = 6 * a if c.checkpointing else 4 * a  # recomputed: the forward's 2 run again
    nbytes = blocks * per_block
    if 0 in ids:
        nbytes += a  # the embedding's g
    if c.model.n_layers + 1 in ids:
        nbytes += a + 3 * loss_row  # f's backward; the loss's max, target logit, sum of exps
    # lab 12.5 end
    return nbytes


def _pp_nbytes(c: TrainConfig, s: int, ma: int) -> int:
    """pp bytes per step of stage s, ma = m activations: for each of its chunks, m activations
    on (and a 64-byte header) unless the chunk is the last virtual stage, m gradients back
    unless it is the first; 8 for the loss's broadcast."""
    # lab 12.6 begin: walk this stage's chunks (virtual stage chunk pp + s): sends each way
    nbytes = 8
    n_virtual = c.pp * c.chunks
    for chunk in range(c.chunks):
        u = chunk * c.pp + s  # this chunk's virtual stage
        if u < n_virtual - 1:
            nbytes += ma + 64  # activations on, one header per chunk and step
        if u > 0:
            nbytes += ma  # gradients back
    # lab 12.6 end
    return nbytes


def _dp_nbytes(c: TrainConfig, params: list, e: int, f: int) -> int | None:
    """dp bytes per step: None where no formula is written (ZeRO-2/3)."""
    numel = sum(q.numel() for q in params)
    flags = len(params) * f  # the "used" flags, one per parameter tensor
    if c.zero == 0 and c.amp != "fp32":
        return 8 + numel * f  # mixed precision: the gradients only
    if c.zero == 0:
        return 8 + numel * f + flags
    if c.zero == 1:
        p = c.dp * c.cp  # the ranks the gradients are averaged over
        shard = -(-numel // p)  # ceil: the padded shard
        return 8 + shard * p * f + shard * e + flags  # reduce-scatter, all-gather, flags
    return None


def _observed(mesh: Mesh, observe: Callable) -> Mesh:
    """mesh with each sub-comm wrapped by observe(axis, comm); dp x cp and edp count as dp
    (the gradients' traffic), ep as ep, cp as cp."""
    axes = {"dp": "dp", "pp": "pp", "tp": "tp", "cp": "cp", "dcp": "dp", "ep": "ep", "edp": "dp"}
    subs = {f"{a}_comm": getattr(mesh, f"{a}_comm") for a in axes}
    return replace(
        mesh, **{k: v if v is None else observe(axes[k[:-5]], v) for k, v in subs.items()}
    )
