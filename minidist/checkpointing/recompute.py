"""Gradient checkpointing: keep only each segment's input in forward and recompute the segment's
activations in backward, trading about one more forward for memory.

Equals: the same model without checkpointing: bitwise gradients in float64 (the recomputation
runs the very same ops on the very same inputs), with dropout too, because the random state is
saved before a segment's forward and restored before its recomputation.
Communication per step, per rank: none (a per-rank technique; it composes with any parallelism).
Memory per rank, in saved-tensor bytes (what autograd keeps for backward, parameters excluded):
n blocks, each saving A bytes of which b are its input, segments of k blocks, c = ceil(n/k)
segments, s = n - (c-1) k blocks in the last one:
    none:            n A
    segments of k:   max((c-1) b + s A, (c-2) b + k A)     (peak: while a segment is
                     recomputed, the inputs of the segments before it are still held)
    k = 1:           (n-1) b + A          k = ceil(sqrt(n)):  about sqrt(n) (A + b)
Compute: one more forward of every checkpointed block: (2F + B) / (F + B), 4/3 when B = 2F.
Ladder: checkpoint(block, x) (one hand-written autograd.Function) -> CheckpointedSequential with
a policy: every block (k = 1), every k blocks, every sqrt(n) blocks (Chen et al.).
Paper: Chen et al., Training Deep Nets with Sublinear Memory Cost (2016), sections 3-4.
Lesson: lessons/10_checkpointing/.   Run: python lessons/10_checkpointing/demo.py

Usage:

    model = CheckpointedSequential(blocks, policy="sqrt")      # or "block", "none", an int k
    with SavedTensorMeter(exclude=model.parameters()) as meter:
        model(x).sum().backward()                              # recomputation happens in here
    meter.peak                                                 # bytes; compare predicted_peak()

Decisions a user must know:
- The random state preserved is torch's default CPU generator, plus the CUDA generator of the
  input's device when the input is on a GPU (as torch.utils.checkpoint does). Two threads that
  share the default generator (the threads backend) and draw from it concurrently break
  dropout's recomputation: give each rank's dropout its own process, or no dropout.
- A block takes tensors and returns one tensor. Its parameters are passed to the autograd
  Function as inputs, so the output requires grad even when x does not (the first block).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

# the meter this lesson checks its formula with; it lives in memory.py, one for every lesson
from minidist.memory import SavedTensorMeter as SavedTensorMeter


def segment_size(n_blocks: int, policy: str | int) -> int:
    """Blocks per checkpointed segment: "none" -> 0, "block" -> 1, "sqrt" -> ceil(sqrt(n)), k."""
    if policy == "none":
        return 0
    if policy == "block":
        return 1
    if policy == "sqrt":
        return max(1, math.ceil(math.sqrt(n_blocks)))
    if isinstance(policy, int) and policy >= 1:
        return policy
    raise ValueError(f"policy={policy!r} is not 'none', 'block', 'sqrt' or an int >= 1")


def segments(n_blocks: int, k: int) -> list[tuple[int, int]]:
    """The [lo, hi) block ranges of segments of k blocks (the last may be shorter); k=0: none."""
    if k == 0:
        return []
    return [(lo, min(lo + k, n_blocks)) for lo in range(0, n_blocks, k)]


def predicted_peak(n_blocks: int, k: int, block_bytes: int, input_bytes: int) -> int:
    """Peak saved-tensor bytes of n blocks in segments of k (k=0: no checkpointing).

    block_bytes (A): what one block saves without checkpointing, its input included;
    input_bytes (b): one block's input. A segment's input is saved once: its recomputed first
    block saves the very same storage.
    """
    a, b = block_bytes, input_bytes
    if k == 0:
        return n_blocks * a
    # lab 10.1 begin: c segments; peak while recomputing the last (s blocks) or a full one
    c = math.ceil(n_blocks / k)
    s = n_blocks - (c - 1) * k  # blocks in the last segment, recomputed first
    last = (c - 1) * b + s * a  # the other c-1 segment inputs held + s blocks' activations
    full = (c - 2) * b + k * a if c > 1 else 0  # the last segment's input freed by now
    return max(last, full)
    # lab 10.1 end


def _rng_state(tensors: Iterable[torch.Tensor]) -> tuple:
    """The default CPU generator's state, and the CUDA one of each device the tensors use."""
    cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in cuda}


class _Checkpoint(torch.autograd.Function):
    """y = run(*inputs), keeping only `inputs` (and the random state) for backward."""

    @staticmethod
    def forward(ctx, run: Callable, n_inputs: int, *tensors: torch.Tensor) -> torch.Tensor:
        inputs, params = tensors[:n_inputs], tensors[n_inputs:]
        ctx.run, ctx.params = run, params  # parameters are alive anyway: not saved tensors
        ctx.rng = _rng_state(inputs)
        ctx.save_for_backward(*inputs)
        # autograd runs Function.forward without grad: run's activations are not kept
        return run(*inputs)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor) -> tuple:
        # lab 10.2 begin: restore the saved rng state, rerun ctx.run with grad, grad of its inputs
        needs = ctx.needs_input_grad[2:]  # one flag per input, then one per parameter
        saved = ctx.saved_tensors
        # detach: a fresh leaf that shares the saved storage, so the recomputed graph is ours
        inputs = [
            x.detach().requires_grad_(n) for x, n in zip(saved, needs[: len(saved)], strict=True)
        ]
        cpu_state, cuda_states = ctx.rng
        # fork_rng: the recomputation must not move the generator the rest of training sees
        with torch.random.fork_rng(devices=list(cuda_states)), torch.enable_grad():
            torch.set_rng_state(cpu_state)
            for device, state in cuda_states.items():
                torch.cuda.set_rng_state(state, device)
            y = ctx.run(*inputs)
        wrt = [t for t, n in zip([*inputs, *ctx.params], needs, strict=True) if n]
        grads = iter(torch.autograd.grad(y, wrt, grad_y, allow_unused=True))
        return (None, None, *[next(grads) if n else None for n in needs])  # run, n_inputs: none
        # lab 10.2 end


def checkpoint(block: Callable, *inputs: torch.Tensor, params: list | None = None):
    """block(*inputs), its activations recomputed in backward instead of stored.

    params: the tensors block uses that need gradients; default: block.parameters() when block
    is an nn.Module. Gradients reach them (and the inputs) as without checkpointing.
    """
    if params is None:
        params = [p for p in block.parameters()] if isinstance(block, nn.Module) else []
    return _Checkpoint.apply(block, len(inputs), *inputs, *params)


class _Segment(nn.Module):
    """Blocks [lo, hi) run one after another: what one checkpoint call recomputes."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class CheckpointedSequential(nn.Module):
    """A stack of blocks, run in checkpointed segments chosen by `policy` (see segment_size).

    `blocks` is an nn.Sequential, so parameter names are those of the plain stack with a
    "blocks." prefix. In eval mode, or under no_grad, nothing is recomputed: the blocks run
    plainly.
    """

    def __init__(self, blocks: list[nn.Module], policy: str | int = "sqrt"):
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.k = segment_size(len(blocks), policy)
        # a plain list: the segments share the blocks' parameters, they do not own them
        self.segments = [_Segment(blocks[lo:hi]) for lo, hi in segments(len(blocks), self.k)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.k == 0 or not (self.training and torch.is_grad_enabled()):
            return self.blocks(x)
        for segment in self.segments:
            x = checkpoint(segment, x)  # keeps x only; the segment reruns in backward
        return x
