"""Collectives that overlap with compute: start one now, wait for it later.

Equals: the same collective called and waited for at once: the comm's own (iall_reduce,
ireduce_scatter, iall_gather) or the hand-written ring (collectives/algorithms.py), exactly
as those do.
Communication per call, per rank: that of the collective started (the ring's: 2 (p-1)/p N b for
an all-reduce, (p-1)/p N b for a reduce-scatter or an all-gather).
Memory per rank: nothing beyond the collective's own; the ring adds one worker thread.
Ladder: the comm's asynchronous collectives -> the ring on a worker thread (blocking code made
asynchronous: one worker, so every rank runs them in launch order).
Paper: Li et al., PyTorch Distributed: Experiences on Accelerating Data Parallel Training (VLDB
2020), section 3.2.3 (overlapping communication with backward).
Lesson: lessons/04_data_parallel/, lessons/07_zero/.   Run: minidist bench dp -n 2 --backend mpi
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import SimpleNamespace

import torch

from minidist.collectives.algorithms import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from minidist.comm.protocol import Comm, Work


class Launcher:
    """Starts collectives and returns a Work: the comm's own (asynchronous) ones, or the
    hand-written ring ones on one background thread (they are blocking code), so either
    overlaps with compute. data_parallel and zero launch their buckets through it.

    algorithm: "library" or "ring". With the ring, one worker runs the collectives in launch
    order, the same order on every rank (two at once would interleave their messages).
    """

    def __init__(self, comm: Comm, algorithm: str = "library"):
        if algorithm not in ("library", "ring"):
            raise ValueError(f"algorithm={algorithm!r} is not 'library' or 'ring'")
        self.comm, self.algorithm = comm, algorithm
        self.pool = ThreadPoolExecutor(1) if algorithm == "ring" else None

    def _start(self, library_work, ring_fn, *args) -> Work:
        if self.pool is None:
            return library_work()
        future = self.pool.submit(ring_fn, *args, self.comm)
        # a Work; not future.wait = future.result: that cycle would keep a buffer alive until gc
        return SimpleNamespace(wait=future.result, is_completed=future.done)

    def all_reduce(self, t: torch.Tensor) -> Work:
        """Start summing t in place over every rank (see ring_all_reduce)."""
        return self._start(partial(self.comm.iall_reduce, t, "sum"), ring_all_reduce, t)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """Start filling out with this rank's chunk of the sum of inp (see ring_reduce_scatter)."""
        issue = partial(self.comm.ireduce_scatter, out, inp, "sum")
        return self._start(issue, ring_reduce_scatter, out, inp)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """Start filling out with every rank's inp, in rank order (see ring_all_gather)."""
        return self._start(partial(self.comm.iall_gather, out, inp), ring_all_gather, out, inp)
