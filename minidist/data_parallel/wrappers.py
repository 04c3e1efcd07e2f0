"""Data parallelism: every rank holds the whole model, takes an equal share of the batch, and the
ranks average their gradients with an all-reduce before the optimizer step.

Equals: one process training on the whole batch with the loss a mean over the batch, when each
rank's loss is the mean over its equal share: grad_full = (1/p) sum_r grad_r. float64: 1e-12
relative (the reduction order differs from the single-process sum; the bucketed rung divides
each gradient by p before the sum, as torch's DDP does); the replicas are bitwise identical to
each other after every step.
Communication per step, per rank (p ranks, N gradient elements of b bytes, P parameters): one
all-reduce of N + P elements (a "used" flag rides along with each parameter); with the ring:
2(p-1)/p * (N + P) * b bytes sent. Naive: P + 1 collectives; bucketed: one per bucket.
Memory per rank: the whole model, its gradients and optimizer state (ZeRO removes that copy);
bucketed: the gradients live in the flat bucket buffers (grads_as_bucket_views, the default);
with grads_as_bucket_views=False the buffers come on top of them.
Ladder: DataParallelNaive (after backward, one all-reduce per parameter) -> DataParallelBucketed
(buckets all-reduced asynchronously *during* backward, as soon as they fill: overlap) ->
no_sync() (gradient accumulation: k micro-steps, one reduction).
Paper: Li et al., PyTorch Distributed: Experiences on Accelerating Data Parallel Training (VLDB
2020), sections 3.2-3.3.   Lesson: lessons/04_data_parallel/.
Run: minidist run -n 2 --backend mpi lessons/04_data_parallel/demo.py

Usage, either rung:

    model = DataParallelBucketed(model, comm, bucket_bytes=1 << 20)   # broadcasts rank 0's weights
    loss = loss_fn(model(x_local), y_local)                           # x_local: (B/p, ...)
    loss.backward()
    model.finish_gradient_sync()                                      # wait: grads now averaged
    optimizer.step()

Decisions a user must know:
- Buffers (e.g. BatchNorm running statistics) are broadcast from rank 0 at wrap time and before
  every forward, as in torch's DDP: rank 0's running statistics win.
- Unused parameters: a parameter whose .grad is None on some ranks counts as zero there; one
  whose .grad is None on *every* rank keeps grad None, exactly as in single-process training
  (the flag that rides along with each parameter's gradient tells which case it is). A .grad
  that exists but got nothing in this backward (accumulated in no_sync micro-steps, or zeroed
  with set_to_none=False) is reduced as it is.
- Gradients are views of the buckets (DataParallelBucketed's grads_as_bucket_views, the
  default, as torch DDP's gradient_as_bucket_view=True): the next step's backward writes into
  the same memory, so a .grad kept past its step must be cloned. grads_as_bucket_views=False
  gives each .grad its own memory (torch DDP's default).
- Uneven shares are rejected by `shard` (averaging per rank would weight samples unequally).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from minidist.collectives.overlap import Launcher
from minidist.comm.agreement import signature


def shard(batch: torch.Tensor, comm) -> torch.Tensor:
    """This rank's equal share of `batch` along dim 0: rows [r*B/p, (r+1)*B/p)."""
    n, p = batch.shape[0], comm.world_size
    if n % p != 0:
        raise ValueError(f"batch={n} is not divisible by the data-parallel size p={p}")
    return batch[comm.rank * n // p : (comm.rank + 1) * n // p]


def broadcast_module(module: nn.Module, comm, src: int = 0, buffers_only: bool = False) -> None:
    """Copy rank `src`'s parameters and buffers into every rank's module (in place)."""
    tensors = list(module.buffers()) if buffers_only else [*module.parameters(), *module.buffers()]
    with torch.no_grad():
        for t in tensors:
            comm.broadcast(t.data, src)


def assign_buckets(nbytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Group tensors, in the given order, into buckets of at least `bucket_bytes` each.

    A bucket closes as soon as it holds bucket_bytes or more, so a tensor larger than the limit
    sits alone and the last bucket may be smaller. Returns lists of indices into `nbytes`.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be at least 1")
    # lab 04.1 begin: walk nbytes in order, close a bucket once it holds >= bucket_bytes
    buckets = []
    current = []
    filled = 0
    for i, n in enumerate(nbytes):
        current.append(i)
        filled += n
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets
    # lab 04.1 end


def _into_bucket(param: nn.Parameter, view: torch.Tensor, p: int) -> None:
    """Before the all-reduce: view <- param.grad / p, the copy and the division one pass, so
    that the sum the all-reduce returns is already the average (torch's DDP divides here too).
    A .grad that is None contributes zero; one that already lives in the view (a bucket view
    kept from the last step, accumulated into) is divided in place."""
    # lab 04.3 begin: view <- .grad / p in one pass (zeros for None, in place if .grad is view)
    if param.grad is None:
        view.zero_()
    elif param.grad.data_ptr() == view.data_ptr():
        view.div_(p)
    else:
        torch.div(param.grad.reshape(-1), p, out=view)
    # lab 04.3 end


def _keep_used(flat: torch.Tensor, params: list, views: list, as_views: bool = True) -> None:
    """After the all-reduce of [grads / p..., flags...]: each view holds its average; a
    parameter whose flag sums to 0 was unused on every rank and keeps grad None. as_views: .grad
    becomes the bucket's view (nothing copied out); else the average is copied into .grad's own
    memory (a .grad that is None gets a new tensor), as torch's DDP copies back by default."""
    # lab 04.4 begin: flags = the last P elements; each used average into .grad, else grad None
    flags = flat[len(flat) - len(params) :]  # (P,) how many ranks produced each gradient
    for param, view, used in zip(params, views, flags.tolist(), strict=True):
        if used == 0:
            param.grad = None  # no rank used it: as in one process
        elif as_views:
            param.grad = view.view_as(param)
        elif param.grad is None:  # used on other ranks only
            param.grad = view.view_as(param).clone()
        else:
            param.grad.copy_(view.view_as(param))
    # lab 04.4 end


class DataParallelNaive(nn.Module):
    """Rung 1: after backward, all-reduce every parameter's gradient, one at a time."""

    def __init__(self, module: nn.Module, comm, algorithm: str = "library"):
        super().__init__()
        self.module, self.comm = module, comm
        self.launcher = Launcher(comm, algorithm)
        self.params = [p for p in module.parameters() if p.requires_grad]
        broadcast_module(module, comm)

    def forward(self, *args, **kwargs):
        broadcast_module(self.module, self.comm, buffers_only=True)
        return self.module(*args, **kwargs)

    def finish_gradient_sync(self) -> None:
        """All-reduce the gradients (blocking); afterwards every rank holds the average."""
        used = torch.tensor([float(p.grad is not None) for p in self.params], dtype=torch.float64)
        self.launcher.all_reduce(used).wait()  # (P,): which parameters got a gradient anywhere
        for param, n_used in zip(self.params, used.tolist(), strict=True):
            if n_used == 0:
                continue  # unused on every rank: grad stays None
            if param.grad is None:  # unused here only: contributes zero
                param.grad = torch.zeros_like(param)
            self.launcher.all_reduce(param.grad).wait()
            param.grad.div_(self.comm.world_size)


class _Bucket:
    """Parameters reduced together: one flat buffer [grad_0 / p, grad_1 / p, ..., flags] (same
    dtype), p the number of ranks that average them."""

    def __init__(self, params: list[nn.Parameter], p: int):
        self.params = params
        self.p = p
        n = sum(q.numel() for q in params)
        self.flat = torch.zeros(n + len(params), dtype=params[0].dtype, device=params[0].device)
        sizes = [q.numel() for q in params] + [len(params)]
        *self.views, self.flags = self.flat.split(sizes)  # views: (numel_i,) into flat
        self.ready = [False] * len(params)
        self.work = None

    def launch(self, launcher: Launcher) -> None:
        for i, param in enumerate(self.params):
            if not self.ready[i]:  # no gradient this backward: what .grad holds still counts
                # (accumulated in earlier no_sync micro-steps, or zeros); None contributes zero
                _into_bucket(param, self.views[i], self.p)
            self.flags[i] = float(self.ready[i] or param.grad is not None)
        self.work = launcher.all_reduce(self.flat)


class DataParallelBucketed(nn.Module):
    """Rung 2: buckets of gradients, each all-reduced asynchronously the moment it is full.

    Buckets are filled in the order backward produces gradients (roughly the reverse of
    module.parameters()) and launched strictly in bucket order, so every rank issues the same
    collectives in the same order even when some parameters are unused on some ranks; buckets
    still waiting at the end of backward are launched by finish_gradient_sync.

    Each gradient enters its bucket divided by p, the copy and the division one pass, so the
    all-reduce returns the average. grads_as_bucket_views (the default, torch DDP's
    gradient_as_bucket_view=True): after finish_gradient_sync each .grad is a view of its bucket,
    nothing copied out and no second buffer; False: .grad keeps its own memory and the average is
    copied into it (torch DDP's default).
    """

    def __init__(
        self,
        module: nn.Module,
        comm,
        bucket_bytes: int = 1 << 20,
        algorithm: str = "library",
        grads_as_bucket_views: bool = True,
    ):
        super().__init__()
        self.module, self.comm = module, comm
        self.views_as_grads = grads_as_bucket_views
        params = [p for p in module.parameters() if p.requires_grad][::-1]  # backward order
        self.buckets = []
        for group in _by_dtype(params):  # a flat buffer holds one dtype
            nbytes = [p.numel() * p.element_size() for p in group]
            self.buckets += [
                _Bucket([group[i] for i in b], comm.world_size)
                for b in assign_buckets(nbytes, bucket_bytes)
            ]
        self.where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.next_launch = 0
        self.sync = True
        broadcast_module(module, comm)
        own = self._bucket_comm(comm, algorithm)  # the buckets' own comm (the plan agreed)
        self.launcher = Launcher(own, algorithm)
        for p in params:
            # fires once per backward, after p.grad holds this backward's full gradient
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _bucket_comm(self, comm, algorithm: str):
        """Where the buckets are all-reduced. The library's collectives agree on their signature
        before they move a byte (lesson 03), a second meeting of the ranks per bucket; every
        step launches the same buckets in the same order, so on a comm of their own (a copy of
        comm) that plan is agreed once, here, and each launch is checked against it on its own
        rank (comm.trust). The ring, and the threads world, which checks every call at its
        meeting point, use comm itself."""
        if algorithm != "library" or not hasattr(comm, "trust") or not self.buckets:
            return comm
        own = comm.split(0)
        own.trust([signature("all_reduce", bucket.flat, op="sum") for bucket in self.buckets])
        return own

    def forward(self, *args, **kwargs):
        broadcast_module(self.module, self.comm, buffers_only=True)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside this block."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        bucket, i = self.where[id(param)]
        if bucket.work is not None:
            raise RuntimeError(
                "a gradient arrived after its bucket was reduced: call backward once per step "
                "(use no_sync() to accumulate over micro-steps)"
            )
        _into_bucket(param, bucket.views[i], bucket.p)
        bucket.ready[i] = True
        self._launch_ready(all_remaining=False)
        for launched in self.buckets[: self.next_launch]:
            # MPI advances a non-blocking collective only inside MPI calls: poke the ones in
            # flight, so they progress during backward instead of all at the final wait
            launched.work.is_completed()

    def _launch_ready(self, all_remaining: bool) -> None:
        """Launch buckets in order while the next one is full (or all, at the end)."""
        # lab 04.2 begin: launch bucket next_launch while it is full (or all_remaining), in order
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if not (all_remaining or all(bucket.ready)):
                return
            bucket.launch(self.launcher)
            self.next_launch += 1
        # lab 04.2 end

    def finish_gradient_sync(self) -> None:
        """Launch what is left, wait for every bucket, and leave averaged gradients in .grad."""
        self._launch_ready(all_remaining=True)
        for bucket in self.buckets:
            bucket.work.wait()
            _keep_used(bucket.flat, bucket.params, bucket.views, self.views_as_grads)
            bucket.ready = [False] * len(bucket.params)
            bucket.work = None
        self.next_launch = 0


def _by_dtype(params: list) -> list[list]:
    """Split a list into runs of equal (dtype, device), keeping the order."""
    groups: list[list] = []
    for p in params:
        if groups and (groups[-1][0].dtype, groups[-1][0].device) == (p.dtype, p.device):
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups
