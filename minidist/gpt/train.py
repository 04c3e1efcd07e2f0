"""3D parallelism: the small GPT of model.py trained with data, pipeline and tensor parallelism
(plus ZeRO, mixed precision and checkpointing) composed in one place, in a fixed order.

Equals: train_full, the same model, batches, AdamW (weight decay on the weight matrices only:
replicas.decay_groups) and learning-rate schedule in one process, the loss the mean over the whole
batch. float64: losses and final parameters to 1e-12 relative (tests/test_train.py); float32
about 1e-5 (sums in another order); bf16/fp16 with the reference run in the same precision,
within that format's rounding.
Communication per step, per rank (m microbatches of b = B/(dp m) sequences of T tokens, D the
width, L_s blocks on this stage, e bytes an activation element, Psi_s this stage's parameters
per tp rank, f bytes a gradient element):
  tp: 4 all-reduces of b T D e per block and microbatch (2 forward, 2 backward), plus the
      embedding's and the cross-entropy's: ring bytes 2 (tp-1)/tp each.
  pp: one activation b T D e to the next stage and one gradient back, per microbatch and chunk.
  dp: the gradients once per step: 2 (dp-1)/dp Psi_s f (data parallel, ZeRO-1); ZeRO-2/3 with
      pp > 1 reduce-scatter after every microbatch's backward (m times that; see below), and
      ZeRO-3 gathers parameters per microbatch.
Memory per rank: Psi_s parameters with their gradients and optimizer state (ZeRO divides them
by dp; see zero/stages.py), plus the activations the schedule keeps (pipeline/stage.py).
Order of composition (each step wraps what the one before made):
  1. mesh         the rank grid; dp_comm, pp_comm, tp_comm          mesh.py
                  (cp > 1: cp_comm, dcp_comm; ep > 1: ep_comm, edp_comm)
  2. model cut    this stage's layers, each sliced over tp_comm     model.py
                  (the experts over ep_comm: moe.py; the attention
                  over cp_comm, each rank its zigzag tokens: context.py)
  3. replicas     precision, then data parallel or ZeRO over dp     replicas.py
                  (over dp x cp with cp > 1; with experts, each
                  gradient over its own replicas)
  4. pipeline     the stage's chunks run by the schedule over pp    pipeline/stage.py,
  pipeline/schedules.py
The data-parallel step comes after the whole pipeline step: the pipeline accumulates each
chunk's gradients over its microbatches first. ZeRO-2/3 free gradients as they go, so there
they are reduce-scattered after every backward op (PipelineStage's on_backward), which sends
m times ZeRO-1's bytes: why large jobs pair pipelines with ZeRO-1 only.
The skip of a step whose gradients overflowed (fp16) is agreed by the whole world, not only
dp: every stage and tp rank must skip the same steps.
Paper: Narayanan et al., Megatron-LM on GPU clusters (SC 2021), sections 2-3.
Lesson: lessons/12_3d_parallel/.   Run: minidist train --dp 2 --pp 2 --tp 2 --check
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from minidist.gpt import context, moe
from minidist.gpt import model as gpt
from minidist.gpt.data import SONNETS, batch_at, dp_share, load_bytes
from minidist.gpt.replicas import Replicas, make_replicas
from minidist.large_batches.lr import WarmupDecay
from minidist.mesh import Layout, Mesh, make_mesh
from minidist.mixed_precision.amp import PRECISIONS, Precision
from minidist.pipeline.schedules import NAMES, build_schedules
from minidist.pipeline.stage import PipelineStage, split_microbatches
from minidist.tensor_parallel.layers import vocab_parallel_cross_entropy

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; the same on every rank."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallel, carved out of dp (with model.experts: moe.py)
    cp: int = 1  # context parallel: each rank T/cp tokens of every sequence (context.py)
    zero: int = 0  # 0: data parallel; 1, 2, 3: ZeRO stage
    microbatches: int = 1
    schedule: str = "1f1b"
    chunks: int = 1  # model chunks per pipeline stage (the interleaved schedule)
    amp: str = "fp32"  # fp32 | bf16 | fp16: the compute dtype; masters stay in dtype
    checkpointing: bool = False  # recompute every block's activations in backward
    steps: int = 50
    batch: int = 16  # sequences per step, over all dp ranks
    lr: float = 3e-3
    weight_decay: float = 0.1  # AdamW's, on the weight matrices only (decay_groups)
    warmup: int = 5
    dtype: str = "float32"  # parameters and optimizer (float64: the tight check)
    seed: int = 0  # the batches; the model's seed is model.seed
    model: gpt.GPTConfig = field(default_factory=gpt.GPTConfig)

    @property
    def layout(self) -> Layout:
        return Layout(self.dp, self.pp, self.tp, self.ep, self.cp)

    @property
    def precision(self) -> Precision:
        """The dtype of each role: compute from amp, masters and gradient sums in dtype."""
        master = DTYPES[self.dtype]
        compute = master if self.amp == "fp32" else PRECISIONS[self.amp].compute
        return Precision(compute, master, master)

    @property
    def counts(self) -> dict[str, int]:
        """The numbers that count something: each at least 1."""
        m = self.model
        return {
            "dp": self.dp,
            "pp": self.pp,
            "tp": self.tp,
            "ep": self.ep,
            "cp": self.cp,
            "microbatches": self.microbatches,
            "chunks": self.chunks,
            "steps": self.steps,
            "batch": self.batch,
            "seq_len": m.seq_len,
            "d_model": m.d_model,
            "n_heads": m.n_heads,
            "d_ff": m.d_ff,
            "n_layers": m.n_layers,
        }

    def problems(self, world_size: int | None = None) -> list[str]:
        """Every reason this run cannot start, with the numbers; [] if it can."""
        found = []
        for name, value in self.counts.items():
            _require(found, value >= 1, f"{name}={value} must be at least 1")
        finite = math.isfinite(self.lr) and self.lr > 0
        _require(found, finite, f"lr={self.lr} must be a finite number > 0")
        _require(found, self.warmup >= 0, f"warmup={self.warmup} must be at least 0")
        if found:
            return found  # the checks below divide by these numbers
        world = self.dp * self.pp * self.cp * self.tp
        return self._layout_problems(world if world_size is None else world_size)

    def _layout_problems(self, world_size: int) -> list[str]:
        """problems() once every count is at least 1: how the numbers fit together."""
        m, found, text = self.model, [], SONNETS.stat().st_size
        why = f"seq_len={m.seq_len}: the text has {text} bytes, a sequence needs seq_len + 1"
        _require(found, m.seq_len + 1 <= text, why + " of them")
        why = f"steps={self.steps} is below the warm-up of {self.warmup} steps"
        _require(found, self.steps >= self.warmup, why + ": raise --steps or lower --warmup")
        found += _refused(lambda: self.layout.check(world_size))
        found += m.problems(self.tp) + moe.problems(self) + context.problems(self)
        for name, value, allowed in self.choices:
            _require(found, value in allowed, f"{name}={value!r} is not one of {allowed}")
        ok = self.batch % (self.dp * self.microbatches) == 0
        why = f"batch={self.batch} is not divisible by dp={self.dp} x microbatches="
        _require(found, ok, why + f"{self.microbatches}")
        _require(found, self.weight_decay >= 0, f"weight_decay={self.weight_decay} is negative")
        why = f"chunks={self.chunks} needs schedule='interleaved'"
        _require(found, self.chunks == 1 or self.schedule == "interleaved", why)
        why = f"pp={self.pp} x chunks={self.chunks} pipeline parts, but the model has only "
        _require(
            found,
            self.pp * self.chunks <= m.n_layers + 2,
            why + f"n_layers={m.n_layers} + 2 layers",
        )
        if self.schedule in NAMES:  # an unknown one is reported above
            found += _refused(
                build_schedules, self.schedule, self.pp, self.microbatches, self.chunks
            )
        return found

    @property
    def choices(self) -> list[tuple[str, object, tuple]]:
        """(name, value, the values allowed) of each field that names a choice."""
        return [
            ("zero", self.zero, (0, 1, 2, 3)),
            ("amp", self.amp, tuple(PRECISIONS)),
            ("dtype", self.dtype, tuple(DTYPES)),
            ("schedule", self.schedule, NAMES),
        ]

    def check(self, world_size: int | None = None) -> TrainConfig:
        """self, or a ValueError listing every problem (before any process starts work)."""
        found = self.problems(world_size)
        if found:
            raise ValueError("this run cannot start:\n  " + "\n  ".join(found))
        return self


def _require(found: list[str], ok: bool, why: str) -> None:
    """found += [why] unless ok."""
    if not ok:
        found.append(why)


def _refused(check: Callable, *args) -> list[str]:
    """[] if check(*args) passes, else [the message of the ValueError it raises]."""
    try:
        check(*args)
    except ValueError as e:
        return [str(e)]
    return []


@dataclass
class Job:
    """One rank's composed training: its mesh, chunks (and their layer numbers), replicas,
    pipeline stage and program; built by build_job, stepped by train_step."""

    config: TrainConfig
    mesh: Mesh
    layer_ids: list[list[int]]
    chunks: list[nn.Module]
    replicas: Replicas
    stage: PipelineStage
    program: list
    schedule: WarmupDecay
    data: torch.Tensor
    device: torch.device
    step: int = 0


def build_job(comm, config: TrainConfig, data=None, tracer=None, observe=None, device=None) -> Job:
    """Steps 1-4 on this rank (collective: every rank of comm calls it). observe(axis, comm),
    when given, wraps each sub-comm (e.g. in an ObservedComm, to count its bytes). device:
    where the model and its batches live; default the comm's (NCCL: this rank's GPU), else
    the CPU."""
    device = torch.device(device or getattr(comm, "device", "cpu"))
    config.check(comm.world_size)
    mesh = make_mesh(comm, config.layout)  # 1
    if observe is not None:
        mesh = _observed(mesh, observe)
    # lab 12.4 begin: steps 2-3: this stage's layer ids and chunks (cut over tp), the replicas
    _, s, _ = mesh.coords
    layer_ids = gpt.stage_layer_ids(config.model, config.pp, config.chunks, s)  # 2
    chunks = gpt.stage_chunks(
        config.model,
        mesh.tp_comm,
        layer_ids,
        DTYPES[config.dtype],
        recompute=config.checkpointing,
        device=device,
        ep_comm=mesh.ep_comm,
    )
    if mesh.cp_comm is not None:  # before the replicas: ZeRO-3 hooks the modules it finds
        context.context_parallel(chunks, mesh.cp_comm, config.model.seq_len)
    replicas = make_replicas(chunks, mesh, config)  # 3
    # lab 12.4 end
    # each microbatch's auxiliary loss weighs 1/m, as its loss (pipeline/stage.py); the replicas
    moe.group_blocks(replicas.module, None, 1 / config.microbatches)  # divide by dp cp

    def loss_fn(logits_local: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # logits_local: (b, T, V/tp); the loss in float32 at least, scaled for fp16
        logits = logits_local.to(torch.promote_types(logits_local.dtype, torch.float32))
        return vocab_parallel_cross_entropy(logits, targets, mesh.tp_comm).mean() * replicas.scale

    stage = PipelineStage(
        chunks, mesh.pp_comm, loss_fn, tracer=tracer, on_backward=replicas.on_backward
    )  # 4
    program = build_schedules(config.schedule, config.pp, config.microbatches, config.chunks)[s]
    schedule = WarmupDecay(replicas.optimizer, config.warmup, config.steps)
    data = load_bytes() if data is None else data
    return Job(config, mesh, layer_ids, chunks, replicas, stage, program, schedule, data, device)


def train_step(job: Job) -> tuple[float, bool]:
    """One step of every rank: (the whole batch's mean loss, on every rank; stepped)."""
    c, (d, s, _) = job.config, job.mesh.coords
    ids, targets = batch_at(job.data, job.step, c.batch, c.model.seq_len, c.seed)  # (B, T)
    ids, targets = dp_share(ids, d, c.dp), dp_share(targets, d, c.dp)  # (B/dp, T)
    if job.mesh.cp_comm is not None:  # this rank's zigzag chunks: (B/dp, T/cp)
        ids, targets = (context.shard_tokens(t, job.mesh.cp_comm) for t in (ids, targets))
    ids, targets = ids.to(job.device), targets.to(job.device)
    first, last = s == 0, s == c.pp - 1
    with job.replicas.accumulating():
        losses = job.stage.run(
            job.program,
            split_microbatches(ids, c.microbatches) if first else None,
            split_microbatches(targets, c.microbatches) if last else None,
        )
    scale = job.replicas.scale  # the scale this step's losses carry (step() may change it)
    stepped = job.replicas.step()
    job.schedule.step()
    job.step += 1
    return batch_loss_full(losses, job.mesh, scale, job.device), stepped


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
        routed = [q for x in job.replicas.module.modules() if isinstance(x, moe.MoEBlock)
                  for q in x.moe.parameters()]  # fmt: skip
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


def batch_loss_full(losses: list, mesh: Mesh, scale: float, device=None) -> float:
    """The mean over the whole batch, on every rank: the last stage's mean over microbatches,
    averaged over dp (x cp: each cp rank's mean is over its T/cp tokens), then broadcast along
    the pipeline. Collectives: dp (x cp) all_reduce, pp broadcast (one float64 each)."""
    mean = torch.zeros(1, dtype=torch.float64, device=device)
    if losses:  # the last stage
        mean += torch.stack(losses).double().mean() / scale
    mesh.grad_comm.all_reduce(mean, "sum")
    mesh.pp_comm.broadcast(mean, mesh.layout.pp - 1)
    return mean.item() / (mesh.layout.dp * mesh.layout.cp)


def _observed(mesh: Mesh, observe: Callable) -> Mesh:
    """mesh with each sub-comm wrapped by observe(axis, comm); dp x cp and edp count as dp
    (the gradients' traffic), ep as ep, cp as cp."""
    axes = {"dp": "dp", "pp": "pp", "tp": "tp", "cp": "cp", "dcp": "dp", "ep": "ep", "edp": "dp"}
    subs = {f"{a}_comm": getattr(mesh, f"{a}_comm") for a in axes}
    return replace(
        mesh, **{k: v if v is None else observe(axes[k[:-5]], v) for k, v in subs.items()}
    )


def train(comm, config: TrainConfig, data=None, on_step: Callable | None = None, device=None):
    """Build the job and train config.steps steps: (job, {"losses", "skipped", "seconds"}),
    the same losses on every rank. gather.parameters_full(job) puts the model together."""
    job = build_job(comm, config, data, device=device)
    losses, skipped, start = [], [], time.perf_counter()
    for step in range(config.steps):
        loss, stepped = train_step(job)
        losses.append(loss)
        if not stepped:
            skipped.append(step)
        if on_step is not None:
            on_step(job, loss)
    return job, {"losses": losses, "skipped": skipped, "seconds": time.perf_counter() - start}
