"""ZeRO's optimizer state by parameter name: parameter groups over the shard pieces, and the state
consolidated on one rank, then cut again for any world size and any stage.

Equals: a ZeRO optimizer built with param_groups equals the torch optimizer built in one process
with the same groups (float64 1e-12 relative, tests/test_zero.py): each rank's optimizer holds,
in group g, the pieces of group g's parameters, with g's options. consolidate() returns what one
process's model and optimizer would hold (its "param_groups" name the parameters); loading it
into ZeRO of any stage and world size, then training on, equals that process going on.
Communication (consolidate, load_consolidated; once): p2p, each rank's pieces to or from one
rank, pickled; the bytes of the model state.
Memory: the whole model state on the consolidating rank while it runs.
Ladder: resolve_groups (which group each parameter is in: pure, checked) -> make_optimizer
(the groups over this rank's pieces) -> consolidate / merge_states -> shard_state /
load_consolidated (the groups' options, e.g. a scheduler's lr, travel with the state).
Paper: Rajbhandari et al., ZeRO (SC 2020), section 5; FSDP's FULL_STATE_DICT and
optim_state_dict.   Lesson: lessons/07_zero/.   Run: minidist run -n 4 lessons/07_zero/demo.py

Parameter groups, the torch convention: a list of dicts, each with "params" (parameter names
of the wrapped module, or the Parameter objects themselves) and its own options (lr,
weight_decay, ...); optimizer_kwargs are the defaults every group starts from:

    groups = [{"params": ["0.weight", "2.weight"]}, {"params": ["0.bias"], "weight_decay": 0.0}]
    zero = wrap(model, comm, torch.optim.AdamW, 3, {"lr": 1e-3}, param_groups=groups)

Every trainable parameter must be in exactly one group (a missing or repeated one is refused,
by name); frozen ones may be listed and are skipped (they stay whole and are not stepped).
"""

from __future__ import annotations

import pickle

import torch
from torch import nn


def resolve_groups(module: nn.Module, param_groups: list[dict] | None):
    """({id(parameter): its group's index} for every trainable parameter, each group's options
    without "params"); None: one group, the optimizer's defaults. A ValueError names any
    entry that is not module's parameter, and any trainable parameter in no or two groups."""
    named = dict(module.named_parameters(remove_duplicate=False))  # either name of a tied one
    name_of = {id(q): n for n, q in module.named_parameters()}
    trainable = [q for q in module.parameters() if q.requires_grad]
    if param_groups is None:
        return {id(q): 0 for q in trainable}, [{}]
    index: dict[int, int] = {}
    for g, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"param group {g} is not a dict with 'params': {group!r}")
        items = group["params"]
        items = [items] if isinstance(items, (str, torch.Tensor)) else list(items)
        for item in items:
            q = named.get(item) if isinstance(item, str) else item
            if q is None or id(q) not in name_of:
                what = repr(item) if isinstance(item, str) else f"a {tuple(item.shape)} tensor"
                raise ValueError(f"param group {g} lists {what}: not a parameter of the module")
            if not q.requires_grad:
                continue  # frozen: whole on every rank, nothing to step
            if id(q) in index:
                raise ValueError(
                    f"parameter {name_of[id(q)]!r} is in param groups {index[id(q)]} and {g}"
                )
            index[id(q)] = g
    missing = [name_of[id(q)] for q in trainable if id(q) not in index]
    if missing:
        raise ValueError(f"trainable parameters in no param group: {missing}")
    return index, [{k: v for k, v in group.items() if k != "params"} for group in param_groups]


def make_optimizer(module: nn.Module, units: list, optimizer, optimizer_kwargs, param_groups):
    """(the torch optimizer over this rank's pieces, {id(parameter): group index}): in group g
    the pieces (views into this rank's shards) of group g's parameters, with g's options; no
    param_groups: all pieces in one plain list. A rank whose shard is all padding still gets
    an optimizer (one empty tensor): step() works everywhere."""
    group_of, options = resolve_groups(module, param_groups)
    groups = [{"params": [], **opts} for opts in options]
    for unit in units:
        for piece, t in zip(unit.pieces, unit.tensors, strict=True):
            groups[group_of[id(unit.params[piece.index])]]["params"].append(t)
    if param_groups is None:
        tensors = groups[0]["params"] or [torch.zeros(0)]
        return optimizer(tensors, **(optimizer_kwargs or {})), group_of
    return optimizer(groups, **(optimizer_kwargs or {})), group_of


def group_names(zero) -> list[list[str]]:
    """Each group's parameter names, in the module's order."""
    names = [[] for _ in zero.optimizer.param_groups]
    for n, q in zero.module.named_parameters():
        if id(q) in zero.group_of:
            names[zero.group_of[id(q)]].append(n)
    return names


def groups_state(zero) -> list[dict]:
    """The optimizer's groups as one process's torch optimizer would save them, but naming the
    parameters: [{options now (a scheduler's lr too), "params": [names]}]."""
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": names}
        for group, names in zip(zero.optimizer.param_groups, group_names(zero), strict=True)
    ]


def groups_problem(zero, saved: list[dict] | None) -> str:
    """'' if a state's groups (None: the state has none) fit zero's, else what differs."""
    if saved is None:
        return ""
    ours = group_names(zero)
    if len(saved) != len(ours):
        return f"the state has {len(saved)} param groups, this optimizer {len(ours)}"
    for g, (group, names) in enumerate(zip(saved, ours, strict=True)):
        if sorted(group["params"]) != sorted(names):
            return f"param group {g} holds {group['params']} in the state, {names} here"
    return ""


# ---- the state on one rank, and cut again -------------------------------------------------


def consolidate(zero, dst: int = 0) -> dict | None:
    """The full state on rank dst, None on the others; every rank must call it.

    {"model": {name: tensor}: every parameter and buffer, whole (like module.state_dict());
     "optimizer": {name: {key: value}}: each trainable parameter's state as one process's
     torch optimizer holds it; "elementwise": the keys held per element}. Each rank sends
    dst its pieces (p2p, pickled); dst lays them side by side (merge_states). With mixed
    precision the trainable parameters are the masters (precision.master: what the optimizer
    steps) and "scaler" holds the loss scaler's state. "param_groups": groups_state.
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
    return merge_states(shards, zero.module) | scaler | {"param_groups": groups_state(zero)}


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
    Mixed precision: the masters are loaded, the model gets them rounded; so is the scaler.
    "param_groups", if the state has them, must name the same parameters per group as zero's
    (else every rank raises the same ValueError); their options (lr, ...) are loaded."""
    comm = zero.comm
    if comm.rank == src:
        whole = {n: state["model"][n] for n in _whole(zero.module)}
        groups = state.get("param_groups")
        problem = groups_problem(zero, groups)  # sent to every rank: all raise, none hangs
        for r in range(comm.world_size):
            pieces = [u.plan.pieces(r) for u in zero.units]  # rank r's share of the same plan
            part = () if problem else (shard_state(state, zero.names, pieces), whole, groups)
            part = (problem, *part, state.get("scaler"))
            if r == src:
                mine = part
            else:
                _send_object(comm, part, r)
    else:
        mine = _recv_object(comm, src)
    if mine[0]:
        raise ValueError(f"cannot load this state: {mine[0]}")
    _load_mine(zero, *mine[1:])


def _load_mine(zero, pieces: list, whole: dict, groups: list | None, scaler: dict | None):
    """Put this rank's pieces, state and options in place; publish the model."""
    tensors = {(name, lo): t for name, lo, _, t in zero.shard_pieces()}
    with torch.no_grad():
        for name, lo, _, values, kept in pieces:
            t = tensors[(name, lo)]
            t.copy_(values)
            # elementwise state goes to the parameter's device; Adam's step stays where it was
            zero.optimizer.state[t] = {
                k: v.to(t.device) if torch.is_tensor(v) and v.dim() > 0 else v
                for k, v in kept.items()
            }
        for name, t in _whole(zero.module).items():
            t.copy_(whole[name])
    if groups is not None:  # the options a scheduler or the user set: lr, weight_decay, ...
        for group, saved in zip(zero.optimizer.param_groups, groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
    if zero.mixed and scaler is not None:
        zero.scaler.load_state_dict(scaler)
    zero.publish()  # the model takes the loaded values (mixed precision: rounded)


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
