"""The adapter: one Python file (or module) that points the kit at your implementation.

Every function is optional: a capability whose functions are missing is reported skipped, and
so is a call that raises NotImplementedError (say, an op your all-reduce does not offer).
`comm` is the communicator your code wants, declared once at module level:

    COMM = "minidist"   # a minidist Comm (the default): runs on threads, gloo and mpi
    COMM = "torch"      # a torch.distributed process group (gloo): `dist.all_reduce(t, group=comm)`
    COMM = "mpi4py"     # an mpi4py communicator (mpi)

Its rank is comm's own (for a torch group: dist.get_rank(comm)); worlds of p ranks are the
first p ranks of the job, so a torch group's rank 0 is also the global rank 0.

collectives (tensors any shape, on the CPU; integer and floating dtypes; return the result,
in place or new):
    all_reduce(comm, tensor, op) -> tensor          op: "sum", "avg", "max", "min"
    reduce_scatter(comm, tensor, op) -> chunk       rank r gets elements [r*N//p, (r+1)*N//p)
                                                    of the reduced, flattened tensor (N numel)
    all_gather(comm, chunk, shape) -> tensor        chunk: rank r's elements [r*N//p, (r+1)*N//p)
                                                    of the result, flattened; N = prod(shape)
    broadcast(comm, tensor, src) -> tensor          every rank ends with src's tensor
    all_to_all(comm, x, send_counts, recv_counts) -> y
        x: (sum(send_counts), ...): its next send_counts[j] rows go to rank j; y: the rows from
        rank 0, then rank 1, ...; recv_counts[i] rows from rank i (as MPI_Alltoallv)
data parallelism (dp):
    data_parallel(comm, module) -> model            wrap: broadcast rank 0's parameters and
                                                    buffers; model(x) runs module's forward
    data_parallel_buckets(comm, module, bucket_bytes) -> model   optional: the same, its
                                                    gradients reduced in buckets of about
                                                    bucket_bytes (1 byte .. 1 MiB)
    dp_after_backward(model)                        optional: after the backward of a step that
                                                    synchronizes (e.g. finish_gradient_sync)
    dp_no_sync(model) -> context manager            optional: backward inside it communicates
                                                    nothing (gradient accumulation)
    After dp_after_backward, every used parameter's .grad is the average over ranks (the
    gradient of one process on the whole batch); .grad stays None where it would be None in
    one process (a parameter no rank used).
tensor parallelism (tp), from the full nn.Linear layers (float64):
    column_parallel_linear(comm, linear, gather_output) -> layer  layer.weight: (O/p, I), rows
        r*O/p..(r+1)*O/p; layer.bias: (O/p,) or None. y_local (.., O/p), or y (.., O) gathered
    row_parallel_linear(comm, linear, input_is_parallel) -> layer  layer.weight: (O, I/p),
        columns r*I/p..; layer.bias: (O,), added once. x_local (.., I/p) (or x (.., I), split
        by the layer) -> y (.., O) on every rank
    parallel_mlp(comm, fc1, fc2) -> mlp   mlp(x) = fc2(gelu(fc1(x))), x and y whole on every
        rank; mlp.fc1 column-parallel and mlp.fc2 row-parallel, holding slices as above
pipeline parallelism (pp), kind "gpipe" or "1f1b" (raise NotImplementedError for one you lack,
or for 1F1B with m < p stages: those cases are checks of their own):
    pipeline_schedule(kind, n_stages, n_microbatches) -> programs   the schedule as data:
        programs[s] is stage s's compute actions in order, each (letter, microbatch): "F" the
        forward, "B" the backward (input and weight gradients) of microbatch 0..m-1. From
        torch.distributed.pipelining: [(a.computation_type.value, a.microbatch_index) for a in
        schedule.pipeline_order[s] if a is not None and a.computation_type.value in ("F", "B")]
    pipeline_step(comm, kind, stage, n_microbatches, inputs, targets, loss_fn) -> losses
        one training step, the forward and backward of every microbatch in kind's order; rank r
        holds stage, an nn.Sequential of part r of a float64 model the kit cut into p contiguous
        parts (its parameters' .grad None). inputs: the m microbatches (B/m, d_in) on rank 0,
        else None; targets (B/m, d_out) on rank p-1, else None; loss_fn(y, target) is one
        microbatch's mean loss. After it, each parameter's .grad in stage holds the gradient of
        the whole batch's mean loss (the mean of the m microbatch losses); rank p-1 returns the
        m losses, 0-d, as loss_fn gave them (the other ranks: anything).
expert parallelism (moe), from the whole layer (float64; E experts, E divisible by p):
    expert_parallel_moe(comm, router, experts, k, capacity_factor) -> layer
        router: nn.Linear(D, E, bias=False) (logits x W^T); experts: E modules, expert e's
        forward fc2(gelu(fc1(x))) (.fc1 nn.Linear(D, F), .fc2 nn.Linear(F, D)); k: 1 or 2;
        capacity_factor: a float, or None (no limit). The layer holds copies of the router and
        of experts r*E/p .. (r+1)*E/p - 1: layer.router.weight (E, D), layer.experts[i] (.fc1,
        .fc2) is expert r*E/p + i. layer(x_local) -> y_local: (n_r, D) -> (n_r, D), this
        rank's tokens (n_r differs by rank, 0 included) routed as one group; the routing rule
        (gates, capacity, which assignments drop) is minidist/conform/moe.py's docstring's
    moe_after_backward(layer)                       optional: after backward (e.g. the router's
                                                    gradient summed over ranks)
    After it, layer.router.weight.grad is the whole batch's gradient on every rank, and each
    held expert's .grad that of every token routed to it, from any rank (one no token reached
    may keep None).
context parallelism (cp), ring attention (float64):
    ring_attention(comm, q, k, v, causal) -> out    q, k, v: (B, H, T/p, d), this rank's tokens
        r*T/p .. (r+1)*T/p - 1 (non-contiguous tensors); out: (B, H, T/p, d), these queries'
        softmax(q k^T / sqrt(d) + mask) v over the whole sequence, the mask causal on global
        positions (causal=True) or none. Backward through autograd: dL/dk and dL/dv of this
        rank's keys and values hold every rank's queries' part. CP_LAYOUT = "zigzag" (default
        "plain"): this rank's tokens are chunks r and 2p-1-r of 2p instead, in that order
ZeRO (zero), AdamW on a float64 module (ranks build it with different values: rank 0's count):
    zero(comm, module, stage, lr, betas, eps, weight_decay) -> model
        ZeRO stage 1, 2 or 3 (NotImplementedError: that stage's checks are skipped) around
        module, stepping torch.optim.AdamW's maths with these options. model(x) runs module's
        forward; the kit calls backward on this rank's mean loss over its share of the batch
    zero_step(model)                                after backward: average the gradients over
                                                    ranks, step, drop every gradient
    zero_parameters(model) -> {name: tensor}        optional: every parameter whole, by its
                                                    name in module (default: module's own,
                                                    which stages 1 and 2 keep whole)
    zero_gradients(model) -> [(name, lo, hi, grad)] optional, after backward (before
        zero_step): this rank's averaged gradient, as pieces: elements [lo, hi) of parameter
        `name` flattened, grad holding hi - lo elements (any shape; read flattened)
    zero_optimizer_state(model) -> [(name, lo, hi, {"exp_avg": t, "exp_avg_sq": t})]
        optional, after zero_step: the AdamW state this rank holds, in pieces as above
    zero_memory(model) -> {"params": int, "grads": int, "optimizer": int}
        optional: the bytes this rank holds now (optimizer: the elementwise state, not the step
        counters); asked after each backward and each zero_step
    How a rank's shard is cut is yours (a flat buffer cut in p, whole parameters, rows): the
    kit asks that the state's pieces cover each element exactly once across ranks (and the
    gradient's, from stage 2).
bytes (optional): the kit counts every byte a minidist comm sends (point-to-point; a library
collective called on it counts as none sent). Declare which cost formula each collective
claims, and it is checked, exactly, with N divisible by p:
    BYTES = {"all_reduce": "ring", "reduce_scatter": "ring", "all_gather": "ring",
             "broadcast": "tree", "all_to_all": "direct"}
    ring: only to rank+1, 2(p-1)/p N b (all-reduce), (p-1)/p N b (the halves); tree: (p-1) N b
    over all ranks together; direct: each row straight to its destination, nothing else.
    "expert_parallel_moe": "direct": each kept row straight to its expert's rank and back,
    forward and backward, and an int64 count per expert to each rank, nothing else.
    "ring_attention": "ring": to rank+1 only, 2 (p-1) blocks of k|v forward, 2 (p-1) of k|v
    and 2p of dk|dv backward, a block B*H*(T/p)*d elements.
With a torch or mpi4py communicator the kit cannot count: give `bytes_sent(comm) -> int` (bytes
this rank sent so far) and the totals are checked (per peer only where the kit counts).

Load: `minidist conform path/to/adapter.py`, `minidist conform package.module`, or
`package.module:name` (an object holding the functions, as minidist.conform.mutants does). A file
is loaded with its folder on sys.path, so it can import the code beside it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from types import SimpleNamespace

from minidist.comm.wrappers import Counter, ObservedComm
from minidist.conform.checks import Unavailable

COMMS = ("minidist", "torch", "mpi4py")
# which communicators each backend can hand an adapter
SERVES = {"threads": ("minidist",), "gloo": ("minidist", "torch"), "mpi": ("minidist", "mpi4py")}
# `minidist conform minidist`, `minidist conform pytorch`
ALIASES = {"minidist": "minidist.conform.ours", "pytorch": "minidist.conform.pytorch"}

_lock = threading.Lock()  # thread-ranks load an adapter at once: none may see half of it


def load(spec: str):
    """The adapter `spec` names (see the module docstring); ValueError saying why not."""
    spec = ALIASES.get(spec, spec)
    module_part, _, attribute = spec.partition(":")
    with _lock:
        if module_part.endswith(".py") or os.path.sep in module_part:
            module = _from_file(module_part)
        else:
            try:
                module = importlib.import_module(module_part)
            except ImportError as e:
                raise ValueError(f"{spec}: no such file, and no module to import ({e})") from e
    adapter = getattr(module, attribute) if attribute else module
    comm = getattr(adapter, "COMM", "minidist")
    if comm not in COMMS:
        raise ValueError(f"{spec}: COMM = {comm!r} is not one of {COMMS}")
    return adapter


def _from_file(path: str):
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such adapter file")
    name = "conform_adapter_" + os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == path:
        return sys.modules[name]
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the adapter imports the code beside it, as a script would
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def comm_kind(adapter) -> str:
    return getattr(adapter, "COMM", "minidist")


def missing(adapter, check) -> str:
    """'' if the adapter has what check needs, else why it is skipped."""
    lacks = [name for name in check.needs if not hasattr(adapter, name)]
    if lacks:
        return "the adapter has no " + ", ".join(lacks)
    return check.skip(adapter) if check.skip is not None else ""


def bytes_skip(adapter, collective: str, formula: str) -> str:
    """'' if the bytes of `collective` can be checked against `formula`, else why not."""
    claimed = getattr(adapter, "BYTES", {}).get(collective)
    if claimed != formula:
        return f"the adapter's BYTES does not claim {collective!r}: {formula!r}"
    if comm_kind(adapter) != "minidist" and not hasattr(adapter, "bytes_sent"):
        return f"no byte counter: COMM = {comm_kind(adapter)!r} and no bytes_sent(comm)"
    return ""


class Rank:
    """What a check's run() gets on one rank: the adapter, the communicator it asked for
    (`comm`), and the bytes this rank has sent since the case began."""

    def __init__(self, adapter, comm):
        self.adapter = adapter
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.counter = None
        kind = comm_kind(adapter)
        if kind == "minidist":
            self.counter = Counter()
            self.comm = ObservedComm(comm, self.counter)
        elif kind == "torch":
            if comm.backend not in ("gloo", "nccl"):
                raise Unavailable(f"COMM = 'torch' needs gloo, not {comm.backend}")
            import torch.distributed as dist

            self.comm = comm.group if comm.group is not None else dist.group.WORLD
        else:
            if comm.backend != "mpi":
                raise Unavailable(f"COMM = 'mpi4py' needs mpi, not {comm.backend}")
            self.comm = comm.mpi_comm
        self._start = self._adapter_bytes()

    def _adapter_bytes(self) -> int | None:
        count = getattr(self.adapter, "bytes_sent", None)
        return None if self.counter is not None or count is None else int(count(self.comm))

    def sent(self) -> SimpleNamespace:
        """.total: bytes sent since the case began (None: nothing counts them); .to: {peer:
        bytes}, where the kit counts (a minidist comm), else None."""
        if self.counter is not None:
            return SimpleNamespace(total=self.counter.bytes_sent, to=dict(self.counter.sent_to))
        now = self._adapter_bytes()
        total = None if now is None else now - self._start
        return SimpleNamespace(total=total, to=None)
