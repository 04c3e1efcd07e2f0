"""Memory a rank holds, measured one way everywhere: the bytes of distinct storages.

What it measures: a tensor is a view into a storage (one allocation); two tensors that share a
storage (a tensor saved by two ops, a view of a saved one, a parameter viewing a flat buffer)
are one allocation and count once, with the storage's bytes; a freed storage counts 0.
- SavedTensorMeter: the activations autograd keeps for backward, live and peak, the storages of
  `exclude` (parameters, a step's inputs: alive anyway) left out. checkpointing checks its
  formula against it (lesson 10), pipeline meters each microbatch's forward with it (lesson
  06), tensor_parallel_blocks measures a block with it (saved_activation_nbytes, lesson 05).
- LiveTensorMeter: every tensor created while inside, live and peak, by a kind the caller names
  (k|v blocks, scores): what an algorithm holds in flight. context_parallel's in-flight
  formula is checked against it (lesson 15, `minidist bench cp`).
- storage_nbytes: the bytes behind a list of tensors (ZeRO's parameters, gradients and
  optimizer state: zero_cost.memory_nbytes).
Lesson: lessons/10_checkpointing/ (how the meter works).

    with SavedTensorMeter(exclude=model.parameters()) as meter:
        model(x).sum().backward()            # recomputation, if any, is metered too
    meter.peak                               # bytes
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Hashable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Held:
    """A saved tensor in the meter's hands; its bytes are released when autograd drops it."""

    def __init__(self, t: torch.Tensor, meter: SavedTensorMeter, key: int):
        self.t = t
        weakref.finalize(self, meter._release, key)


class SavedTensorMeter:
    """Live and peak bytes of the tensors autograd saves for backward, while inside `with`.

    Counts each storage once and skips the storages of `exclude`. A storage stays counted until
    autograd drops the last saved tensor in it (after backward, or with the graph), inside the
    block or not: wrap forward *and* backward where backward saves tensors too (recomputation).
    The hooks are thread-local, so each thread-rank meters its own graph. When autograd fires
    them: pack when an op saves a tensor for backward, unpack when backward reads it.
    `bytes_of[key]`: the bytes a `counting(key)` block added (kept after they are dropped).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.live, self.peak = 0, 0
        self.holders: dict[int, list[int]] = {}  # storage address -> [count, nbytes]
        self.bytes_of: dict[Hashable, int] = {}

    def __enter__(self) -> SavedTensorMeter:
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    @contextlib.contextmanager
    def counting(self, key: Hashable):
        """Meter the block, and note under bytes_of[key] the bytes it added."""
        before = self.live
        with self:
            yield self
        self.bytes_of[key] = self.live - before

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in self.skip:
            return t
        if key not in self.holders:
            self.holders[key] = [0, t.untyped_storage().nbytes()]
            self.live += self.holders[key][1]
            self.peak = max(self.peak, self.live)
        self.holders[key][0] += 1
        # detached: a saved output holding its own grad_fn would be a cycle only gc frees
        return _Held(t.detach(), self, key)

    @staticmethod
    def _unpack(held) -> torch.Tensor:
        return held.t if isinstance(held, _Held) else held

    def _release(self, key: int) -> None:
        self.holders[key][0] -= 1
        if self.holders[key][0] == 0:
            self.live -= self.holders.pop(key)[1]


def storage_nbytes(tensors: list) -> int:
    """Bytes of the distinct storages behind tensors (views counted once, freed ones as 0);
    None entries are skipped."""
    seen = {}
    for t in tensors:
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    seen.pop(0, None)  # freed or empty storages
    return sum(seen.values())


class LiveTensorMeter(TorchDispatchMode):
    """Live and peak bytes of the tensors ops create while inside `with`, per kind.

    kind(t) -> str names each new storage's kind when first seen (its first tensor decides);
    live[kind], peak[kind] in bytes, peak["total"] the peak of all kinds at once. A storage
    counts until the last tensor object that op outputs made of it is freed; one kept only by
    autograd's graph (a saved tensor) is missed: meter those with SavedTensorMeter.
    Inside `with meter.paused():` nothing is recorded: wrap a transport's own buffers in it (the
    threads backend's copy of a sent message). A TorchDispatchMode: it sees every op on this
    thread, below autograd, so each thread-rank meters its own.
    """

    def __init__(self, kind=lambda t: "all"):
        super().__init__()
        self.kind, self.off = kind, False
        self.live: dict[str, int] = {}
        self.peak: dict[str, int] = {"total": 0}
        self.holders: dict[int, list] = {}  # storage address -> [tensors alive, nbytes, kind]

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # nothing here is compiled: without this, torch wraps __torch_dispatch__ in
        # torch._dynamo.disable, whose first call imports the compiler (20 s on a loaded CPU)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.off:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._hold(t)
        return out

    @contextlib.contextmanager
    def paused(self):
        """Record nothing inside (tensors made there are not this algorithm's)."""
        was, self.off = self.off, True
        try:
            yield
        finally:
            self.off = was

    def _hold(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0:  # an empty tensor: no allocation
            return
        if key not in self.holders:
            kind = self.kind(t)
            self.holders[key] = [0, storage.nbytes(), kind]
            self.live[kind] = self.live.get(kind, 0) + storage.nbytes()
            self.peak[kind] = max(self.peak.get(kind, 0), self.live[kind])
            self.peak["total"] = max(self.peak["total"], sum(self.live.values()))
        self.holders[key][0] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        held = self.holders.get(key)
        if held is not None:
            held[0] -= 1
            if held[0] == 0:
                self.live[held[2]] -= held[1]
                del self.holders[key]
