"""ZeRO: data parallelism that keeps each shard of the model state on one rank instead of all.

Equals: one process training on the whole batch with the same torch optimizer (SGD, Adam,
AdamW; any elementwise one), the loss a mean over the batch and each rank's loss the mean over
its equal share. float64: 1e-12 relative (the batch is summed in another order); every rank's
optimizer state equals the matching slice of that one process's state. So does mixed precision
with every dtype float64 and a power-of-two loss scale, skipping the same steps.
Communication per step, per rank (p ranks, Psi trainable elements of b bytes, with the ring):
ZeRO-1/2 reduce-scatter the gradients and all-gather the parameters: 2 (p-1)/p Psi b, what
data parallelism's all-reduce sends; ZeRO-3 3 (p-1)/p Psi b (zero/gatherer.py). Plus an all-reduce
of one "used" flag per parameter, as in data_parallel. Mixed precision: all-gathers in the compute
dtype (bfloat16: half the bytes), the reduce-scatter in the reduce dtype, + 1 float32 (skip).
Memory per rank (k optimizer states per element, Adam k=2): data parallel (2 + k) Psi b;
ZeRO-1 (2 + k/p) Psi b; ZeRO-2 (1 + (1+k)/p) Psi b; ZeRO-3 (2 + k)/p Psi b. Mixed precision:
the paper's 2 + 2 + 12 bytes per element, and what this code holds: zero/gatherer.py.
Ladder: partition (flat buffers cut into p equal shards) -> ZeRO1 (each rank steps only its
shard of the optimizer state, then all-gathers the parameters) -> ZeRO2 (gradients
reduce-scattered bucket by bucket during backward) -> ZeRO3 (zero/gatherer.py: parameters sharded,
gathered layer by layer) -> clip_grad_norm_, param groups and state_dict / load_state_dict
(any world size: zero/state.py) -> mixed precision (float32 master shards, loss scaling).
Paper: Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion Parameter Models
(SC 2020), sections 5 and 7.   Lesson: lessons/07_zero/.   Run: minidist run -n 4 --backend mpi
lessons/07_zero/demo.py

Usage, any stage (mixed precision: add precision=BF16, or FP16 and scaler=LossScaler()):

    zero = wrap(model, comm, torch.optim.AdamW, stage=2, optimizer_kwargs={"lr": 1e-3})
    loss = loss_fn(zero(x_local), y_local)     # x_local: (B/p, ...), this rank's share
    zero.backward(loss)                        # (scale *) loss.backward(): reduce-scatters start
    zero.clip_grad_norm_(1.0)                  # optional: the global norm across shards
    stepped = zero.step()                      # waits for the gradients, steps, all-gathers
    zero.zero_grad()

Decisions a user must know:
- Parameters are grouped in *units* (ZeRO-1: one; ZeRO-2: buckets of bucket_bytes in backward
  order; ZeRO-3: one per module). A unit's parameters are laid end to end in one flat buffer,
  padded to a multiple of p, and rank r owns elements [r S, (r+1) S); a shard boundary may fall
  inside a parameter. The model's parameters become views into the flat buffers.
- Frozen parameters and buffers stay whole on every rank, rank 0's at wrap time (broadcast).
- param_groups (torch's list of dicts, naming parameters): each piece steps with its group's.
- A parameter with no gradient on any rank keeps none (the optimizer skips it, as in one
  process); with no gradient on some ranks only, those count zero.
- Gradient accumulation: call finish_gradient_sync() after each backward; shards accumulate.
- Mixed precision (mixed_precision/amp.py): the model is cast to precision.compute, the optimizer
steps master
  shards; gradient shards land averaged, unscaled (clipping sees true values), in the master
  dtype. step() returns False on every rank of overflow_comm (default dp_comm) on any inf/nan;
  a 3D job passes the world, so every pipeline stage and tensor-parallel rank skips with it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from minidist.collectives.overlap import Launcher
from minidist.mixed_precision.amp import LossScaler, Precision, skip_step
from minidist.zero import gatherer

# re-exported: the state of any stage, consolidated on one rank and cut again (zero/state.py)
from minidist.zero.state import consolidate as consolidate
from minidist.zero.state import load_consolidated as load_consolidated
from minidist.zero.state import make_optimizer
from minidist.zero.units import Unit


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of parameter `index` (flattened) live at shard[at : at + hi - lo]."""

    index: int
    lo: int
    hi: int
    at: int


@dataclass(frozen=True)
class Plan:
    """Tensors of `numels` elements laid end to end, padded to p * shard_numel, cut in p."""

    numels: tuple[int, ...]
    world_size: int

    @property
    def shard_numel(self) -> int:
        return -(-sum(self.numels) // self.world_size)  # ceil: the padding is < p elements

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def offsets(self) -> list[int]:
        """Where each tensor starts in the flat buffer."""
        return [sum(self.numels[:i]) for i in range(len(self.numels))]

    def pieces(self, rank: int) -> list[Piece]:
        """The parts of tensors in rank's shard [rank S, (rank+1) S), in order; no empty ones."""
        # lab 07.1 begin: intersect each tensor's range [off, off+n) with this rank's shard
        first, last = rank * self.shard_numel, (rank + 1) * self.shard_numel
        found = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            lo, hi = max(off, first), min(off + n, last)
            if lo < hi:
                found.append(Piece(i, lo - off, hi - off, lo - first))
        # lab 07.1 end
        return found


def partition(numels: list[int], world_size: int) -> Plan:
    """The plan for one unit: which elements of which tensor each of world_size ranks owns."""
    if world_size < 1 or any(n < 0 for n in numels):
        raise ValueError(f"need world_size >= 1 and sizes >= 0, got {world_size}, {numels}")
    return Plan(tuple(numels), world_size)


def group_by_bytes(params: list, bucket_bytes: int | None) -> list[list]:
    """Consecutive parameters in buckets of at least bucket_bytes (None: one bucket); a bucket
    also closes where dtype or device changes (a flat buffer holds one)."""
    groups, filled = [], 0
    for q in params:
        full = bucket_bytes is not None and filled >= bucket_bytes
        if not groups or full or (q.dtype, q.device) != (groups[-1][0].dtype, groups[-1][0].device):
            groups.append([])
            filled = 0
        groups[-1].append(q)
        filled += q.numel() * q.element_size()
    return groups


class ZeRO1(nn.Module):
    """Stage 1: the optimizer state is sharded; each rank steps only its shard of every unit.

    The optimizer (a real torch one) gets views into this rank's shard as its parameters, one
    per Piece: a parameter without a gradient is skipped exactly as in one process. After
    backward, finish_gradient_sync reduce-scatters each unit's gradients (rank r receives the
    sum over ranks of its shard); step() all-gathers the updated shards into every rank's model.
    Mixed precision (precision or scaler given): the optimizer steps master shards instead.
    """

    own_shard = False  # ZeRO-3 keeps only the shard of the parameters

    def __init__(
        self,
        module: nn.Module,
        comm,
        optimizer,
        optimizer_kwargs: dict | None = None,
        bucket_bytes: int | None = None,
        algorithm: str = "library",
        groups: list[list[nn.Parameter]] | None = None,
        param_groups: list[dict] | None = None,
        precision: Precision | None = None,
        scaler: LossScaler | None = None,
        overflow_comm=None,
    ):
        super().__init__()
        self.module, self.comm = module, comm
        self.launcher = Launcher(comm, algorithm)
        trainable = [q for q in module.parameters() if q.requires_grad][::-1]  # backward order
        if not trainable:
            raise ValueError(f"{type(module).__name__} has no trainable parameters to shard")
        self.mixed = precision is not None or scaler is not None  # scaler alone: no masters
        self.scaler = scaler or LossScaler(1.0, dynamic=False)  # 1.0: no scaling
        self.overflow_comm = comm if overflow_comm is None else overflow_comm
        self.steps, self.skipped = 0, []  # skipped: the steps skipped for inf/nan, from 0
        groups = groups if groups is not None else group_by_bytes(trainable, bucket_bytes)
        plans = [partition([q.numel() for q in g], comm.world_size) for g in groups]
        self.units = [
            Unit(g, plan, comm, self.own_shard, precision)
            for g, plan in zip(groups, plans, strict=True)
        ]
        self.where = {id(q): (u, i) for u in self.units for i, q in enumerate(u.params)}
        if len(self.where) != len(trainable):
            raise ValueError(f"groups hold {len(self.where)} of {len(trainable)} parameters")
        names = {id(q): n for n, q in module.named_parameters()}
        self.names = [[names[id(q)] for q in u.params] for u in self.units]
        with torch.no_grad():  # frozen parameters and buffers: rank 0's, whole, everywhere
            for t in [*(q for q in module.parameters() if not q.requires_grad), *module.buffers()]:
                comm.broadcast(t.data, 0)
                if precision is not None and t.is_floating_point():
                    t.data = t.data.to(precision.compute)  # the model runs in one dtype
        self.optimizer, self.group_of = make_optimizer(  # over this rank's pieces
            module, self.units, optimizer, optimizer_kwargs, param_groups
        )
        self.next_launch = 0
        self.in_flight = []
        self.pending = False
        for q in trainable:
            # fires once per backward, after q.grad holds this backward's full gradient
            q.register_post_accumulate_grad_hook(self._on_grad)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad(self, param: nn.Parameter) -> None:
        unit, i = self.where[id(param)]
        unit.ready[i] = True
        self.pending = True

    def _launch_ready(self, all_remaining: bool) -> None:
        """Launch units in order while the next one is complete (or all, at the end): every
        rank issues the same collectives in the same order, whatever its data used."""
        while self.next_launch < len(self.units):
            unit = self.units[self.next_launch]
            if not (all_remaining or all(unit.ready)):
                return
            for earlier in self.in_flight:  # at most one unit's full gradient in flight
                self._land(earlier)
            self.in_flight = [unit]
            self._launch(unit)
            self.next_launch += 1

    def _launch(self, unit: Unit) -> None:
        """Copy the unit's gradients into a padded flat buffer, free them, reduce-scatter."""
        # lab 07.2 begin: fill unit.grad_flat (zeros where no grad), note unit.used, free .grad
        unit.grad_flat = unit.flat.new_zeros(unit.flat.shape, dtype=unit.dtypes.reduce)  # (p S,)
        for i, (q, off) in enumerate(zip(unit.params, unit.plan.offsets, strict=True)):
            unit.used[i] = float(q.grad is not None)
            if q.grad is not None:
                unit.grad_flat[off : off + q.numel()].copy_(q.grad.reshape(-1))
                q.grad = None  # the full gradient goes: only this rank's shard will stay
        unit.recv = unit.grad_flat.new_empty(unit.shard.shape)  # (S,)
        unit.work = self.launcher.reduce_scatter(unit.recv, unit.grad_flat)
        # lab 07.2 end

    def _land(self, unit: Unit) -> None:
        """Wait for a unit's reduce-scatter; add the average into its gradient shard, in the
        master dtype (microbatches accumulate there) and unscaled: clipping sees true values."""
        unit.work.wait()
        # the mean over ranks' means: the batch mean; unscaled, exactly for a power-of-two scale
        mean = unit.recv.to(unit.dtypes.master).div_(self.comm.world_size * self.scaler.scale)
        unit.grad_shard = mean if unit.grad_shard is None else unit.grad_shard.add_(mean)
        unit.work = unit.grad_flat = unit.recv = None

    def finish_gradient_sync(self) -> None:
        """Launch what is left, wait for all, and hand the optimizer its gradient shards."""
        if not self.pending:
            return
        self._launch_ready(all_remaining=True)
        for unit in self.in_flight:
            self._land(unit)
        flags = torch.cat([u.used for u in self.units])  # (P,) 1 where this rank had a grad
        self.launcher.all_reduce(flags).wait()  # now: on how many ranks
        at = 0
        for unit in self.units:
            n = len(unit.params)
            mine = flags[at : at + n].tolist()
            unit.has_grad = [h or f > 0 for h, f in zip(unit.has_grad, mine, strict=True)]
            at += n
            for piece, t in zip(unit.pieces, unit.tensors, strict=True):
                view = unit.grad_shard[piece.at : piece.at + t.numel()]
                t.grad = view if unit.has_grad[piece.index] else None
            unit.ready = [False] * n
        self.next_launch = 0
        self.in_flight = []
        self.pending = False

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so their global 2-norm is at most max_norm; return the norm.

        The norm needs every shard: a sum of squares per rank (in float64), then an all-reduce
        of one number. The formula of torch.nn.utils.clip_grad_norm_ (coefficient <= 1).
        """
        self.finish_gradient_sync()
        grads = [t.grad for u in self.units for t in u.tensors if t.grad is not None]
        # lab 07.3 begin: sum of squares of this rank's shard, all-reduce it, scale by the coef
        squares = torch.zeros(1, dtype=torch.float64, device=self.units[0].flat.device)
        for g in grads:
            squares += g.double().pow(2).sum()
        self.launcher.all_reduce(squares).wait()
        norm = squares.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        # lab 07.3 end
        return norm[0]

    def backward(self, loss: torch.Tensor) -> None:
        """(scale * loss).backward(): with a loss scaler, call this instead of loss.backward()."""
        self.scaler.scale_loss(loss).backward()

    def step(self) -> bool:
        """Finish the gradients, step this rank's shard, make every rank's parameters whole.
        Mixed precision: all ranks skip that (return False) if any gradient anywhere is inf/nan."""
        self.finish_gradient_sync()
        self.steps += 1
        shards = [u.grad_shard for u in self.units if u.grad_shard is not None]
        if self.mixed and skip_step(shards, self.scaler, self.overflow_comm):
            self.skipped.append(self.steps - 1)  # masters, optimizer state, model: unchanged
            return False
        self.optimizer.step()
        self.publish()
        return True

    def publish(self) -> None:
        """All-gather each unit's updated shard into every rank's flat buffer (the model);
        mixed precision: the master shard rounded to the compute dtype (fewer bytes)."""
        # copies, as a collective's input may not overlap its output (MPI); rounded if mixed
        mine = [u.stepped.to(u.flat.dtype, copy=True) for u in self.units]  # (S,) each
        works = [self.launcher.all_gather(u.flat, x) for u, x in zip(self.units, mine, strict=True)]
        for work in works:
            work.wait()

    def zero_grad(self) -> None:
        """Drop every gradient: the shards, the optimizer's views and any left in the model."""
        for unit in self.units:
            unit.grad_shard, unit.has_grad = None, [False] * len(unit.params)
            for t in [*unit.params, *unit.tensors]:
                t.grad = None

    def gathered(self):
        """A context in which every parameter holds its full value (ZeRO-3 gathers them)."""
        return contextlib.nullcontext()

    def shard_pieces(self) -> list[tuple[str, int, int, torch.Tensor]]:
        """(parameter name, lo, hi, the optimizer's tensor) for every piece this rank owns."""
        return [
            (self.names[k][c.index], c.lo, c.hi, t)
            for k, u in enumerate(self.units)
            for c, t in zip(u.pieces, u.tensors, strict=True)
        ]

    def state_dict(self, dst: int = 0) -> dict | None:
        """The full state, consolidated on rank dst (None elsewhere): consolidate."""
        return consolidate(self, dst)

    def load_state_dict(self, state: dict | None, src: int = 0) -> None:
        """Load a consolidated state given on rank src, into a world of any size and stage."""
        load_consolidated(self, state, src)


class ZeRO2(ZeRO1):
    """Stage 2: gradients are sharded too. Each unit (a bucket of bucket_bytes, in backward
    order) is reduce-scattered the moment its last gradient arrives, overlapping the rest of
    backward, and its full gradients are freed: a rank never holds more than the gradients of
    the unit being filled, one unit in flight, and its shards."""

    def __init__(self, module: nn.Module, comm, optimizer, optimizer_kwargs=None, **options):
        options.setdefault("bucket_bytes", 1 << 20)
        super().__init__(module, comm, optimizer, optimizer_kwargs, **options)

    def _on_grad(self, param: nn.Parameter) -> None:
        unit, _ = self.where[id(param)]
        if self.units.index(unit) < self.next_launch:
            raise RuntimeError(
                "a gradient arrived after its unit was reduce-scattered: call "
                "finish_gradient_sync() (or step()) after each backward"
            )
        super()._on_grad(param)
        self._launch_ready(all_remaining=False)


class ZeRO3(ZeRO2):
    """Stage 3: each rank keeps only its shard of each unit's parameters (own_shard); a unit is
    gathered just before its module's forward and backward and freed after (gatherer.Gatherer).
    units: the modules whose parameters are gathered together (gatherer.unit_groups); prefetch:
    start gathering the next unit while this one computes. Other options as ZeRO1's."""

    own_shard = True

    def __init__(
        self, module, comm, optimizer, optimizer_kwargs=None, units=None, prefetch=True, **options
    ):
        if "bucket_bytes" in options or "groups" in options:
            raise TypeError("ZeRO3's units are modules (units=[...]), not buckets or groups")
        modules, groups = gatherer.unit_groups(module, units)  # forward order
        options["groups"] = groups[::-1]  # launched in backward order
        super().__init__(module, comm, optimizer, optimizer_kwargs, **options)
        self.gatherer = gatherer.Gatherer(
            module, modules, self.units[::-1], self.launcher, prefetch
        )

    def _on_grad(self, param: nn.Parameter) -> None:
        super()._on_grad(param)  # ZeRO-2: note it, reduce-scatter complete units in order
        unit, _ = self.where[id(param)]
        if all(unit.ready):  # autograd has used every copy of these parameters: free them
            self.gatherer.free(unit)

    def finish_gradient_sync(self) -> None:
        if self.pending:
            self.gatherer.free_all()  # a prefetched unit that was not used this step
        super().finish_gradient_sync()

    def publish(self) -> None:
        self.gatherer.publish()  # no all-gather: each forward gathers the new shards

    def gathered(self):
        return self.gatherer.gathered()


def wrap(module: nn.Module, dp_comm, optimizer, stage: int, optimizer_kwargs=None, **options):
    """ZeRO1, ZeRO2 or ZeRO3 (stage 1, 2, 3) around module over dp_comm.

    optimizer: a torch optimizer class, or any callable(tensors or groups, **optimizer_kwargs).
    options: algorithm ("library" or "ring"), bucket_bytes (1, 2), units (3: the modules whose
    parameters are gathered together), param_groups (torch's list of dicts, naming parameters:
    zero/state.py), precision, scaler, overflow_comm (mixed precision).
    """
    rungs = {1: ZeRO1, 2: ZeRO2, 3: ZeRO3}
    if stage not in rungs:
        raise ValueError(f"stage={stage} is not 1, 2 or 3 (stage 0 is data_parallel)")
    return rungs[stage](module, dp_comm, optimizer, optimizer_kwargs, **options)
