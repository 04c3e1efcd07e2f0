"""Step 3 of the main job: the replicas of one (stage, tp rank) position, kept equal over dp.

One interface for the three ways of doing it, so that train.py and resume.py never ask which
one a run uses. Each adapter wraps a technique's object and adds nothing to its numbers:

  DataParallelReplicas     data_parallel.DataParallelBucketed, then AdamW (fp32)
  MixedPrecisionReplicas   amp.MixedPrecisionOptimizer: fp32 masters, a loss scale, dp all-reduce
  ZeroReplicas             zero.wrap: ZeRO-1/2/3, with its own master shards and scaler
  ExpertReplicas           with experts (moe.py): gradients averaged over their own replicas

The interface (Replicas):
  module          the stage's chunks, one ModuleList
  optimizer       what the learning-rate schedule drives
  scale           the loss scale this step's losses carry
  accumulating()  the pipeline step runs inside it: data parallelism waits for every microbatch
  on_backward(op) after every backward op of the pipeline (PipelineStage's hook)
  step() -> bool  the optimizer step, then zero_grad(); False: skipped (inf/nan in the world)
  gathered()      full parameters inside (ZeRO-3), to read them
  state()         this rank's slices by parameter name, {name: {"value", "exp_avg",
                  "exp_avg_sq"}}, AdamW's step and the scaler's state, on rank 0 of dp (None
                  elsewhere; collective over dp for ZeRO, which consolidates its shards)
  load(...)       the same put back, every rank its own slices (collective over dp for ZeRO)
  held_nbytes()   bytes of parameters and of optimizer state (with masters) held now
Equals: the technique each wraps, unchanged: the composed run equals train_full
(tests/test_train.py), and state() then load() resumes it exactly (tests/test_resume.py).
Lesson: lessons/12_3d_parallel/ (the composition, step 3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch
from torch import nn

from minidist.data_parallel.wrappers import DataParallelBucketed
from minidist.expert_parallel.moe import ExpertParallelMoE, MoE, sync_grads
from minidist.memory import storage_nbytes
from minidist.mixed_precision.amp import LossScaler, MixedPrecisionOptimizer
from minidist.tensor_parallel.blocks import VocabParallelEmbedding
from minidist.zero import stages as zero_
from minidist.zero.cost import memory_nbytes

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state per parameter element
EMBEDDINGS = (nn.Embedding, VocabParallelEmbedding)  # lookup tables, whole or cut over tp


def make_optimizer(config):
    """AdamW on any tensors or groups: the optimizer of every variant (and of the reference);
    weight_decay is the default, which decay_groups turns off where GPT practice does."""

    def adamw(params, **kw) -> torch.optim.AdamW:
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, **kw)

    return adamw


def decay_groups(module: nn.Module, tensors: list | None = None) -> list[dict]:
    """AdamW's two groups over module's trainable parameters (or over tensors standing for
    them, in the same order: amp's masters): the weight matrices of linear layers decay (the
    optimizer's weight_decay); biases, LayerNorm weights and the token and position embeddings
    do not (weight_decay 0), as GPT-2/3 and minGPT train (a table row is decayed every step
    but gets a gradient only when its token appears). The rule reads each parameter's module
    and dimensions, so the full model and its tp slices split alike."""
    params = [q for q in module.parameters() if q.requires_grad]
    no_decay = set()
    for m in module.modules():
        for q in m.parameters(recurse=False):
            if q.dim() < 2 or isinstance(m, EMBEDDINGS):
                no_decay.add(id(q))
    tensors = params if tensors is None else list(tensors)
    decay = [id(q) not in no_decay for q in params]
    return [
        {"params": [t for t, d in zip(tensors, decay, strict=True) if d]},
        {"params": [t for t, d in zip(tensors, decay, strict=True) if not d], "weight_decay": 0.0},
    ]


def grouped_optimizer(config, module: nn.Module) -> Callable:
    """tensors -> AdamW over decay_groups(module, tensors) (None: module's own parameters)."""
    adamw = make_optimizer(config)

    def build(tensors: list | None = None) -> torch.optim.AdamW:
        return adamw(decay_groups(module, tensors))

    return build


def make_scaler(amp: str) -> LossScaler:
    """fp16 needs a dynamic loss scale (its range is narrow); bf16 and fp32 none."""
    if amp == "fp16":
        return LossScaler(2.0**16)
    return LossScaler(1.0, dynamic=False)


class Replicas(Protocol):
    module: nn.ModuleList
    optimizer: object
    scaler: LossScaler

    @property
    def scale(self) -> float: ...
    def accumulating(self) -> contextlib.AbstractContextManager: ...
    def on_backward(self, op) -> None: ...
    def step(self) -> bool: ...
    def zero_grad(self) -> None: ...
    def gathered(self) -> contextlib.AbstractContextManager: ...
    def state(self) -> tuple[dict, float, dict | None] | None: ...
    def load(self, mine: dict, adam_step: float, scaler: dict | None) -> None: ...
    def held_nbytes(self) -> dict[str, int]: ...


def make_replicas(chunks: list[nn.Module], mesh, config) -> Replicas:
    """The stage's chunks as one module, kept equal over dp: ExpertReplicas with experts, else
    ZeRO if config.zero, else mixed precision if amp is not fp32, else data parallelism; over
    dp x cp with cp > 1 (mesh.grad_comm: each cp rank saw other tokens of the sequences)."""
    module = nn.ModuleList(chunks)
    if config.model.experts:
        return ExpertReplicas(module, mesh, config)
    mesh = replace(mesh, dp_comm=mesh.grad_comm)
    if config.zero:
        return ZeroReplicas(module, mesh, config)
    if config.amp != "fp32":
        return MixedPrecisionReplicas(module, mesh, config)
    return DataParallelReplicas(module, mesh, config)


class DataParallelReplicas:
    """fp32: the gradients all-reduced once, after the whole pipeline step; AdamW on each rank."""

    def __init__(self, module: nn.ModuleList, mesh, config):
        self.module, self.dp_comm = module, mesh.dp_comm
        self.scaler = make_scaler(config.amp)
        self.dp = DataParallelBucketed(module, mesh.dp_comm)
        self.optimizer = grouped_optimizer(config, module)()

    @property
    def scale(self) -> float:
        return self.scaler.scale

    def accumulating(self):
        return self.dp.no_sync()  # the pipeline's microbatches accumulate; one all-reduce

    def on_backward(self, op) -> None:
        pass  # the gradients accumulate in .grad

    def step(self) -> bool:
        self.dp.finish_gradient_sync()
        self.optimizer.step()
        self.zero_grad()
        return True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        self.module.zero_grad(set_to_none=True)

    def gathered(self):
        return contextlib.nullcontext()

    def state(self):
        if self.dp_comm.rank != 0:
            return None  # every replica holds the same
        params = _trainable(self.module)
        values, adam_step = _adam_state(params, [q for _, q in params], self.optimizer)
        return values, adam_step, None

    def load(self, mine: dict, adam_step: float, scaler: dict | None) -> None:
        params = _trainable(self.module)
        _load_adam(mine, adam_step, params, [q for _, q in params], self.optimizer)

    def held_nbytes(self) -> dict[str, int]:
        return _held(self.module, self.optimizer, [])


class MixedPrecisionReplicas:
    """bf16/fp16 compute: fp32 masters and a loss scale (MixedPrecisionOptimizer), the
    gradients accumulated per microbatch in float32, all-reduced over dp in step()."""

    def __init__(self, module: nn.ModuleList, mesh, config):
        self.module, self.dp_comm = module, mesh.dp_comm
        self.scaler = make_scaler(config.amp)
        self.mp = MixedPrecisionOptimizer(
            module,
            grouped_optimizer(config, module),
            config.precision,
            self.scaler,
            dp_comm=mesh.dp_comm,
            overflow_comm=mesh.world,  # every stage and tp rank skips the same steps
        )
        self.optimizer = self.mp

    @property
    def scale(self) -> float:
        return self.scaler.scale

    def accumulating(self):
        return contextlib.nullcontext()

    def on_backward(self, op) -> None:
        self.mp.collect()  # into the float32 buffer: accumulate in float32, not bf16

    def step(self) -> bool:
        stepped = self.mp.step()
        self.zero_grad()
        return stepped

    def zero_grad(self) -> None:
        self.mp.zero_grad()
        self.module.zero_grad(set_to_none=True)

    def gathered(self):
        return contextlib.nullcontext()

    def state(self):
        if self.dp_comm.rank != 0:
            return None
        values, adam_step = _adam_state(_trainable(self.module), self.mp.master, self.mp.optimizer)
        return values, adam_step, self.scaler.state_dict()

    def load(self, mine: dict, adam_step: float, scaler: dict | None) -> None:
        _load_adam(mine, adam_step, _trainable(self.module), self.mp.master, self.mp.optimizer)
        if scaler is not None:
            self.scaler.load_state_dict(scaler)

    def held_nbytes(self) -> dict[str, int]:
        return _held(self.module, self.mp.optimizer, list(self.mp.master))


class ZeroReplicas:
    """ZeRO-1/2/3 over dp (zero.wrap), with its own masters and scaler; the overflow skip
    agreed by the whole world."""

    def __init__(self, module: nn.ModuleList, mesh, config):
        self.module, self.stage = module, config.zero
        self.master_dtype = config.precision.master
        self.zero = zero_.wrap(
            module,
            mesh.dp_comm,
            make_optimizer(config),
            config.zero,
            param_groups=decay_groups(module),
            precision=config.precision,
            scaler=make_scaler(config.amp),
            overflow_comm=mesh.world,  # every stage and tp rank skips the same steps
        )
        self.optimizer, self.scaler = self.zero.optimizer, self.zero.scaler

    @property
    def scale(self) -> float:
        return self.scaler.scale

    def accumulating(self):
        return contextlib.nullcontext()

    def on_backward(self, op) -> None:
        if self.stage >= 2:
            self.zero.finish_gradient_sync()  # this microbatch's gradients, reduce-scattered

    def step(self) -> bool:
        stepped = self.zero.step()
        self.zero_grad()
        return stepped

    def zero_grad(self) -> None:
        self.zero.zero_grad()
        self.module.zero_grad(set_to_none=True)

    def gathered(self):
        return self.zero.gathered()

    def state(self):
        state = self.zero.state_dict(dst=0)  # collective over dp: consolidated on its rank 0
        if state is None:
            return None
        optim = state["optimizer"]
        steps = [float(v["step"]) for v in optim.values() if "step" in v]
        values = {}
        for name, _ in _trainable(self.module):
            moments = optim.get(name, {})
            values[name] = {"value": state["model"][name], **{k: moments.get(k) for k in MOMENTS}}
        return values, max(steps, default=0.0), state.get("scaler")

    def load(self, mine: dict, adam_step: float, scaler: dict | None) -> None:
        step = torch.tensor(adam_step, dtype=torch.float32)
        names = [name for name, _ in _trainable(self.module)]
        optimizer = {}
        for n in names:  # the optimizer's state is in the masters' dtype
            moments = {k: mine[n][k].to(self.master_dtype) for k in MOMENTS}
            optimizer[n] = {"step": step.clone(), **moments}
        state = {
            "model": {n: mine[n]["value"] for n in names},
            "elementwise": list(MOMENTS),
            "optimizer": optimizer,
        }
        if scaler is not None:
            state["scaler"] = scaler
        self.zero.load_state_dict(state, src=0)  # collective over dp

    def held_nbytes(self) -> dict[str, int]:
        return memory_nbytes(self.zero)


class ExpertReplicas:
    """Data parallel replicas of an MoE model (fp32, no ZeRO): AdamW on each rank; step() sums
    each gradient over its replicas by hand (dense: grad_comm, dp x cp; each block's router: ep,
    edp, cp, every rank; its experts: edp, cp), then divides all by dp cp: their mean."""

    def __init__(self, module: nn.ModuleList, mesh, config):
        self.module, self.mesh, self.ranks = module, mesh, config.dp * config.cp
        self.scaler = make_scaler(config.amp)
        self.optimizer = grouped_optimizer(config, module)()
        self.moes = [m for m in module.modules() if isinstance(m, (MoE, ExpertParallelMoE))]
        routed = {id(q) for moe in self.moes for q in moe.parameters()}
        self.dense = [q for q in module.parameters() if id(q) not in routed]

    @property
    def scale(self) -> float:
        return self.scaler.scale

    def accumulating(self):
        return contextlib.nullcontext()  # the microbatches accumulate; one reduction a step

    def on_backward(self, op) -> None:
        pass

    def step(self) -> bool:
        mesh = self.mesh
        for q in self.dense:
            mesh.grad_comm.all_reduce(_grad_or_zeros(q), "sum")
        for moe in self.moes:  # ep = 1: no ep_comm, and the experts' replicas are all of dp
            sync_grads(moe, mesh.ep_comm, mesh.dp_comm if mesh.edp_comm is None else mesh.edp_comm)
            sync_grads(moe, None, mesh.cp_comm)  # router and experts: cp saw other tokens
        for q in self.module.parameters():
            q.grad.div_(self.ranks)  # sums over every dp (x cp) rank's loss: their mean
        self.optimizer.step()
        self.zero_grad()
        return True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        self.module.zero_grad(set_to_none=True)

    def gathered(self):
        return contextlib.nullcontext()

    def state(self, *_):  # never called: the CLI refuses checkpoints of runs with experts
        raise ValueError("checkpoints of a run with experts are not supported")

    load = state

    def held_nbytes(self) -> dict[str, int]:
        return _held(self.module, self.optimizer, [])


def _grad_or_zeros(q: nn.Parameter) -> torch.Tensor:
    """q.grad, zeros if backward left none (every rank must reduce the same tensors)."""
    if q.grad is None:
        q.grad = torch.zeros_like(q)
    return q.grad


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, q) for n, q in module.named_parameters() if q.requires_grad]


def _adam_state(params: list, weights: list, optimizer) -> tuple[dict, float]:
    """({name: {"value", "exp_avg", "exp_avg_sq"}}, AdamW's step) of the tensors the optimizer
    steps (the parameters, or their masters), None where AdamW has not made its state yet."""
    values, steps = {}, [0.0]
    for (name, _), w in zip(params, weights, strict=True):
        st = optimizer.state.get(w, {})
        values[name] = {"value": w.detach(), **{k: st.get(k) for k in MOMENTS}}
        if "step" in st:
            steps.append(float(st["step"]))
    return values, max(steps)


def _load_adam(mine: dict, adam_step: float, params: list, weights: list, optimizer) -> None:
    """Copy mine's values into the stepped tensors (and the model: the master rounded), and
    AdamW's moments into the optimizer (none before the first step, as AdamW starts)."""
    step = torch.tensor(adam_step, dtype=torch.float32)
    with torch.no_grad():
        for (name, q), w in zip(params, weights, strict=True):
            w.copy_(mine[name]["value"])
            q.copy_(w)
            if adam_step > 0:
                moments = {k: mine[name][k].to(w.device, w.dtype) for k in MOMENTS}
                optimizer.state[w] = {"step": step.clone(), **moments}


def _held(module: nn.Module, optimizer, masters: list) -> dict[str, int]:
    state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    state += masters
    return {
        "params": storage_nbytes(list(module.parameters())),
        "optimizer": storage_nbytes([t for t in state if t.dim() > 0]),  # not AdamW's 0-d steps
    }
