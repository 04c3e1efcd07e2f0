"""The communicator contract every backend implements, and the checks they share.

A `Comm` is a group of ranks that can talk: point-to-point `send`/`recv` (and their
non-blocking `isend`/`irecv`), the library's own collectives (`all_reduce`, `reduce_scatter`,
`all_gather`, `broadcast`, `barrier`, each with an `i`-prefixed variant returning a `Work`), and
`split` into sub-communicators. Backends (`threads`, `mpi`, `torchdist`) implement it; the
wrappers in `comm/wrappers.py` wear it too, so techniques never know which backend moves their
bytes. Their one shared base, `Blocking`, holds no state: it writes each blocking operation once,
as its `i`-variant waited on.

Conventions shared by every backend (and asserted by tests/test_comm.py):
- Tensors are filled in place and also returned. Any shape, dtype, device the backend accepts,
  contiguous or not, 0-d or empty.
- `all_gather(out, inp)`: out.numel() == world_size * inp.numel(); the flattened `out` holds rank
  0's `inp`, then rank 1's, ... `reduce_scatter(out, inp, op)`: inp.numel() == world_size *
  out.numel(); rank r receives the reduction of the r-th flattened chunk of `inp`.
- op is one of "sum", "avg", "max", "min". "avg" needs a floating dtype. bool reduces as
  logical or (sum, max) and logical and (min).
- A tensor handed to an `i`-operation must not be touched until its `wait()` returns.
- Tags are 0 .. MAX_TAG-1. A receive gets a message of its own element count and dtype, or
  `CommError` naming both sides; ranks that call a collective with different shapes, dtypes,
  ops or roots get `CollectiveMismatch` on every rank. Never wrong numbers. A send to self is
  buffered; a receive from self with nothing sent fails at once.
- Every blocking wait has a timeout (seconds, `comm.timeout`); when it fires, `CommTimeout`
  names the rank, the operation, its sequence number on this comm and the peer.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

OPS = ("sum", "avg", "max", "min")
DEFAULT_TIMEOUT = 60.0
# every dtype a message can carry, by code: backends put the code on the wire (in the tag or a
# header), so a receiver can tell an int32 message from a float32 one of the same size
DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}  # any other dtype: len(DTYPES)
MAX_TAG = 1 << 24  # user tags are 0 .. MAX_TAG-1: backends keep the bits above for themselves


class CommError(RuntimeError):
    """A communication failed: a peer died, a message did not fit, or ranks disagree."""


class CommTimeout(CommError):
    """A blocking operation waited longer than the comm's timeout."""


class PeerFailed(CommError):
    """A peer died or closed its link, or the world was aborted: a consequence, not a cause.

    Launchers report the rank whose error is *not* a PeerFailed: that one failed first.
    """


class Deadlock(CommError):
    """No rank can proceed: every live rank waits for another (the threads world sees it at
    once), or a rank waits for one that has finished. Raised on every rank of the cycle."""


class CollectiveMismatch(CommError):
    """Ranks called different collectives, or the same one with different shapes or dtypes."""


@runtime_checkable
class Work(Protocol):
    """A pending operation: `wait()` blocks until it is done (or times out)."""

    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


@runtime_checkable
class Comm(Protocol):
    """A group of `world_size` ranks, this process (or thread) being `rank`."""

    rank: int
    world_size: int
    backend: str
    timeout: float

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None: ...
    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor: ...
    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Work: ...
    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Work: ...
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor: ...
    def iall_reduce(self, t: torch.Tensor, op: str = "sum") -> Work: ...
    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum"
    ) -> torch.Tensor: ...
    def ireduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum") -> Work: ...
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor: ...
    def iall_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work: ...
    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor: ...
    def ibroadcast(self, t: torch.Tensor, src: int) -> Work: ...
    def barrier(self) -> None: ...
    def split(self, color: int) -> Comm: ...


class Blocking:
    """The blocking operations, written once for every comm: each is its `i`-variant, waited on.

    Backends and wrappers list it as a base (`class MPIComm(Blocking)`) and implement only the
    non-blocking operations, `barrier` and `split`; it holds no state.
    """

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(t, dst, tag).wait()

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self.irecv(t, src, tag).wait()
        return t

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.iall_reduce(t, op).wait()
        return t

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.ireduce_scatter(out, inp, op).wait()
        return out

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        self.iall_gather(out, inp).wait()
        return out

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        self.ibroadcast(t, src).wait()
        return t


class DoneWork:
    """A `Work` that was complete when it was made (e.g. a buffered send)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class CallbackWork:
    """A `Work` that waits on `inner`, then runs `finish` once (copy back, divide for avg...)."""

    def __init__(self, inner: Work, finish: Callable[[], None]):
        self.inner = inner
        self.finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        self.inner.wait()
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()

    def is_completed(self) -> bool:
        return self.finish is None or self.inner.is_completed()


class SelfMessages:
    """The messages a rank sends to itself, by tag, kept in this process.

    No library delivers a message to self without a receive already posted (Gloo not at all),
    and a blocking send to self would wait for a receive that comes after it. So a send to self
    is buffered here, and a receive from self takes the oldest message with its tag or fails at
    once: nobody else can send it, waiting for the timeout would only hide the bug.
    """

    def __init__(self, comm):
        self.comm = comm
        self.boxes: dict[int, deque] = {}

    def send(self, t: torch.Tensor, tag: int) -> DoneWork:
        self.boxes.setdefault(tag, deque()).append(t.detach().clone())
        return DoneWork()

    def recv(self, t: torch.Tensor, tag: int, seq: int) -> CallbackWork:
        return CallbackWork(DoneWork(), lambda: self._take(t, tag, seq))

    def _take(self, t: torch.Tensor, tag: int, seq: int) -> None:
        where = describe(self.comm, f"recv(tag={tag})", seq, self.comm.rank)
        box = self.boxes.get(tag)
        if not box:
            raise CommError(f"{where}: a receive from self, and this rank sent itself no message")
        msg = box.popleft()
        if msg.numel() != t.numel() or msg.dtype != t.dtype:
            raise CommError(
                f"{where}: the message holds {msg.numel()} x {msg.dtype}, "
                f"the buffer {t.numel()} x {t.dtype}"
            )
        t.copy_(msg.reshape(t.shape))


def describe(comm, what: str, seq: int, peer: int | None = None) -> str:
    """The words every error uses: 'rank 1 of 4 (mpi): recv #7 from peer 0'."""
    where = f"rank {comm.rank} of {comm.world_size} ({comm.backend})"
    with_peer = "" if peer is None else f" with peer {peer}"
    return f"{where}: {what} #{seq}{with_peer}"


def poll_until(
    done: Callable[[], bool], timeout: float, what: Callable[[], str], stuck=None
) -> None:
    """Poll `done()` until it is true; CommTimeout after `timeout` seconds.

    Two phases, as MPI's own blocking waits do. For the first 50 ms, spin: MPI advances a
    non-blocking operation only while it is polled, so any sleep would stall every round of a
    collective; every 64 polls, yield the core (os.sched_yield) so that a peer sharing it can
    run. (Not time.sleep(0): that is a real sleep of the kernel's timer slack, measured at
    180 us on a busy 2-core machine, longer than a small message takes.) Then back off to 1 ms
    sleeps: a long wait (a straggler, a hang on its way to the timeout) should not burn a core.
    In that phase `stuck()`, if given, runs before each sleep: it may raise to say why nothing
    comes.
    """
    start = time.monotonic()
    deadline, patient = start + timeout, start + 0.05
    while True:
        for _ in range(64):
            if done():
                return
        now = time.monotonic()
        if now < patient:
            os.sched_yield()
            continue
        if now > deadline:
            raise CommTimeout(f"{what()} timed out after {timeout:g}s")
        if stuck is not None:
            stuck()
        time.sleep(1e-3)


def check_peer(comm, peer: int, name: str) -> None:
    """Raise ValueError unless 0 <= peer < world_size."""
    if not isinstance(peer, int) or not 0 <= peer < comm.world_size:
        raise ValueError(
            f"{name}={peer!r} is out of range for world_size={comm.world_size} "
            f"(rank {comm.rank}, {comm.backend})"
        )


def check_tag(comm, tag: int) -> None:
    """Raise ValueError unless 0 <= tag < MAX_TAG."""
    if not isinstance(tag, int) or not 0 <= tag < MAX_TAG:
        raise ValueError(f"tag={tag!r} is out of range 0..{MAX_TAG - 1} (rank {comm.rank})")


def dtype_name(code: int) -> str:
    """The dtype a wire code stands for, as the errors print it."""
    return str(DTYPES[code]) if 0 <= code < len(DTYPES) else "an unlisted dtype"


def check_op(op: str, dtype: torch.dtype) -> None:
    """Raise ValueError for an unknown op, or "avg" on a dtype that cannot be averaged."""
    if op not in OPS:
        raise ValueError(f"op={op!r} is not one of {OPS}")
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"op='avg' needs a floating dtype, got {dtype}")


def check_gather(out: torch.Tensor, inp: torch.Tensor, p: int, name: str) -> None:
    """Raise ValueError unless `big` holds exactly p times the elements of `small`, same dtype."""
    big, small = (out, inp) if name == "all_gather" else (inp, out)
    if big.numel() != p * small.numel():
        role = "out" if name == "all_gather" else "inp"
        raise ValueError(
            f"{name}: {role}.numel()={big.numel()} must be world_size={p} x "
            f"{small.numel()} (shapes out={tuple(out.shape)}, inp={tuple(inp.shape)})"
        )
    if out.dtype != inp.dtype:
        raise ValueError(f"{name}: out.dtype={out.dtype} differs from inp.dtype={inp.dtype}")


def reduce_(acc: torch.Tensor, x: torch.Tensor, op: str) -> torch.Tensor:
    """acc <- acc (op) x in place; "avg" accumulates a sum (the caller divides once)."""
    if op in ("sum", "avg"):
        if acc.dtype == torch.bool:
            return acc.logical_or_(x)
        return acc.add_(x)
    if op == "max":
        return torch.maximum(acc, x, out=acc)
    return torch.minimum(acc, x, out=acc)


def reduce_rows(rows: torch.Tensor, op: str) -> torch.Tensor:
    """Fold the rows of a (p, n) tensor in rank order 0, 1, ..., p-1 (deterministic)."""
    acc = rows[0].clone()
    for i in range(1, rows.shape[0]):
        reduce_(acc, rows[i], op)
    return acc


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor's bytes (any dtype, 0-d and empty included)."""
    if t.numel() == 0:  # torch calls an empty tensor of any strides contiguous: no bytes anyway
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8)
