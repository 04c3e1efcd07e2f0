"""The last steps of the main job's composition: data parallelism or ZeRO over the replicas of
one (stage, tp rank) position, in the run's precision; one interface, Replicas, whatever does it.

Each way is a small function that wraps the stage's chunks in a technique and says, in a
Replicas, what the training step and the checkpoints need of it; neither asks which it is:

  data_parallel    data_parallel.DataParallelBucketed, then AdamW (fp32)
  mixed_precision  amp.MixedPrecisionOptimizer: masters, a loss scale, the dp all-reduce in fp32
  zero             zero.wrap: ZeRO-1/2/3, with its own master shards and scaler
  experts          with experts (moe.py): every gradient summed over its own replicas by hand
apply_replicas picks one: experts if the model has them, else ZeRO if config.zero, else mixed
precision if amp is not fp32, else data parallelism; over dp x cp with cp > 1 (mesh.grad_comm:
each cp rank saw other tokens of the sequences). The skip of an overflowed step (fp16) is
agreed by the whole world: every stage and tp rank must skip the same steps.
Equals: the technique each wraps, unchanged: the composed run equals train_full
(tests/test_train.py), and state() then load() resumes it exactly (tests/test_resume.py).
Lesson: lessons/12_3d_parallel/ (the composition, its last steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from minidist.data_parallel.wrappers import DataParallelBucketed
from minidist.expert_parallel.moe import ExpertParallelMoE, MoE, sync_grads
from minidist.gpt.optimizer import decay_groups, grouped_optimizer, make_optimizer, make_scaler
from minidist.memory import storage_nbytes
from minidist.mixed_precision.amp import LossScaler, MixedPrecisionOptimizer
from minidist.zero import stages as zero_
from minidist.zero.cost import memory_nbytes

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state per parameter element


def _nothing(*_) -> None:
    return None


@dataclass
class Replicas:
    """The stage's chunks kept equal over their replicas, as the step and checkpoints use them.

    module          the stage's chunks, one ModuleList
    optimizer       what the learning-rate schedule drives (its param_groups)
    scaler          the loss scale this step's losses carry (scale)
    update()        the gradients made equal over the replicas, then the optimizer step: True,
                    or False where the world skipped it (inf/nan)
    clear()         the technique's zero_grad
    on_backward(op) after every backward op of the pipeline (PipelineStage's hook)
    accumulating()  the pipeline step runs inside it: data parallelism waits for every microbatch
    gathered()      full parameters inside (ZeRO-3), to read them
    state()         this rank's slices by parameter name, {name: {"value", "exp_avg",
                    "exp_avg_sq"}}, AdamW's step and the scaler's state (ZeRO: collective over
                    dp, consolidated on its rank 0, None elsewhere)
    load(...)       the same put back, every rank its own slices (collective over dp for ZeRO)
    held_nbytes()   bytes of parameters and of optimizer state (with masters) held now
    """

    module: nn.ModuleList
    optimizer: object
    scaler: LossScaler
    update: Callable[[], bool]
    clear: Callable[[], None]
    state: Callable[[], tuple | None]
    load: Callable[[dict, float, dict | None], None]
    held_nbytes: Callable[[], dict[str, int]]
    on_backward: Callable[[object], None] = _nothing
    accumulating: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    gathered: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @property
    def scale(self) -> float:
        return self.scaler.scale

    def step(self) -> bool:
        """update(), then every gradient dropped: True if the step was taken."""
        stepped = self.update()
        self.clear()
        self.module.zero_grad(set_to_none=True)
        return stepped


def apply_replicas(chunks: list[nn.Module], mesh, config) -> Replicas:
    """The stage's chunks as one module, kept equal over their replicas (see the module's
    docstring for which way)."""
    module = nn.ModuleList(chunks)
    if config.model.experts:
        return experts(module, mesh, config)
    if config.zero:
        return zero(module, mesh.grad_comm, mesh.world, config)
    if config.amp == "fp32":
        return data_parallel(module, mesh.grad_comm, config)
    return mixed_precision(module, mesh.grad_comm, mesh.world, config)


def data_parallel(module: nn.ModuleList, dp_comm, config) -> Replicas:
    """fp32: the gradients all-reduced once, after the whole pipeline step; AdamW on each rank."""
    adamw = grouped_optimizer(config, module)()
    state, load = _adam_checkpoint(module, _trainable(module), adamw, None)
    dp = DataParallelBucketed(module, dp_comm)

    def update() -> bool:
        dp.finish_gradient_sync()
        adamw.step()
        return True

    held = lambda: _held(module, adamw, [])  # noqa: E731
    return Replicas(module, adamw, make_scaler(config.amp), update, adamw.zero_grad, state, load,
                    held, accumulating=dp.no_sync)  # fmt: skip


def mixed_precision(module: nn.ModuleList, dp_comm, world, config) -> Replicas:
    """bf16/fp16 compute: fp32 masters and a loss scale (MixedPrecisionOptimizer), the
    gradients accumulated per microbatch in float32 (on_backward), all-reduced over dp in the
    step."""
    scaler = make_scaler(config.amp)
    mp = MixedPrecisionOptimizer(module, grouped_optimizer(config, module), config.precision,
                                 scaler, dp_comm=dp_comm, overflow_comm=world)  # fmt: skip
    weights = list(zip(_names(module), mp.master, strict=True))
    state, load = _adam_checkpoint(module, weights, mp.optimizer, scaler)
    held = lambda: _held(module, mp.optimizer, list(mp.master))  # noqa: E731
    return Replicas(module, mp, scaler, mp.step, mp.zero_grad, state, load, held,
                    on_backward=lambda op: mp.collect())  # fmt: skip


def zero(module: nn.ModuleList, dp_comm, world, config) -> Replicas:
    """ZeRO-1/2/3 over dp (zero.wrap), with its own masters and scaler. ZeRO-2/3 free the
    gradients as they go, so with a pipeline they are reduce-scattered after every backward op
    (m times ZeRO-1's bytes)."""
    z = zero_.wrap(module, dp_comm, make_optimizer(config), config.zero,
                   param_groups=decay_groups(module), precision=config.precision,
                   scaler=make_scaler(config.amp), overflow_comm=world)  # fmt: skip

    def on_backward(op) -> None:
        if config.zero >= 2:
            z.finish_gradient_sync()  # this microbatch's gradients, reduce-scattered

    def state():
        full = z.state_dict(dst=0)  # collective over dp: consolidated on its rank 0
        if full is None:
            return None
        optim = full["optimizer"]
        steps = [float(v["step"]) for v in optim.values() if "step" in v]
        values = {}
        for name in _names(module):
            moments = optim.get(name, {})
            values[name] = {"value": full["model"][name], **{k: moments.get(k) for k in MOMENTS}}
        return values, max(steps, default=0.0), full.get("scaler")

    def load(mine: dict, adam_step: float, scaler: dict | None) -> None:
        step = torch.tensor(adam_step, dtype=torch.float32)
        names = _names(module)
        optimizer = {}
        for n in names:  # the optimizer's state is in the masters' dtype
            moments = {k: mine[n][k].to(config.precision.master) for k in MOMENTS}
            optimizer[n] = {"step": step.clone(), **moments}
        full = {
            "model": {n: mine[n]["value"] for n in names},
            "elementwise": list(MOMENTS),
            "optimizer": optimizer,
        }
        if scaler is not None:
            full["scaler"] = scaler
        z.load_state_dict(full, src=0)  # collective over dp

    held = lambda: memory_nbytes(z)  # noqa: E731
    return Replicas(module, z.optimizer, z.scaler, z.step, z.zero_grad, state, load, held,
                    on_backward=on_backward, gathered=z.gathered)  # fmt: skip


def experts(module: nn.ModuleList, mesh, config) -> Replicas:
    """Data parallel replicas of an MoE model (fp32, no ZeRO): AdamW on each rank; the step
    sums each gradient over its replicas by hand (dense: grad_comm, dp x cp; each block's
    router: ep, edp, cp, every rank; its experts: edp, cp), then divides all by dp cp: their
    mean. Checkpoints of runs with experts are not supported (the CLI refuses them)."""
    adamw = grouped_optimizer(config, module)()
    moes = [m for m in module.modules() if isinstance(m, (MoE, ExpertParallelMoE))]
    routed = {id(q) for moe in moes for q in moe.parameters()}
    dense = [q for q in module.parameters() if id(q) not in routed]
    replicas = mesh.dp_comm if mesh.edp_comm is None else mesh.edp_comm  # ep = 1: all of dp

    def update() -> bool:
        for q in dense:
            mesh.grad_comm.all_reduce(_grad_or_zeros(q), "sum")
        for moe in moes:
            sync_grads(moe, mesh.ep_comm, replicas)
            sync_grads(moe, None, mesh.cp_comm)  # router and experts: cp saw other tokens
        for q in module.parameters():
            q.grad.div_(config.dp * config.cp)  # sums over every dp (x cp) rank's loss: the mean
        adamw.step()
        return True

    def refused(*_):
        raise ValueError("checkpoints of a run with experts are not supported")

    held = lambda: _held(module, adamw, [])  # noqa: E731
    return Replicas(module, adamw, make_scaler(config.amp), update, adamw.zero_grad, refused,
                    refused, held)  # fmt: skip


def _grad_or_zeros(q: nn.Parameter) -> torch.Tensor:
    """q.grad, zeros if backward left none (every rank must reduce the same tensors)."""
    if q.grad is None:
        q.grad = torch.zeros_like(q)
    return q.grad


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, q) for n, q in module.named_parameters() if q.requires_grad]


def _names(module: nn.Module) -> list[str]:
    return [n for n, _ in _trainable(module)]


def _adam_checkpoint(module: nn.Module, weights: list, optimizer, scaler) -> tuple:
    """(state, load) of AdamW stepping weights, [(name, tensor)] (the parameters or their
    masters, in the order of module's trainable parameters); every replica holds the same
    (resume.save takes replica 0's). scaler: its state saved too (None: fixed)."""
    params = [q for _, q in _trainable(module)]

    def state():
        values, steps = {}, [0.0]
        for name, w in weights:
            st = optimizer.state.get(w, {})  # nothing before the first step, as AdamW starts
            values[name] = {"value": w.detach(), **{k: st.get(k) for k in MOMENTS}}
            if "step" in st:
                steps.append(float(st["step"]))
        return values, max(steps), None if scaler is None else scaler.state_dict()

    def load(mine: dict, adam_step: float, saved_scaler: dict | None) -> None:
        step = torch.tensor(adam_step, dtype=torch.float32)
        with torch.no_grad():
            for q, (name, w) in zip(params, weights, strict=True):
                w.copy_(mine[name]["value"])
                q.copy_(w)  # the model: the master rounded
                if adam_step > 0:
                    moments = {k: mine[name][k].to(w.device, w.dtype) for k in MOMENTS}
                    optimizer.state[w] = {"step": step.clone(), **moments}
        if scaler is not None and saved_scaler is not None:
            scaler.load_state_dict(saved_scaler)

    return state, load


def _held(module: nn.Module, optimizer, masters: list) -> dict[str, int]:
    state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    state += masters
    return {
        "params": storage_nbytes(list(module.parameters())),
        "optimizer": storage_nbytes([t for t in state if t.dim() > 0]),  # not AdamW's 0-d steps
    }
