"""ZeRO-3's life of a unit: each unit's parameters live in one flat buffer cut into p shards
(units.py: Unit, every stage); ZeRO-3 keeps only the shard, gathers a unit just before its
module runs and frees it after (Gatherer), and a freed parameter refuses to be read.

Equals: one process training on the whole batch with the same torch optimizer, float64 1e-12
relative: zero.ZeRO3 is ZeRO2 with own_shard and a Gatherer (zero/stages.py: the ladder and wrap).
Communication per step, per rank (p ranks, Psi trainable elements of b bytes, ring):
all-gather of each unit before its forward and again before its backward, reduce-scatter of
its gradients: 3 (p-1)/p Psi b, 1.5x data parallelism's 2 (p-1)/p Psi b.
Memory per rank: (2 + k)/p Psi b for parameters, gradients and k optimizer states per element,
plus the full parameters of the units being used: the current one and the prefetched next.
Mixed precision (bfloat16 model, float32 masters, Adam), bytes per element, stages 0..3: the
paper's (section 3.1, figure 1) 2 + 2 + 12 -> 4 + 12/p -> 2 + 14/p -> 16/p; held here
2 + (2 + 4) + 12 -> 4 + 12/p -> 2 + 16/p -> 18/p: the gradient shard is float32, so gradient
accumulation adds in float32 (zero_cost.model_state_nbytes with m = 4). ZeRO-1 also holds its one
unit's whole gradient in the reduce dtype during the sync (ZeRO-2's buckets bound that).
Mixed precision communication: the two all-gathers move the compute dtype (bfloat16: half the
bytes), the reduce-scatter the reduce dtype: (p-1)/p Psi (2 c + r) (zero_cost.sent_nbytes).
Ladder: ZeRO1 -> ZeRO2 -> ZeRO3 (zero/stages.py; here: gather before use, free after, prefetch; a
freed parameter refuses to be read) -> the state consolidated and re-sharded (zero/state.py).
Paper: Rajbhandari et al., ZeRO (SC 2020), section 5.3 (P_os+g+p) and 7.2; the same idea is
PyTorch's FSDP (Zhao et al., VLDB 2023) with FULL_SHARD.   Lesson: lessons/07_zero/.
Run: minidist run -n 4 --backend mpi lessons/07_zero/demo.py

How a unit's parameters come and go:

    forward pre-hook   gather unit i (waits for its prefetch), start gathering unit i+1
    forward hook       free unit i; hook its outputs: their gradient means backward reached it
    output grad hook   gather unit i again, start gathering unit i-1 (backward runs in reverse)
    post-accumulate    all of unit i's gradients are in: free it, reduce-scatter them (ZeRO-2)

Which parameters a unit holds (unit_groups), as FSDP's root unit holds what no inner unit does:
- The units: by default every module that owns trainable parameters and runs a forward of its
  own, and always the root (the wrapped module); or units=[modules] and the root.
- A parameter goes to the innermost unit that contains every module registering it. So the
  parameters of a ParameterList / ParameterDict (containers: no forward, no hooks ever fire)
  go to the nearest enclosing module that runs; a weight tied between two modules (registered
  in both) goes to the unit around both uses; a parent's parameter that its children use is
  the parent's, whole during the parent's whole forward.
- What the rules cannot see, a parameter read outside its unit's forward (a parent reading a
  child's weight without calling the child), finds it freed. A freed parameter wears the class
  FreedParameter, whose __torch_function__ raises an error naming the parameter and its unit
  for any torch operation that reads it (metadata: shape, dtype, grad, ... stay readable); so
  such a read is an error, never a crash or garbage. The fix: units=[the module that reads it],
  or read it inside gathered(). A module that returns a view of its own parameters is refused.

Decisions a user must know:
- Every rank must run the same modules in the same order (the gathers are collectives), as in
  FSDP. Data-dependent control flow that differs across ranks hangs; ZeRO-1/2 allow it.
- Prefetching guesses that modules run in registration order; a wrong guess costs bytes and
  memory until the step ends, never correctness. Frozen parameters stay whole (replicated).
- Autograd's saved tensors are safe because a unit stays whole until all its gradients are in;
  a parameter saved only outside any gradient path (x @ w.detach()) is not covered.
"""

from __future__ import annotations

import contextlib
import functools
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from minidist.zero.units import Unit


class Gatherer:
    """ZeRO-3's hooks: each unit whole just before its module's forward and again before its
    backward (prefetching the next one), freed after. order[i]: the Unit of modules[i], in
    forward order; launcher: the all-gathers' (collectives/overlap.py's Launcher). The caller
    (zero.ZeRO3) frees a unit once all its gradients are in, and calls publish after each step."""

    def __init__(self, module: nn.Module, modules: list, order: list, launcher, prefetch: bool):
        self.order = order
        self.launcher = launcher
        self.prefetch = prefetch
        paths = {id(m): n for n, m in module.named_modules()}
        names = {id(q): n for n, q in module.named_parameters()}
        for i, (m, unit) in enumerate(zip(modules, order, strict=True)):
            m.register_forward_pre_hook(partial(self._before_forward, i))
            m.register_forward_hook(partial(self._after_forward, i))
            unit.label = f"unit {i} ({paths[id(m)] or 'the root'}: {type(m).__name__})"
            unit.classes = [type(q) for q in unit.params]
            for q in unit.params:  # what a FreedParameterError names
                q.zero3_name = f"parameter {names[id(q)]!r} of {unit.label}"
            wear(unit, freed=True)  # Unit freed the full buffer already

    def start_gather(self, unit: Unit) -> None:
        """Start all-gathering the unit's shards (into a landing buffer: see Unit)."""
        if is_whole(unit) or unit.landing is not None:
            return  # gathered already, or on its way
        unit.landing = torch.empty(unit.flat.shape, dtype=unit.flat.dtype, device=unit.flat.device)
        unit.gather_work = self.launcher.all_gather(unit.landing, unit.shard)

    def gather(self, unit: Unit) -> None:
        """Make the unit's parameters whole: wait for its gather, copy it into place."""
        self.start_gather(unit)
        if unit.landing is not None:
            unit.gather_work.wait()
            unit.flat.untyped_storage().resize_(unit.flat.numel() * unit.flat.element_size())
            unit.flat.copy_(unit.landing)  # (p S,): every view (the parameters) sees it
            unit.gather_work = unit.landing = None
            wear(unit, freed=False)

    def free(self, unit: Unit) -> None:
        """Release the unit's full buffer. Views into it (the parameters, tensors autograd
        saved for backward) stay valid objects and see the data again once it is re-gathered."""
        if unit.gather_work is not None:  # a prefetch may still be writing into the buffer
            unit.gather_work.wait()
            unit.gather_work = unit.landing = None
        unit.flat.untyped_storage().resize_(0)
        wear(unit, freed=True)

    def _before_forward(self, i: int, module, args) -> None:
        self.gather(self.order[i])
        if self.prefetch and i + 1 < len(self.order):
            self.start_gather(self.order[i + 1])  # overlaps with this unit's compute

    def _after_forward(self, i: int, module, args, output) -> None:
        unit, outputs = self.order[i], output if isinstance(output, (tuple, list)) else [output]
        held = unit.flat.untyped_storage().data_ptr()
        tensors = [t for t in outputs if torch.is_tensor(t)]
        if held and any(t.untyped_storage().data_ptr() == held for t in tensors):
            raise FreedParameterError(
                f"{unit.label} returned its own parameters (or a view of them), which ZeRO-3 "
                "frees after the forward"
            )
        self.free(unit)
        for t in outputs:
            if torch.is_tensor(t) and t.requires_grad:
                # fires when the output's gradient is ready: before this module's backward
                t.register_hook(partial(self._before_backward, i))

    def _before_backward(self, i: int, grad: torch.Tensor) -> None:
        self.gather(self.order[i])
        earlier = self.order[i - 1] if i > 0 else None
        if self.prefetch and earlier is not None and not all(earlier.ready):
            self.start_gather(earlier)  # the unit whose backward comes next, probably

    def free_all(self) -> None:
        """Free every unit (one prefetched but not used this step, too)."""
        for unit in self.order:
            self.free(unit)

    def publish(self) -> None:
        """After a step: no all-gather, each forward gathers the new shards (mixed precision:
        the master shard rounded into the compute-dtype shard first). A whole copy left over
        (a prefetch that no forward used) holds old values: drop it."""
        for unit in self.order:
            if unit.master is not None:
                unit.shard.copy_(unit.master)  # rounds to the compute dtype
            self.free(unit)

    @contextlib.contextmanager
    def gathered(self):
        """Every parameter whole inside the block (to evaluate, compare, save); freed after."""
        for unit in self.order:
            self.start_gather(unit)
        for unit in self.order:
            self.gather(unit)
        try:
            yield
        finally:
            self.free_all()


class FreedParameterError(RuntimeError):
    """A ZeRO-3 parameter was read while its unit was freed."""


# what a freed parameter still answers: metadata, gradients and hooks, never its values; and
# autograd may name it (autograd.backward(..., inputs=), autograd.grad): what backward reads,
# the saved tensors, stays whole until all the unit's gradients are in
METADATA = set(
    "shape dtype device grad requires_grad is_leaf ndim grad_fn layout names is_cuda is_meta "
    "is_sparse size dim numel nelement element_size is_floating_point is_complex stride __len__ "
    "__hash__ requires_grad_ register_hook register_post_accumulate_grad_hook untyped_storage "
    "data_ptr storage_offset is_contiguous backward".split()
)


def _refuse(cls, func, types, args=(), kwargs=None):
    """__torch_function__ of a freed parameter: torch calls it for every operation, method and
    attribute a parameter is handed to; metadata passes, anything that reads values raises."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # an attribute: func.__self__ names it (grad, data, T)
        name = func.__self__.__name__
    if name in METADATA or (name == "type" and len(args) == 1 and not kwargs):  # "torch...."
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    freed = [a.zero3_name for a in tree_leaves((args, kwargs)) if getattr(a, "zero3_freed", 0)]
    raise FreedParameterError(
        f"ZeRO-3: {(freed or ['a parameter'])[0]} was handed to {name or func} while its unit "
        "is freed: a unit's parameters are whole only inside its module's forward and backward. "
        "Name the module that reads it as a unit (units=[...]), or read it inside gathered()."
    )


@functools.cache
def freed_class(cls: type) -> type:
    """The class a parameter of class cls wears while its unit is freed (FreedParameter)."""
    return type(
        f"Freed{cls.__name__}",
        (cls,),
        {"__torch_function__": classmethod(_refuse), "zero3_freed": True},
    )


FreedParameter = freed_class(nn.Parameter)


def wear(unit, freed: bool) -> None:
    """Give the unit's parameters the freed class (any read raises) or their own back."""
    for q, cls in zip(unit.params, unit.classes, strict=True):
        q.__class__ = freed_class(cls) if freed else cls


def is_whole(unit) -> bool:
    """Whether the unit's full parameters are in memory now."""
    return unit.flat.untyped_storage().nbytes() > 0


def runs(module: nn.Module) -> bool:
    """Whether module has a forward of its own (containers such as ParameterList, ModuleList
    have none: no forward hook of theirs ever fires)."""
    return type(module).forward is not nn.Module.forward


def held(module: nn.Module):
    """The parameters module registers itself or through containers below it."""
    yield from module.parameters(recurse=False)
    for child in module.children():
        if not runs(child):
            yield from held(child)


def _owns(module: nn.Module) -> bool:
    """Whether module runs and holds a trainable parameter: a unit by default."""
    return runs(module) and any(q.requires_grad for q in held(module))


def unit_groups(module: nn.Module, units: list[nn.Module] | None = None):
    """(unit modules, their trainable parameters) in forward (registration) order.

    Units: the given modules, or by default every module that runs a forward of its own and
    holds trainable parameters (itself or in containers below it); and the root. A parameter
    belongs to the innermost unit that contains every module registering it (containers'
    parameters go up to the module that runs; tied ones to the unit around both holders);
    units left without any are dropped.
    """
    paths = {id(m): n or "the root" for n, m in module.named_modules()}
    idle = [f"{paths[id(m)]} ({type(m).__name__})" for m in units or [] if not runs(m)]
    if idle:
        raise ValueError(
            f"units {idle} never run a forward of their own: no hook would "
            "gather them; name the module whose forward uses them"
        )
    picked = units if units is not None else [m for m in module.modules() if _owns(m)]
    chosen = {id(m) for m in picked} | {id(module)}
    order = [m for m in module.modules() if id(m) in chosen]  # outer before inner
    inside = [{id(x) for x in m.modules()} for m in order]
    holders: dict[int, set] = {}  # id(parameter) -> ids of the modules that register it
    for m in module.modules():
        for q in m.parameters(recurse=False):
            holders.setdefault(id(q), set()).add(id(m))
    groups = [[] for _ in order]
    for q in module.parameters():
        if q.requires_grad:
            around = [k for k in range(len(order)) if holders[id(q)] <= inside[k]]  # the root
            groups[min(around, key=lambda k: len(inside[k]))].append(q)  # the innermost
    kept = [k for k in range(len(order)) if groups[k]]
    if not runs(module) and groups[0]:
        raise ValueError(
            f"{len(groups[0])} parameters belong to no module that runs: the root "
            f"{type(module).__name__} never runs a forward of its own"
        )
    for k in kept:
        if len({(q.dtype, q.device) for q in groups[k]}) > 1:
            raise ValueError(f"unit {type(order[k]).__name__} mixes dtypes or devices")
    return [order[k] for k in kept], [groups[k] for k in kept]
