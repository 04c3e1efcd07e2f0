"""The signature agreement of the library collectives: no rank ever folds a mismatched call.

Before a collective's payload moves, every rank must know that every other rank called the same
collective with the same shape, dtype, op and root: MPI and Gloo match collectives by order
alone, and a mismatch there gives wrong numbers, a crash or a hang. `agree` settles it in one
all-gather of a fixed-size row per rank (the signature's text, and a small payload with it), and
`finish_fused` completes a small collective from those rows, so that it costs one
synchronisation, checked, as it did unchecked. `start_collective` is the start of every library
collective of the mpi and torch.distributed backends, written once: the checks of its arguments,
its number, its agreement, and a small one finished there; a backend brings only its all-gather
of the rows. threads compares the same texts at its meeting point, debug mode (checked.py)
all-gathers them. A comm that serves the same collectives in the same order step after step
(data parallelism's buckets) can agree on that plan once (trust, AgreedPlan) and then check
each call on its own rank, with no all-gather.
See lessons/03_debugging_hangs, "No wrong numbers".
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from collections.abc import Callable

import numpy as np
import torch

from .protocol import CollectiveMismatch, check_gather, check_op, check_peer, reduce_rows

SIG_BYTES = 160  # a signature's text travels in this many bytes
# a library collective whose payload (its input) has at most comm.fused_bytes (a multiple of
# 16, so any dtype views a row) travels inside its agreement (see agree): one all-gather of
# slot_bytes(comm) a rank, no second collective. Each backend sets its own, where a second
# collective costs more than carrying the room in every agreement: mpi 1 KiB (a collective
# costs microseconds), gloo 16 KiB (hundreds: 4-16 KiB all-reduces ran at 0.46-0.59x the raw
# call's speed with 1 KiB, 0.61-1.11x with 16 KiB; mpi's 1 KiB went from 11.4 to 17.1 us with 16)


def slot_bytes(comm) -> int:
    """The bytes of one rank's row in comm's agreements: the text, then room for a payload."""
    return SIG_BYTES + comm.fused_bytes


def signature(name: str, t: torch.Tensor | None, **extra) -> str:
    """What must agree across ranks for a collective: 'all_reduce(shape=(4,), float32, op=sum)'."""
    if t is None:
        return _signature(name, None, None, tuple(extra.items()))
    return _signature(name, t.shape, t.dtype, tuple(extra.items()))


@functools.lru_cache(maxsize=4096)  # formatting costs more than a small message; loops repeat
def _signature(name: str, shape, dtype, extra: tuple) -> str:
    parts = [] if shape is None else [f"shape={tuple(shape)}", str(dtype).replace("torch.", "")]
    parts += [f"{k}={v}" for k, v in extra]
    return f"{name}({', '.join(parts)})"


@functools.lru_cache(maxsize=4096)  # a training loop repeats a few signatures
def _signature_bytes(sig: str) -> bytes:
    return sig.encode()[:SIG_BYTES].ljust(SIG_BYTES, b"\0")


def encode_signature(sig: str) -> torch.Tensor:
    """sig as SIG_BYTES bytes (uint8), zero-padded, for an all-gather."""
    return torch.frombuffer(bytearray(_signature_bytes(sig)), dtype=torch.uint8)


def decode_signature(row: torch.Tensor) -> str:
    return bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")


def start_collective(
    comm,
    gather: Callable,
    name: str,
    out: torch.Tensor | None = None,
    inp: torch.Tensor | None = None,
    op: str | None = None,
    src: int | None = None,
) -> bool:
    """The start of the library collective `name` on comm (mpi, gloo, nccl): check its
    arguments (ValueError), count it (comm.seq), and agree on its signature with every rank
    (agree: CollectiveMismatch on every rank, before any buffer is touched), its input riding
    along if small. True when that finished it (`out` holds this rank's result); False when the
    caller must now move the payload in the library's own collective.

    out: the result's tensor (all_reduce and broadcast: the input too; barrier: none); inp: the
    input of all_gather and reduce_scatter; op: the reduction's; src: broadcast's root.
    gather(row, what): the backend's all-gather of one row of bytes per rank, waited on under
    its timeout, `what` naming the operation if it times out (agree's gather)."""
    inp = out if inp is None else inp
    if op is not None:
        check_op(op, inp.dtype)
    if name in ("all_gather", "reduce_scatter"):
        check_gather(out, inp, comm.world_size, name)
    if src is not None:
        check_peer(comm, src, "src")
    comm.seq += 1
    extra = (("op", op),) if op is not None else (("src", src),) if src is not None else ()
    what = _what(name, extra)
    shape, dtype = (None, None) if inp is None else (inp.shape, inp.dtype)
    sig = _signature(name, shape, dtype, extra)
    if comm.plan is not None:  # agreed once for the whole sequence (trust): checked here alone
        comm.plan.check(comm, sig)
        return False
    rows = agree(comm, sig, lambda row: gather(row, what), inp)
    if rows is None:
        return False
    finish_fused(comm, rows, name, out, op or "sum", src or 0)
    return True


class AgreedPlan:
    """The library collectives a comm will be called for, in this order, over and over (a
    data-parallel step's bucket all-reduces), agreed by every rank once (trust) instead of
    before each one. Each call is checked against the plan on its own rank: a call off the plan
    raises CollectiveMismatch there, naming the call and what the plan expected, before any
    buffer is touched; the other ranks then wait in the plan's next collective until their
    timeout names it. So the promise stands (no rank folds a mismatched call), and a step's
    bucket all-reduces cost what the library's do (lesson 04: one synchronisation each, not two).
    """

    def __init__(self, signatures: list[str]):
        if not signatures:
            raise ValueError("an agreed plan needs at least one collective")
        self.signatures = list(signatures)
        self.next = 0

    def check(self, comm, sig: str) -> None:
        want = self.signatures[self.next]
        if sig != want:
            raise CollectiveMismatch(
                f"rank {comm.rank}: called {sig} where the agreed plan expects {want} (call "
                f"{self.next} of its {len(self.signatures)}): a comm that trusts a plan serves "
                f"that plan's collectives alone, in its order"
            )
        self.next = (self.next + 1) % len(self.signatures)


def trust(comm, signatures: list[str], gather: Callable) -> None:
    """Agree once, with every rank of comm, on the collectives it will be called for from now
    on (signatures, in order, repeating), then skip the per-call agreement for them (see
    AgreedPlan). Collective. CollectiveMismatch on every rank if the ranks' plans differ."""
    plan = AgreedPlan(signatures)
    text = "trust(" + ", ".join(plan.signatures) + ")"
    digest = f"trust({len(plan.signatures)} collectives, sha1 {_sha1(text)})"
    comm.seq += 1
    agree(comm, digest, lambda row: gather(row, "trust"))
    comm.plan = plan


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=256)
def _what(name: str, extra: tuple) -> str:
    """The operation as its timeout names it: 'all_reduce(op=sum)', 'barrier'."""
    return f"{name}({', '.join(f'{k}={v}' for k, v in extra)})" if extra else name


def agree(comm, sig: str, gather: Callable, payload: torch.Tensor | None = None):
    """Return once every rank of comm has called the collective `sig`; else raise
    CollectiveMismatch on every rank, naming who called what, before any buffer is touched.

    One all-gather: gather(row) all-gathers a row of slot_bytes(comm) from every rank and
    returns them, rank after rank, as one bytes-like object. A row holds the signature's text,
    then `payload`'s bytes if it has at most comm.fused_bytes. The rows have one size on every rank
    whatever each called, so even a mismatched agreement is a well-formed collective, and every
    rank sees every text. Returns the rows when the payloads rode along (finish_fused folds
    them: the collective is done, one synchronisation instead of two), else None (the caller
    moves the payload next). Plain bytes, not tensors: on a small collective, every tensor
    operation (microseconds each) would cost more than the bytes. comm.collectives numbers the
    collectives.
    """
    comm.collectives += 1
    mine = _signature_bytes(sig)
    room = comm.fused_bytes
    slot = slot_bytes(comm)
    nbytes = 0 if payload is None else payload.numel() * payload.element_size()
    fused = payload is not None and nbytes <= room
    data = tensor_bytes(payload) if fused else b""
    rows = memoryview(gather(mine + data + bytes(room - len(data)))).cast("B")
    p = comm.world_size
    texts = [rows[i * slot : i * slot + SIG_BYTES] for i in range(p)]
    if any(text != mine for text in texts):
        sigs = [bytes(text).rstrip(b"\0").decode(errors="replace") for text in texts]
        raise CollectiveMismatch(mismatch_message(comm, comm.collectives, sigs))
    return rows if fused else None


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A copy of t's bytes, in row-major order (any dtype, device, strides)."""
    if not (t.is_cpu and t.is_contiguous()):
        t = t.detach().to("cpu", memory_format=torch.contiguous_format).contiguous()
    nbytes = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b""


_NUMPY = {
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}
# bool: numpy's add and maximum are logical or, minimum is logical and, as reduce_ does
_NUMPY_OPS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}


def finish_fused(comm, rows, name: str, out: torch.Tensor, op="sum", src=0) -> torch.Tensor:
    """Fill `out` with this rank's result of collective `name` from the rows `agree` returned
    on comm: rank i's flattened input in row i. Every rank folds the same rows in rank order,
    so every rank holds bitwise the same result."""
    p = comm.world_size
    n = out.numel()
    slot = slot_bytes(comm)
    rank = comm.rank
    if name == "all_reduce" and out.dtype in _NUMPY and out.is_cpu and out.is_contiguous():
        return _all_reduce_numpy(rows, out, op, p, slot)  # the common case, without torch's
    k = {"all_gather": n // max(p, 1), "reduce_scatter": n * p}.get(name, n)  # per row
    table = torch.frombuffer(rows, dtype=torch.uint8).view(p, slot)
    data = table[:, SIG_BYTES : SIG_BYTES + k * out.element_size()].view(out.dtype)  # (p, k)
    if name == "all_gather":
        result = data
    elif name == "broadcast":
        result = data[src]
    else:  # all_reduce, or reduce_scatter: rank r's chunk of the rows
        result = reduce_rows(
            data if name == "all_reduce" else data[:, rank * n : (rank + 1) * n], op
        )
        if op == "avg":
            result.div_(p)
    return out.copy_(result.reshape(out.shape))


def _all_reduce_numpy(rows, out: torch.Tensor, op: str, p: int, slot: int) -> torch.Tensor:
    dtype, n = _NUMPY[out.dtype], out.numel()
    acc = np.frombuffer(rows, dtype, n, SIG_BYTES).copy()  # rank 0's row, then fold in order
    for i in range(1, p):
        _NUMPY_OPS[op](acc, np.frombuffer(rows, dtype, n, i * slot + SIG_BYTES), out=acc)
    if op == "avg":
        np.divide(acc, p, out=acc)
    if n:
        ctypes.memmove(out.data_ptr(), acc.__array_interface__["data"][0], acc.nbytes)
    return out


def mismatch_message(comm, seq: int, sigs: list[str]) -> str:
    """Name which ranks called what, grouped: 'ranks [0, 2]: all_reduce(...); rank 1: ...'."""
    groups: dict[str, list[int]] = {}
    for r, s in enumerate(sigs):
        groups.setdefault(s, []).append(r)
    parts = [
        f"ranks {rs}: {s}" if len(rs) > 1 else f"rank {rs[0]}: {s}" for s, rs in groups.items()
    ]
    return f"collective #{seq} differs across the {comm.world_size} ranks of {comm.backend}: " + (
        "; ".join(parts)
    )
