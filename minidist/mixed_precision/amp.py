"""Mixed precision: run the model in bfloat16 or float16, keep float32 master weights for the
optimizer, and scale the loss so that float16 gradients neither underflow nor, unnoticed,
overflow.

Equals: float32 training within a tolerance set by the number format, not by the code (unit
roundoff u = 2^-8 for bfloat16, 2^-11 for float16; tests/test_amp.py documents the bound it
measures on a small model). With every dtype float64, exactly the float64 (data-parallel)
program: 1e-12 relative, loss scaling by powers of two being exact.
Communication per step, per rank (p ranks, N parameters), with a dp comm: one all-reduce of N
gradient elements in Precision.reduce (float32 by default: the ring sends 2(p-1)/p * 4N
bytes), plus one all-reduce of one float32 on overflow_comm (default the dp comm): the
overflow flag, so that every rank skips the same steps. Inside ZeRO (zero/stages.py): a
reduce-scatter in Precision.reduce, all-gathers in Precision.compute (bfloat16: half the bytes).
Memory per rank, bytes per parameter (Adam): model 2 + its gradient 2 + master 4 + float32
gradient buffer 4 + Adam state 8 = 20 (float32 training: 4 + 4 + 8 = 16). Mixed precision
does not shrink model state; it halves the activations and the model copy. (Micikevicius et al.
count 16 by keeping only float16 gradients; the float32 buffer here is what makes gradient
accumulation over microbatches exact to float32.) With ZeRO the 20 shrink by sharding: masters,
Adam state and float32 gradients live on one rank each: 4 + 12/p (ZeRO-1), 2 + 16/p (ZeRO-2),
18/p (ZeRO-3) bytes per parameter (zero/cost.py; the paper's 16/p keeps 16-bit gradient shards).
Loss scaling: gradients are computed for scale * loss, so small ones stay above float16's
smallest number (2^-24); divided by scale in float32 afterwards. Dynamic: a step with any inf
or nan is skipped and the scale halved; after growth_interval clean steps in a row it doubles.
bfloat16 has float32's exponent range and needs no scaling (scale 1, still skipping inf/nan).
Ladder: cast model + master weights (bfloat16) -> loss scale (float16) -> dynamic loss scale ->
gradients reduced across dp ranks in float32, the skip agreed by all ranks (overflow_comm: all
ranks of a 3D job) -> inside ZeRO: master shards (zero.wrap(..., precision, scaler)).
Paper: Micikevicius et al., Mixed Precision Training (ICLR 2018), sections 3.1 (master
weights) and 3.2 (loss scaling).   Lesson: lessons/09_mixed_precision/.
Run: python lessons/09_mixed_precision/demo.py

Usage (no DataParallel wrapper: give dp_comm here and the gradients are reduced in float32):

    mp = MixedPrecisionOptimizer(model, lambda ps: torch.optim.AdamW(ps, 1e-3), FP16,
                                 LossScaler(2.0**16), dp_comm=comm)     # casts model to fp16
    mp.zero_grad()
    loss = loss_fn(model(x_local.to(torch.float16)).float(), y_local)   # loss in float32
    mp.backward(loss)                        # (scale * loss).backward(); grads -> fp32 buffer
    stepped = mp.step()                      # reduce, unscale, agree on inf/nan, maybe step

ZeRO composes these building blocks itself instead of MixedPrecisionOptimizer (a sharded
optimizer must: each rank holds other gradients): Precision (the dtypes), LossScaler
(scale_loss before backward, update), skip_step(grad_shards, scaler, overflow_comm) (each rank
checks its own shards, all agree). Pass the same precision and scaler to zero.wrap:

    z = zero.wrap(model, dp_comm, torch.optim.AdamW, 2, {"lr": 1e-3}, precision=FP16,
                  scaler=LossScaler(2.0**16), overflow_comm=world)   # masters: fp32 shards
    z.backward(loss)                         # (scale * loss).backward()
    stepped = z.step()                       # False on every rank of overflow_comm on inf/nan
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Precision:
    """The dtype of each role: the model copy, the optimizer's weights, the gradient sum."""

    compute: torch.dtype = torch.float32  # parameters, activations, gradients of the model
    master: torch.dtype = torch.float32  # the weights the optimizer updates, its state
    reduce: torch.dtype = torch.float32  # gradients are summed across dp ranks in this dtype


FP32 = Precision(torch.float32)
BF16 = Precision(torch.bfloat16)
FP16 = Precision(torch.float16)
PRECISIONS = {"fp32": FP32, "bf16": BF16, "fp16": FP16}


class LossScaler:
    """The loss scale: halved (backoff_factor) on a step with inf/nan, doubled (growth_factor)
    after growth_interval clean steps in a row. dynamic=False keeps it fixed.

    Fails early, with the numbers, when the scale falls below min_scale: then the loss or the
    gradients overflow on their own, and no scale can help.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        dynamic: bool = True,
        min_scale: float = 2.0**-24,
    ):
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(
                f"need growth_factor={growth_factor} > 1, 0 < backoff_factor={backoff_factor}"
                f" < 1 and growth_interval={growth_interval} >= 1"
            )
        self.scale, self.clean_steps = float(init_scale), 0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.dynamic = dynamic
        self.min_scale = min_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """scale * loss, in float32 at least (a float16 loss times 2^16 would overflow)."""
        return loss.to(torch.promote_types(loss.dtype, torch.float32)) * self.scale

    def update(self, found_inf: bool) -> None:
        """After a step: back off if it overflowed, grow after growth_interval clean ones."""
        if not self.dynamic:
            return
        # lab 09.2 begin: on inf back off and restart the count; else count, grow at the interval
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0
        # lab 09.2 end
        if self.scale < self.min_scale:
            raise FloatingPointError(
                f"loss scale fell to {self.scale:g} < min_scale={self.min_scale:g}: the loss "
                "or its gradients are inf/nan at any scale"
            )

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]


def found_nonfinite(tensors: list[torch.Tensor], comm=None) -> bool:
    """True if any element of `tensors`, on any rank of `comm`, is inf or nan.

    Collective on comm (when given): one all-reduce (max) of one float32, so every rank returns
    the same answer and skips the same steps, even when each holds other gradients (ZeRO's
    shards) or only one rank overflowed.
    """
    device = tensors[0].device if tensors else torch.device("cpu")
    # lab 09.1 begin: a local 0/1 flag over the tensors, then the max over comm
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    for t in tensors:
        flag = torch.maximum(flag, (~torch.isfinite(t)).any().float())
    if comm is not None:
        comm.all_reduce(flag, "max")
    return bool(flag.item())
    # lab 09.1 end


def skip_step(grads: list[torch.Tensor], scaler: LossScaler, comm=None) -> bool:
    """Whether to skip this step: found_nonfinite(grads, comm), each rank checking its own
    gradients (ZeRO: its shards) and every rank answering the same; the scale is updated
    either way. Collective on comm: all_reduce(1 float32)."""
    found = found_nonfinite(grads, comm)
    scaler.update(found)
    return found


def master_copy(params: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> list:
    """New leaf parameters: `dtype` copies of params (take them before casting the model)."""
    return [nn.Parameter(p.detach().to(dtype, copy=True)) for p in params]


class MixedPrecisionOptimizer:
    """A torch optimizer over float32 master weights, for a model cast to precision.compute.

    dp_comm, the data-parallel group: construction broadcasts rank 0's parameters and buffers
    over it (replicas start equal), then copies the masters and casts the model in place
    (module.to keeps each Parameter object); every step agrees on inf/nan over it and, with
    reduce_gradients, all-reduces the gradients in precision.reduce. reduce_gradients=False
    leaves the reduction to a DataParallel wrapper put around the model *after* this cast (its
    buckets then hold, and sum, the compute dtype). Parameters that got no gradient count as
    zero gradient (weight decay still moves them; a plain torch optimizer skips them).
    overflow_comm: the ranks that agree on skipping a step (default dp_comm). A job with
    pipeline or tensor parallelism passes the whole world: each rank then holds other
    parameters' gradients, and a step skipped by some stages only would tear the model apart.
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: Callable[[list], torch.optim.Optimizer],
        precision: Precision = BF16,
        scaler: LossScaler | None = None,
        dp_comm=None,
        reduce_gradients: bool = True,
        overflow_comm=None,
    ):
        self.params = [p for p in model.parameters() if p.requires_grad]
        if dp_comm is not None:
            with torch.no_grad():
                for t in [*model.parameters(), *model.buffers()]:
                    dp_comm.broadcast(t.data, 0)
        self.master = master_copy(self.params, precision.master)
        model.to(precision.compute)
        self.precision = precision
        self.dp_comm = dp_comm
        self.reduce_gradients = reduce_gradients
        self.overflow_comm = dp_comm if overflow_comm is None else overflow_comm
        self.scaler = scaler or LossScaler(1.0, dynamic=False)
        self.optimizer = make_optimizer(self.master)
        n = sum(p.numel() for p in self.params)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.grad_flat = torch.zeros(n, dtype=precision.master, device=device)  # (N,)
        views = self.grad_flat.split([p.numel() for p in self.params])
        for m, view in zip(self.master, views, strict=True):
            m.grad = view.view_as(m)  # the optimizer reads the buffer in place
        self.skipped: list[int] = []  # the steps skipped for inf/nan, counted from 0
        self.steps = 0

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups: an LR scheduler drives this wrapper like an optimizer."""
        return self.optimizer.param_groups

    def backward(self, loss: torch.Tensor) -> None:
        """(scale * loss).backward(), then add the model's gradients to the float32 buffer."""
        self.scaler.scale_loss(loss).backward()
        self.collect()

    def collect(self) -> None:
        """grad_flat += the model's (low-precision) gradients, cast up; then free those. Call
        it after each microbatch's backward when something else ran backward (a pipeline
        schedule), so microbatches accumulate in float32, not in the compute dtype."""
        for param, master in zip(self.params, self.master, strict=True):
            if param.grad is not None:
                master.grad.add_(param.grad)  # cast up exactly, summed in float32
                param.grad = None

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None
        self.grad_flat.zero_()

    def step(self) -> bool:
        """Reduce over dp_comm, unscale, agree on inf/nan; step the masters and copy them into
        the model unless some rank overflowed. True if the step was taken.

        Collectives: all_reduce(N in precision.reduce) on dp_comm (if reduce_gradients),
        all_reduce(1 float32) on overflow_comm.
        """
        self.collect()  # gradients left by a plain loss.backward() (or a DataParallel wrapper)
        if self.dp_comm is not None and self.reduce_gradients:
            self._all_reduce_mean()
        stepped = self._unscale_and_step()
        self.steps += 1
        self.grad_flat.zero_()
        return stepped

    def _unscale_and_step(self) -> bool:
        """Unscale grad_flat; agree with every dp rank on inf/nan; update the scale; unless some
        rank overflowed, step the masters and round them into the model. True if stepped."""
        # lab 09.3 begin: unscale grad_flat, agree on inf/nan, update the scaler, step unless inf
        self.grad_flat.mul_(1.0 / self.scaler.scale)  # exact: the scale is a power of two
        found_inf = found_nonfinite([self.grad_flat], self.overflow_comm)
        self.scaler.update(found_inf)
        if found_inf:
            self.skipped.append(self.steps)
            return False
        self.optimizer.step()
        with torch.no_grad():
            for param, master in zip(self.params, self.master, strict=True):
                param.copy_(master)  # round the updated master to the model's dtype
        return True
        # lab 09.3 end

    def _all_reduce_mean(self) -> None:
        """grad_flat <- (1/p) sum over dp ranks, the sum taken in precision.reduce."""
        p = self.dp_comm.world_size
        if self.precision.reduce == self.grad_flat.dtype:
            self.dp_comm.all_reduce(self.grad_flat, "sum")
        else:  # e.g. bfloat16: half the bytes, about 3 significant digits in the sum
            low = self.grad_flat.to(self.precision.reduce)
            self.dp_comm.all_reduce(low, "sum")
            self.grad_flat.copy_(low)
        self.grad_flat.div_(p)
