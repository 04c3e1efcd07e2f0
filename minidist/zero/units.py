"""ZeRO's unit: parameters sharded together, the one structure every stage keeps.

A Unit flattens its parameters into one buffer of p S elements (each parameter becomes a view
into it), keeps this rank's shard of S elements (a view, or, for ZeRO-3, a copy that is all that
stays), a float32 master shard under mixed precision, and the bookkeeping of one backward: which
gradients arrived, which were used, a reduce-scatter or all-gather in flight. ZeRO1-3
(stages.py) step the shards; ZeRO-3's Gatherer (gatherer.py) brings the full buffer back before
each use and frees it after. Where each parameter's elements lie in the shards is the plan
(stages.partition: offsets, shard_numel, and each rank's pieces).
Lesson: lessons/07_zero/.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.mixed_precision.amp import Precision


class Unit:
    """Parameters sharded together: a flat buffer (p S,) of them all (the parameters become
    views into it), this rank's shard (S,), a master shard (S,) if precision, and the
    bookkeeping of one backward."""

    def __init__(self, params: list[nn.Parameter], plan, comm, own_shard: bool, precision=None):
        """plan: zero.partition of the parameters' sizes over comm's ranks."""
        p, r = comm.world_size, comm.rank
        self.params, self.plan = params, plan
        S = self.plan.shard_numel
        full = torch.zeros(p * S, dtype=params[0].dtype, device=params[0].device)  # (p S,)
        with torch.no_grad():
            for q, off in zip(params, self.plan.offsets, strict=True):
                full[off : off + q.numel()].copy_(q.reshape(-1))
        comm.broadcast(full, 0)  # every rank starts from rank 0's values
        self.dtypes = precision or Precision(full.dtype, full.dtype, full.dtype)
        self.master = None  # mixed precision: a master shard, from the values before rounding
        if precision is not None:
            self.master = full[r * S : (r + 1) * S].to(precision.master, copy=True)  # (S,)
        full = full.to(self.dtypes.compute)  # (p S,) the model's copy
        self.shard = full[r * S : (r + 1) * S]  # (S,) a view into the model's copy
        if own_shard:  # ZeRO-3: the shard is all that stays; the full buffer comes and goes
            self.shard = self.shard.clone()
            # a fresh buffer that no comm ever sees: the MPI backend exposes buffers through
            # numpy, which makes a storage non-resizable for good, and Gatherer frees by resizing
            full = torch.empty_like(full)
        self.flat = full
        for q, off in zip(params, self.plan.offsets, strict=True):
            q.data = self.flat[off : off + q.numel()].view_as(q)
        if own_shard:
            self.flat.untyped_storage().resize_(0)  # freed until the Gatherer gathers it
        self.pieces = self.plan.pieces(r)
        self.stepped = self.shard if self.master is None else self.master  # by the optimizer
        self.tensors = [self.stepped[c.at : c.at + c.hi - c.lo] for c in self.pieces]  # views
        self.ready = [False] * len(params)  # got this backward's gradient
        # used: 1 where this rank had a gradient this round (P,); has_grad: some rank had one
        self.used = torch.zeros(len(params), dtype=self.dtypes.master, device=full.device)
        self.has_grad = [False] * len(params)  # ... since zero_grad
        self.grad_shard: torch.Tensor | None = None  # (S,) the averaged gradient, master dtype
        self.work = self.grad_flat = self.recv = None  # a reduce-scatter in flight
        self.gather_work = self.landing = None  # ZeRO-3: an all-gather in flight
