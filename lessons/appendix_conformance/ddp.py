"""A data-parallel wrapper written from scratch on torch.distributed, in the style of a course
assignment: the worked example of this appendix, checked by `minidist conform adapter.py`.

    model = DDP(module, group)              # rank 0's parameters and buffers, everywhere
    loss_fn(model(x_local), y_local).backward()
    model.finish_gradient_synchronization() # every .grad: the average over the ranks
    optimizer.step()

After backward, one all-reduce says which parameters got a gradient on some rank (a parameter
no rank used keeps grad None, as in one process; one used elsewhere counts as zero here), then
one all-reduce per used parameter sums the gradients, divided by the number of ranks. Inside
no_sync() the synchronization is skipped: gradients accumulate locally.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn


class DDP(nn.Module):
    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.module = module
        self.group = group
        self.sync = True
        root = dist.get_global_rank(group, 0) if group is not None else 0  # the group's rank 0
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=root, group=group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate locally; synchronize after the next one outside."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def finish_gradient_synchronization(self) -> None:
        if not self.sync:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        used = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64)
        dist.all_reduce(used, group=self.group)  # how many ranks have each gradient
        world = dist.get_world_size(self.group)
        for p, n_used in zip(params, used.tolist(), strict=True):
            if n_used == 0:
                continue  # no rank used it: grad stays None
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # used elsewhere: this rank adds zero
            dist.all_reduce(p.grad, group=self.group)
            p.grad.div_(world)
