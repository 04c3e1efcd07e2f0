"""Pipeline parallelism: each rank runs its stage's program (minidist/pipeline/schedules.py) on its
chunks of the model, sending activations to the next stage and gradients back to the previous one.

Equals: the unpartitioned model trained on the whole batch, the loss a mean over the batch. The
loss convention: loss_fn returns the mean over its microbatch, and the executor divides each
microbatch's loss by m before its backward, so the gradients summed over the m equal
microbatches are those of the whole batch's mean loss. float64: 1e-12 relative (samples are
summed per microbatch, then across microbatches: another order than one batch).
Communication per step, per rank (p stages, m microbatches, v chunks, A bytes of activation per
microbatch at a stage boundary): m*v sends of A to the next stage and m*v of A (gradients) to
the previous one, none past the pipeline's ends; plus a header of 8 int64 with microbatch 0 of
each chunk. Receives block, where place_comm put them; sends are isend, so a stage never waits
for its receiver (the papers' model; a blocking send waits for the receive on mpi above 4 KiB
and on gloo), waited for by the end of the step.
Memory per rank: its 1/p of the layers, plus the activations of peak_activations(program)
microbatches: GPipe m, 1F1B min(p - s, m), ZB-H1 min(p, m) (B's graph is kept for W);
memory.SavedTensorMeter measures the bytes (stage.memory: its peak, and
bytes_of[(microbatch, chunk)]; the step's inputs, targets and the weights left out).
Ladder: GPipe -> 1F1B -> interleaved (v chunks per rank) -> ZB-H1 (backward split into B, the
input gradient, and W, the weight gradient): one executor; the program decides.
Paper: as pipeline/schedules.py; the B/W split: Qi et al., Zero Bubble Pipeline Parallelism (2023),
s. 2. Lesson: lessons/06_pipeline/.   Run: minidist run -n 4 --backend mpi
lessons/06_pipeline/demo.py

    program = build_schedules("1f1b", comm.world_size, m)[comm.rank]
    stage = PipelineStage(chunks, comm, loss_fn)    # chunks: this rank's modules, v of them
    losses = stage.run(program, inputs, targets)    # inputs on rank 0, targets on the last
    optimizer.step()                                # .grad holds the whole batch's gradient

Messages. Shapes are not known in advance: with microbatch 0 of each chunk the sender first
sends a header (dtype, ndim, dims), and every later microbatch of that chunk in the step must
have the same shape (checked by the sender). A gradient has the shape of the activation it
belongs to, which its receiver kept. Every message has its own tag, from (microbatch, boundary
between virtual stages, kind), so no message can be taken for another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from minidist.comm.wrappers import Tracer
from minidist.memory import SavedTensorMeter
from minidist.pipeline import schedules as sch
from minidist.pipeline.schedules import COMPUTE, LETTER, Op, Program, Rows, peer
from minidist.pipeline.zero_bubble import (
    LayerGraph,
    input_gradient,
    run_layer_by_layer,
    weight_gradients,
)

WEIGHT_GRADS = (sch.BACKWARD, sch.BACKWARD_WEIGHT)  # the ops after which on_backward runs


def split_microbatches(batch: torch.Tensor, n_microbatches: int) -> list[torch.Tensor]:
    """`batch` (B, ...) as n_microbatches equal views (B/m, ...) along dim 0."""
    n = batch.shape[0]
    if n_microbatches < 1 or n % n_microbatches:
        raise ValueError(f"batch={n} does not split into n_microbatches={n_microbatches} equal")
    return list(batch.split(n // n_microbatches))


def _label(op: Op, n_chunks: int) -> str:
    """'F3' the forward of microbatch 3; 'F3.1' on chunk 1, if there are chunks (as schedules)."""
    return f"{LETTER[op.kind]}{op.microbatch}" + (f".{op.chunk}" if n_chunks > 1 else "")


# ---- messages: each has its own tag; a header tells a chunk's shape -------------------------

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32)
MAX_DIMS = 6
# the kinds of message, part of each tag
HEADER = 0
ACT = 1
GRAD = 2


def message_tag(microbatch: int, boundary: int, kind: int, n_virtual: int) -> int:
    """The tag of a message of `kind` for `microbatch` across boundary u (between virtual stages
    u and u + 1 of n_virtual): distinct for every message of a step."""
    return 3 * (microbatch * n_virtual + boundary) + kind


def header(t: torch.Tensor) -> torch.Tensor:
    """(2 + MAX_DIMS,) int64: dtype index, ndim, the dims, zeros."""
    if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
        raise ValueError(f"cannot pass a {t.dim()}-d {t.dtype} between stages: {DTYPES=}")
    dims = [DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (MAX_DIMS - t.dim())
    return torch.tensor(dims, dtype=torch.int64, device=t.device)


def read_header(h: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) from a header."""
    dtype, ndim, *dims = h.tolist()
    return tuple(dims[:ndim]), DTYPES[dtype]


@dataclass
class _Step:
    """What one run keeps between ops, keyed by (microbatch, chunk)."""

    inputs: Sequence[torch.Tensor] | None
    targets: Sequence[torch.Tensor] | None
    m: int
    acts: dict = field(default_factory=dict)  # inputs received (or handed on), before forward
    outs: dict = field(default_factory=dict)  # outputs waiting for their send
    grads: dict = field(default_factory=dict)  # output gradients received, before backward
    back: dict = field(default_factory=dict)  # input gradients waiting for their send
    stash: dict = field(default_factory=dict)  # (input, output, graphs) from forward to backward
    shapes_in: dict = field(default_factory=dict)  # chunk -> (shape, dtype) it receives
    shapes_out: dict = field(default_factory=dict)  # chunk -> (shape, dtype) it sends
    losses: dict = field(default_factory=dict)  # microbatch -> its loss (unscaled, detached)
    sending: list = field(default_factory=list)  # the Work of sends not yet waited for


class PipelineStage:
    """One rank of a pipeline: its model chunks (an nn.Module or a list of v; chunk c is virtual
    stage c*p + rank), the comm to the other stages (rank = stage), on the last stage the loss.
    `run` executes a program; with a Tracer, each compute op is recorded as a span (see
    measured_timeline). on_backward(op) runs after every op that adds weight gradients (a
    backward, or ZB's W): e.g. ZeRO-2/3 reduce-scatter them there, microbatch by microbatch."""

    def __init__(
        self,
        chunks: nn.Module | Sequence[nn.Module],
        comm,
        loss_fn: Callable | None = None,
        tracer: Tracer | None = None,
        device: torch.device | str | None = None,
        on_backward: Callable[[Op], None] | None = None,
    ):
        one = isinstance(chunks, nn.Module) and not isinstance(chunks, nn.ModuleList)
        self.chunks = [chunks] if one else list(chunks)
        self.comm = comm
        self.loss_fn = loss_fn
        self.tracer = tracer
        self.on_backward = on_backward  # after each op that adds weight gradients (ZeRO-2/3)
        self.p, self.v = comm.world_size, len(self.chunks)
        params = [q for chunk in self.chunks for q in chunk.parameters()]
        # where received tensors go: a stage of layers without weights needs to be told
        default = params[0].device if params else getattr(comm, "device", "cpu")
        self.device = torch.device(device or default)
        self.memory = SavedTensorMeter()  # each run's: bytes_of[(microbatch, chunk)], peak
        self.table = {  # what this stage does for each kind of op (the schedule's constants)
            sch.FORWARD: self.forward,
            sch.BACKWARD: self.backward,
            sch.BACKWARD_INPUT: self.backward_input,
            sch.BACKWARD_WEIGHT: self.backward_weight,
            sch.RECV_ACT: self.recv_act,
            sch.SEND_ACT: self.send_act,
            sch.RECV_GRAD: self.recv_grad,
            sch.SEND_GRAD: self.send_grad,
        }
        self.spans: list[tuple] = []  # (start, end, kind, microbatch, chunk) of the last run

    def run(self, program: Program, inputs=None, targets=None) -> list[torch.Tensor]:
        """Execute one step's program; the m per-microbatch losses (unscaled) on the last stage,
        [] elsewhere. Gradients accumulate in .grad: zero them between steps. inputs, targets:
        m microbatches each, on rank 0 and on rank p-1 (the first and last virtual stage)."""
        m = 1 + max(op.microbatch for op in program)
        self._check(program, m, inputs, targets)
        self.step, self.spans = _Step(inputs, targets, m), []
        self.split = any(op.kind == sch.BACKWARD_INPUT for op in program)  # ZB: B and W apart
        params = [q for chunk in self.chunks for q in chunk.parameters()]
        # the weights, inputs and targets are alive anyway: a microbatch's bytes are the rest
        self.memory = SavedTensorMeter(exclude=[*params, *(inputs or []), *(targets or [])])
        for op in program:
            self._execute(op)
            if self.on_backward is not None and op.kind in WEIGHT_GRADS:
                self.on_backward(op)
            self._reap_sends(wait_all=False)
        self._reap_sends(wait_all=True)
        return [self.step.losses[i] for i in range(m)] if self.step.losses else []

    def _execute(self, op: Op) -> None:
        """Do op through the table; with a Tracer, a compute op is recorded as a span."""
        if op.kind not in COMPUTE or self.tracer is None:
            self.table[op.kind](op)
            return
        with self.tracer.span(_label(op, self.v)) as span:
            self.table[op.kind](op)
        a = self.tracer.t0 + span.event["ts"] * 1e-6  # perf_counter seconds
        b = a + span.event["dur"] * 1e-6
        self.spans.append((a, b, COMPUTE.index(op.kind), op.microbatch, op.chunk))

    def _check(self, program: Program, m: int, inputs, targets) -> None:
        unknown = sorted({op.kind for op in program} - self.table.keys())
        if unknown:
            raise ValueError(f"the program has ops of kinds {unknown}; known: {list(self.table)}")
        v = 1 + max(op.chunk for op in program)
        if v != self.v:
            raise ValueError(f"the program runs v={v} chunks per stage; this stage has {self.v}")
        for rank, what, given in ((0, "inputs", inputs), (self.p - 1, "targets", targets)):
            if self.comm.rank == rank and (given is None or len(given) != m):
                got = None if given is None else len(given)
                raise ValueError(f"stage {rank} needs the {what} of m={m} microbatches, got {got}")
        if self.comm.rank == self.p - 1 and self.loss_fn is None:
            raise ValueError(f"stage {self.p - 1} (the last) needs a loss_fn")

    def _virtual(self, chunk: int) -> int:
        return chunk * self.p + self.comm.rank

    def _last(self, chunk: int) -> bool:
        return self._virtual(chunk) == self.p * self.v - 1

    def _tag(self, microbatch: int, boundary: int, kind: int) -> int:
        return message_tag(microbatch, boundary, kind, self.p * self.v)

    # ---- compute ---------------------------------------------------------------------------

    def forward(self, op: Op) -> None:
        i = op.microbatch
        c = op.chunk
        step = self.step
        x = step.inputs[i] if self._virtual(c) == 0 else step.acts.pop((i, c))
        with self.memory.counting((i, c)):
            graphs = run_layer_by_layer(self.chunks[c], x) if self.split else None
            out = graphs[-1].out if graphs else self.chunks[c](x)
            if self._last(c):  # ZB: the loss is a graph of its own, after a cut
                y = out.detach().requires_grad_(out.requires_grad) if self.split else out
                loss = self.loss_fn(y, step.targets[i])
                step.losses[i] = loss.detach()
                out = loss / step.m  # the convention: the step's loss is the batch mean
                graphs = graphs + [LayerGraph(y, out, [])] if self.split else None
        step.stash[i, c] = (x, out, graphs)
        if self._last(c):
            return
        if self.p == 1:  # the next chunk is on this rank: no message
            step.acts[i, c + 1] = out.detach().requires_grad_(out.is_floating_point())
        else:
            step.outs[i, c] = out.detach()

    def backward(self, op: Op) -> None:
        """Input and weight gradients at once (GPipe, 1F1B, interleaved)."""
        i, c = op.microbatch, op.chunk
        x, out, _ = self.step.stash.pop((i, c))
        grad = None if self._last(c) else self.step.grads.pop((i, c))  # None: d loss = 1
        if out.requires_grad:
            torch.autograd.backward(out, grad)
        self._pass_back(i, c, x, x.grad)

    def backward_input(self, op: Op) -> None:
        """ZB's B: the chunk's input gradient (input_gradient); the layers' graphs stay for W."""
        i, c = op.microbatch, op.chunk
        x, out, graphs = self.step.stash[i, c]
        g = torch.ones_like(out) if self._last(c) else self.step.grads.pop((i, c))
        self._pass_back(i, c, x, input_gradient(graphs, g))

    def backward_weight(self, op: Op) -> None:
        """ZB's W: the chunk's weight gradients (weight_gradients), from what B kept."""
        i, c = op.microbatch, op.chunk
        _, _, graphs = self.step.stash.pop((i, c))
        weight_gradients(graphs)

    def _pass_back(self, i: int, c: int, x: torch.Tensor, g: torch.Tensor | None) -> None:
        """Hand the input gradient g to the previous virtual stage (none before the first)."""
        if self._virtual(c) == 0:
            return
        g = torch.zeros_like(x) if g is None else g  # the chunk did not use its input
        if self.p == 1:  # the previous chunk is on this rank
            self.step.grads[i, c - 1] = g
        else:
            self.step.back[i, c] = g

    # ---- communication ---------------------------------------------------------------------

    def recv_act(self, op: Op) -> None:
        i = op.microbatch
        c = op.chunk
        rank = self.comm.rank
        src, boundary = peer(op, rank, self.p)[0], self._virtual(c) - 1
        if i == 0:  # microbatch 0 brings the shape of the chunk's messages this step
            h = torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=self.device)
            self.comm.recv(h, src, self._tag(i, boundary, HEADER))
            self.step.shapes_in[c] = read_header(h)
        if c not in self.step.shapes_in:
            raise RuntimeError(f"stage {rank}: microbatch {i} of chunk {c} came before 0")
        shape, dtype = self.step.shapes_in[c]
        x = torch.empty(shape, dtype=dtype, device=self.device)
        self.comm.recv(x, src, self._tag(i, boundary, ACT))
        self.step.acts[i, c] = x.requires_grad_(x.is_floating_point())  # a leaf: x.grad

    def send_act(self, op: Op) -> None:
        i, c = op.microbatch, op.chunk
        y = self.step.outs.pop((i, c))
        dst = peer(op, self.comm.rank, self.p)[0]
        boundary = self._virtual(c)
        if i == 0:
            self.step.shapes_out[c] = (tuple(y.shape), y.dtype)
            self._isend(header(y), dst, self._tag(i, boundary, HEADER))
        elif (tuple(y.shape), y.dtype) != self.step.shapes_out[c]:
            raise ValueError(
                f"stage {self.comm.rank}: microbatch {i} of chunk {c} has output "
                f"{tuple(y.shape)} {y.dtype}, microbatch 0 had {self.step.shapes_out[c]}: "
                "all microbatches of a step must have one shape"
            )
        self._isend(y, dst, self._tag(i, boundary, ACT))

    def recv_grad(self, op: Op) -> None:
        i, c = op.microbatch, op.chunk
        out = self.step.stash[i, c][1]
        g = torch.empty_like(out)  # the gradient of this stage's output has its shape
        self.comm.recv(g, peer(op, self.comm.rank, self.p)[0], self._tag(i, self._virtual(c), GRAD))
        self.step.grads[i, c] = g

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self.step.sending.append(self.comm.isend(t, dst, tag))  # t stays untouched until waited

    def _reap_sends(self, wait_all: bool) -> None:
        """wait() for the sends that are complete (it returns at once; a Tracer notes their end,
        and asking lets MPI move the others on), or for all of them at the end of a run."""
        pending = []
        for work in self.step.sending:
            if wait_all or work.is_completed():
                work.wait()
            else:
                pending.append(work)
        self.step.sending = pending

    def send_grad(self, op: Op) -> None:
        i, c = op.microbatch, op.chunk
        g, dst = self.step.back.pop((i, c)), peer(op, self.comm.rank, self.p)[0]
        self._isend(g, dst, self._tag(i, self._virtual(c) - 1, GRAD))


def measured_timeline(stage: PipelineStage) -> Rows:
    """Every stage's compute ops of its last run as (stage, start, end, label) rows, seconds
    from the earliest start, on every rank (two all_gathers on stage.comm). Times are the
    Tracer's perf_counter: the machine's monotonic clock, shared by its processes (ranks on
    different machines would need their clocks aligned first)."""
    comm, device = stage.comm, stage.device
    mine = torch.tensor(stage.spans, dtype=torch.float64, device=device).reshape(-1, 5)
    counts = torch.empty(comm.world_size, dtype=torch.int64, device=device)
    comm.all_gather(counts, torch.tensor([len(mine)], device=device))
    padded = torch.zeros(int(counts.max()), 5, dtype=torch.float64, device=device)
    padded[: len(mine)] = mine  # (n_max, 5): start, end, kind, microbatch, chunk
    every = torch.empty(comm.world_size, *padded.shape, dtype=torch.float64, device=device)
    comm.all_gather(every, padded)
    spans = [(s, row) for s, k in enumerate(counts.tolist()) for row in every[s, :k].tolist()]
    t0 = min(row[0] for _, row in spans)
    return [
        (s, a - t0, b - t0, _label(Op(COMPUTE[int(kind)], int(i), int(c)), stage.v))
        for s, (a, b, kind, i, c) in spans
    ]
