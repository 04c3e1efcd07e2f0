"""ZeRO-3: the parameters are sharded too, and gathered layer by layer just before they are used;
and what needs every shard at once: the state consolidated on one rank, re-sharded, counted.

Equals: one process training on the whole batch with the same torch optimizer, float64 1e-12
relative, as ZeRO1/ZeRO2 in zero.py (the ladder's first rungs and the shared machinery).
Communication per step, per rank (p ranks, Psi trainable elements of b bytes, ring):
all-gather of each unit before its forward and again before its backward, reduce-scatter of
its gradients: 3 (p-1)/p Psi b, 1.5x data parallelism's 2 (p-1)/p Psi b.
Memory per rank: (2 + k)/p Psi b for parameters, gradients and k optimizer states per element,
plus the full parameters of the units being used: the current one and the prefetched next.
Mixed precision (bfloat16 model, float32 masters, Adam), bytes per element, stages 0..3: the
paper's (section 3.1, figure 1) 2 + 2 + 12 -> 4 + 12/p -> 2 + 14/p -> 16/p; held here
2 + (2 + 4) + 12 -> 4 + 12/p -> 2 + 16/p -> 18/p: the gradient shard is float32, so gradient
accumulation adds in float32 (model_state_nbytes with m = 4). ZeRO-1 also holds its one
unit's whole gradient in the reduce dtype during the sync (ZeRO-2's buckets bound that).
Mixed precision communication: the two all-gathers move the compute dtype (bfloat16: half the
bytes), the reduce-scatter the reduce dtype: (p-1)/p Psi (2 c + r) (sent_nbytes).
Ladder: ZeRO1 -> ZeRO2 (zero.py) -> ZeRO3 (here: gather before use, free after, prefetch)
-> consolidate / load_consolidated (any stage; re-sharding into any world size; with mixed
precision the float32 masters and the loss scaler's state).
Paper: Rajbhandari et al., ZeRO (SC 2020), section 5.3 (P_os+g+p) and 7.2; the same idea is
PyTorch's FSDP (Zhao et al., VLDB 2023) with FULL_SHARD.   Lesson: lessons/07_zero/.
Run: minidist run -n 4 --backend mpi lessons/07_zero/demo.py

How a unit's parameters come and go (a unit: the parameters of one module, by default every
module that owns trainable parameters; pass units=[blocks...] to gather whole blocks):

    forward pre-hook   gather unit i (waits for its prefetch), start gathering unit i+1
    forward hook       free unit i; hook its outputs: their gradient means backward reached it
    output grad hook   gather unit i again, start gathering unit i-1 (backward runs in reverse)
    post-accumulate    all of unit i's gradients are in: free it, reduce-scatter them (ZeRO-2)

Decisions a user must know:
- Every rank must run the same modules in the same order (the gathers are collectives), as in
  FSDP. Data-dependent control flow that differs across ranks hangs; ZeRO-1/2 allow it.
- A parameter is whole only inside its unit's module (and modules within it). A weight used
  elsewhere (a tied embedding used by the output layer) needs a unit that holds both uses.
- Prefetching guesses that modules run in registration order; a wrong guess costs bytes and
  memory until the step ends, never correctness. Frozen parameters stay whole (replicated).
"""

from __future__ import annotations

import contextlib
import pickle
from functools import partial

import torch
from torch import nn

from minidist.amp import LossScaler, Precision
from minidist.zero import ZeRO2


class ZeRO3(ZeRO2):
    """Stage 3: each rank keeps only its shard of each unit's parameters (own_shard)."""

    own_shard = True

    def __init__(
        self,
        module: nn.Module,
        comm,
        optimizer,
        optimizer_kwargs: dict | None = None,
        units: list[nn.Module] | None = None,
        algorithm: str = "library",
        prefetch: bool = True,
        precision: Precision | None = None,
        scaler: LossScaler | None = None,
        overflow_comm=None,
    ):
        modules, groups = unit_groups(module, units)  # forward order
        options = {"algorithm": algorithm, "groups": groups[::-1]}  # launched in backward order
        options |= {"precision": precision, "scaler": scaler, "overflow_comm": overflow_comm}
        super().__init__(module, comm, optimizer, optimizer_kwargs, **options)
        self.order = self.units[::-1]  # order[i]: the unit of modules[i]
        self.prefetch = prefetch
        for i, m in enumerate(modules):
            m.register_forward_pre_hook(partial(self._before_forward, i))
            m.register_forward_hook(partial(self._after_forward, i))

    def _start_gather(self, unit) -> None:
        """Start all-gathering the unit's shards (into a landing buffer: see _Unit)."""
        if is_whole(unit) or unit.landing is not None:
            return  # gathered already, or on its way
        unit.landing = torch.empty(unit.flat.shape, dtype=unit.flat.dtype, device=unit.flat.device)
        unit.gather_work = self.launcher.all_gather(unit.landing, unit.shard)

    def _gather(self, unit) -> None:
        """Make the unit's parameters whole: wait for its gather, copy it into place."""
        self._start_gather(unit)
        if unit.landing is not None:
            unit.gather_work.wait()
            unit.flat.untyped_storage().resize_(unit.flat.numel() * unit.flat.element_size())
            unit.flat.copy_(unit.landing)  # (p S,): every view (the parameters) sees it
            unit.gather_work = unit.landing = None

    def _free(self, unit) -> None:
        """Release the unit's full buffer. Views into it (the parameters, tensors autograd
        saved for backward) stay valid objects and see the data again once it is re-gathered."""
        if unit.gather_work is not None:  # a prefetch may still be writing into the buffer
            unit.gather_work.wait()
            unit.gather_work = unit.landing = None
        unit.flat.untyped_storage().resize_(0)

    def _before_forward(self, i: int, module, args) -> None:
        self._gather(self.order[i])
        if self.prefetch and i + 1 < len(self.order):
            self._start_gather(self.order[i + 1])  # overlaps with this unit's compute

    def _after_forward(self, i: int, module, args, output) -> None:
        self._free(self.order[i])
        outputs = output if isinstance(output, (tuple, list)) else [output]
        for t in outputs:
            if torch.is_tensor(t) and t.requires_grad:
                # fires when the output's gradient is ready: before this module's backward
                t.register_hook(partial(self._before_backward, i))

    def _before_backward(self, i: int, grad: torch.Tensor) -> None:
        self._gather(self.order[i])
        earlier = self.order[i - 1] if i > 0 else None
        if self.prefetch and earlier is not None and not all(earlier.ready):
            self._start_gather(earlier)  # the unit whose backward comes next, probably

    def _on_grad(self, param: nn.Parameter) -> None:
        super()._on_grad(param)  # ZeRO-2: note it, reduce-scatter complete units in order
        unit, _ = self.where[id(param)]
        if all(unit.ready):  # autograd has used every copy of these parameters: free them
            self._free(unit)

    def finish_gradient_sync(self) -> None:
        if self.pending:
            for unit in self.units:  # a prefetched unit that was not used this step
                self._free(unit)
        super().finish_gradient_sync()

    def _publish(self) -> None:
        """No all-gather after a step: each forward gathers the new shards (mixed precision:
        the master shard rounded into the compute-dtype shard first). A whole copy left over
        (a prefetch that no forward used) holds old values: drop it."""
        for unit in self.units:
            if unit.master is not None:
                unit.shard.copy_(unit.master)  # rounds to the compute dtype
            self._free(unit)

    @contextlib.contextmanager
    def gathered(self):
        """Every parameter whole inside the block (to evaluate, compare, save); freed after."""
        for unit in self.order:
            self._start_gather(unit)
        for unit in self.order:
            self._gather(unit)
        try:
            yield
        finally:
            for unit in self.order:
                self._free(unit)


def is_whole(unit) -> bool:
    """Whether the unit's full parameters are in memory now."""
    return unit.flat.untyped_storage().nbytes() > 0


def unit_groups(module: nn.Module, units: list[nn.Module] | None = None):
    """(unit modules, their trainable parameters) in forward (registration) order.

    Units: the given modules and the root (which takes whatever no other unit holds), or by
    default every module that owns trainable parameters itself. A parameter belongs to the
    innermost unit that contains it; units left without parameters are dropped.
    """
    owns = lambda m: any(q.requires_grad for q in m.parameters(recurse=False))  # noqa: E731
    picked = units if units is not None else [m for m in module.modules() if owns(m)]
    chosen = {id(m) for m in picked} | {id(module)}
    order = [m for m in module.modules() if id(m) in chosen]  # outer before inner
    owner = {}
    for k, m in enumerate(order):
        for q in m.parameters():
            owner[id(q)] = k  # a later (inner) unit takes it over
    groups = [[] for _ in order]
    for q in module.parameters():
        if q.requires_grad:
            groups[owner[id(q)]].append(q)
    kept = [k for k in range(len(order)) if groups[k]]
    for k in kept:
        if len({(q.dtype, q.device) for q in groups[k]}) > 1:
            raise ValueError(f"unit {type(order[k]).__name__} mixes dtypes or devices")
    return [order[k] for k in kept], [groups[k] for k in kept]


# ---- what needs every shard: accounting, consolidation, re-sharding ----------------------


def model_state_nbytes(
    stage: int, numel: int, p: int, b: int, k: float, m: int = 0
) -> dict[str, float]:
    """The paper's bytes per rank (section 5, figure 1) for numel elements: parameters and
    gradients of b bytes, k b bytes of optimizer state per element (K = k b; stage 0: data
    parallelism). Exact when p divides every unit's size, else shards carry < p pad elements.

    m > 0: mixed precision as this project holds it: the optimizer steps a master copy of m
    bytes per element and keeps its k states in m bytes (K = (1 + k) m: the paper's 12 for
    float32 Adam); the gradient shard is kept in m bytes too, so microbatches accumulate in
    float32. Stage 1 holds the model's gradients until the sync, then the shard (the larger
    counts); stage 0 is amp.MixedPrecisionOptimizer, which keeps a whole float32 buffer."""
    full, shard = numel * b, numel * b / p
    if not m:
        return {
            "params": shard if stage >= 3 else full,
            "grads": shard if stage >= 2 else full,
            "optimizer": k * (shard if stage >= 1 else full),
        }
    master = numel * m / p if stage >= 1 else numel * m
    return {
        "params": shard if stage >= 3 else full,
        "grads": {0: full + master, 1: max(full, master)}.get(stage, master),
        "optimizer": (1 + k) * master,
    }


def sent_nbytes(stage: int, numel: int, p: int, b: int, r: int = 0) -> float:
    """Bytes each rank sends per step with ring collectives (the used-flags not counted): the
    all-gathers move the parameters' b bytes per element, the reduce-scatter (stage 0: the
    all-reduce) the gradients' r bytes (mixed precision's reduce dtype; default b)."""
    r = r or b
    if stage == 0:
        return 2 * (p - 1) / p * numel * r
    return (p - 1) / p * numel * ((2 if stage == 3 else 1) * b + r)


def memory_nbytes(zero) -> dict[str, int]:
    """Bytes of model state a ZeRO object's rank holds now, counted by storage: params, grads,
    optimizer (elementwise state and, with mixed precision, the master shard, as the paper
    counts it; Adam's 0-d step counters left out) and buffers (in flight)."""
    units = zero.units
    state = [v for s in zero.optimizer.state.values() for v in s.values()]
    state = [v for v in state if torch.is_tensor(v) and v.dim() > 0] + [u.master for u in units]
    return {
        "params": storage_nbytes([u.flat for u in units] + [u.shard for u in units]),
        "grads": storage_nbytes(
            [q.grad for u in units for q in u.params] + [u.grad_shard for u in units]
        ),
        "optimizer": storage_nbytes(state),
        "buffers": storage_nbytes([t for u in units for t in (u.grad_flat, u.recv, u.landing)]),
    }


def storage_nbytes(tensors: list) -> int:
    """Bytes of the distinct storages behind tensors (views counted once, freed ones as 0)."""
    seen = {}
    for t in tensors:
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    seen.pop(0, None)  # freed or empty storages
    return sum(seen.values())


def consolidate(zero, dst: int = 0) -> dict | None:
    """The full state on rank dst, None on the others; every rank must call it.

    {"model": {name: tensor}: every parameter and buffer, whole (like module.state_dict());
     "optimizer": {name: {key: value}}: each trainable parameter's state as one process's
     torch optimizer holds it; "elementwise": the keys held per element}. Each rank sends
    dst its pieces (p2p, pickled); dst lays them side by side (merge_states). With mixed
    precision the trainable parameters are the masters (precision.master: what the optimizer
    steps) and "scaler" holds the loss scaler's state.
    """
    mine = [
        (name, lo, hi, t.detach().cpu().clone(), _cpu(zero.optimizer.state.get(t, {})))
        for name, lo, hi, t in zero.shard_pieces()
    ]
    if zero.comm.rank != dst:
        _send_object(zero.comm, mine, dst)
        return None
    others = {r: _recv_object(zero.comm, r) for r in range(zero.comm.world_size) if r != dst}
    shards = [mine if r == dst else others[r] for r in range(zero.comm.world_size)]
    scaler = {"scaler": zero.scaler.state_dict()} if zero.mixed else {}
    return merge_states(shards, zero.module) | scaler


def merge_states(shards: list[list[tuple]], module: nn.Module) -> dict:
    """The consolidated state from every rank's pieces (name, lo, hi, values, state)."""
    trainable = {n: q for n, q in module.named_parameters() if q.requires_grad}
    flat = {n: torch.zeros(q.numel(), dtype=q.dtype) for n, q in trainable.items()}
    optim, elementwise = {}, set()
    for pieces in shards:
        for name, lo, hi, values, state in pieces:
            if flat[name].dtype != values.dtype:  # mixed precision: the masters' dtype
                flat[name] = flat[name].to(values.dtype)
            flat[name][lo:hi] = values
            for key, v in state.items():
                entry = optim.setdefault(name, {})
                if torch.is_tensor(v) and v.dim() > 0:  # a piece's elementwise state is 1-D
                    elementwise.add(key)
                    n = flat[name].numel()
                    entry.setdefault(key, torch.zeros(n, dtype=v.dtype))[lo:hi] = v
                else:  # per parameter (Adam's step): the same in each of its pieces
                    entry[key] = v
    model = {n: _cpu(t) for n, t in _whole(module).items()}
    model |= {n: flat[n].view(q.shape) for n, q in trainable.items()}
    for name, entry in optim.items():
        for key in elementwise & entry.keys():
            entry[key] = entry[key].view(trainable[name].shape)
    return {"model": model, "optimizer": optim, "elementwise": sorted(elementwise)}


def shard_state(state: dict, names: list[list[str]], pieces: list[list]) -> list[tuple]:
    """The pieces (name, lo, hi, values, state) of a consolidated state that one rank owns:
    names[k] are unit k's parameter names, pieces[k] that rank's Pieces of unit k."""
    out = []
    for unit_names, unit_pieces in zip(names, pieces, strict=True):
        for c in unit_pieces:
            name = unit_names[c.index]
            state_here = state["optimizer"].get(name, {}).items()
            kept = {k: _cut(v, c) if k in state["elementwise"] else v for k, v in state_here}
            out.append((name, c.lo, c.hi, _cut(state["model"][name], c), kept))
    return out


def _cut(t: torch.Tensor, piece) -> torch.Tensor:
    return t.reshape(-1)[piece.lo : piece.hi].clone()  # (hi - lo,)


def load_consolidated(zero, state: dict | None, src: int = 0) -> None:
    """Load a consolidated state (given on rank src) into a ZeRO object of any stage, in a
    world of any size: src cuts each rank its pieces (shard_state) and sends them (p2p).
    Mixed precision: the masters are loaded, the model gets them rounded; so is the scaler."""
    comm = zero.comm
    if comm.rank == src:
        whole = {n: state["model"][n] for n in _whole(zero.module)}
        for r in range(comm.world_size):
            pieces = [u.plan.pieces(r) for u in zero.units]  # rank r's share of the same plan
            part = (shard_state(state, zero.names, pieces), whole, state.get("scaler"))
            if r == src:
                mine = part
            else:
                _send_object(comm, part, r)
    else:
        mine = _recv_object(comm, src)
    tensors = {(name, lo): t for name, lo, _, t in zero.shard_pieces()}
    with torch.no_grad():
        for name, lo, _, values, kept in mine[0]:
            t = tensors[(name, lo)]
            t.copy_(values)
            # elementwise state goes to the parameter's device; Adam's step stays where it was
            zero.optimizer.state[t] = {
                k: v.to(t.device) if torch.is_tensor(v) and v.dim() > 0 else v
                for k, v in kept.items()
            }
        for name, t in _whole(zero.module).items():
            t.copy_(mine[1][name])
    if zero.mixed and mine[2] is not None:
        zero.scaler.load_state_dict(mine[2])
    zero._publish()  # the model takes the loaded values (mixed precision: rounded)


def _whole(module: nn.Module) -> dict[str, torch.Tensor]:
    """What stays whole on every rank: frozen parameters and buffers, by name."""
    frozen = {n: q.data for n, q in module.named_parameters() if not q.requires_grad}
    return frozen | dict(module.named_buffers())


def _cpu(x):
    """A copy on the CPU of a tensor, or of each tensor in a dict (pickling, consolidating)."""
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x.detach().cpu().clone() if torch.is_tensor(x) else x


def _send_object(comm, obj, dst: int) -> None:
    """Send any picklable object: its length, then its bytes."""
    device = getattr(comm, "device", torch.device("cpu"))
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    comm.send(torch.tensor([data.numel()], device=device), dst)
    comm.send(data.to(device), dst)


def _recv_object(comm, src: int):
    device = getattr(comm, "device", torch.device("cpu"))
    n = torch.zeros(1, dtype=torch.int64, device=device)
    comm.recv(n, src)
    data = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    comm.recv(data, src)
    return pickle.loads(data.cpu().numpy().tobytes())
