"""The MPI backend: mpi4py over the MPI library that pip installs (MPICH's wheel).

CPU tensors travel as zero-copy buffers: mpi4py reads the tensor's memory through numpy.
Two traps, both handled here so no caller ever gets wrong numbers:
- mpi4py sends whatever *storage* a buffer has. A transposed (non-contiguous) tensor would go
  out in storage order, silently scrambled. Every tensor is made contiguous first, and a
  non-contiguous receive buffer is filled through a contiguous copy.
- MPI has no reduction for bfloat16, float16 or bool. For those, the ranks exchange raw bytes
  (all-gather, or all-to-all for reduce-scatter) and fold them in torch, in rank order, so every
  rank computes bitwise the same result.
GPU tensors are staged through host memory (the pip MPICH is not CUDA-aware); use `nccl` for GPUs.

No wrong numbers from a mismatch either. A message's MPI tag is the user's tag times 16 plus
its dtype's code, so an int32 message never lands in a float32 buffer of the same size; MPI
itself reports a message of another size (`Get_count`, truncation). A receive that waits while
a message with its tag but another dtype is pending says so (probed in the slow phase of the
wait). Every collective starts by agreeing on its signature (agreement.start_collective, the
start the backends share; `_gather` is MPI's part): one all-gather of a fixed-size row per rank,
the signature's text and, for a payload of at most fused_bytes, the payload itself, which is
then folded locally (one collective in all); a larger payload follows in the library's own
collective. A comm that trusts a plan (trust: the collectives it will serve, agreed once) checks
each of them on its own rank instead, with no all-gather.

Per message, only what a small message can afford: mpi4py is handed the tensor's address
(`_buffer`), not a numpy view (measured 17 us against 2 us per message on a busy machine).

Every operation is non-blocking underneath (Isend, Iallreduce, ...) and waited on by polling,
so every wait has a timeout that names the rank, operation, sequence number and peer.

    mpiexec -n 4 python script.py      # script: comm = minidist.init()
"""

from __future__ import annotations

import functools
import time

import torch

from . import leftovers
from .agreement import slot_bytes, start_collective
from .agreement import trust as _trust
from .exits import LOOK_EVERY, left_words
from .protocol import (
    DEFAULT_TIMEOUT,
    DTYPE_CODE,
    DTYPES,
    MAX_TAG,
    Blocking,
    CallbackWork,
    CommError,
    CommTimeout,
    DoneWork,
    PeerFailed,
    SelfMessages,
    check_peer,
    check_tag,
    describe,
    dtype_name,
    poll_until,
    reduce_rows,
)
from .tagged import timeout_note

GRACE = 0.5  # seconds a wait goes on after a rank it waits for was seen to end (_stuck)
CODES = 16  # wire tag = tag * CODES + dtype code: MAX_TAG * CODES stays below MPICH's TAG_UB
EXIT_TAG = MAX_TAG * CODES  # above every message's: a rank's word at exit (leftovers.py)


def _wire_tag(tag: int, dtype: torch.dtype) -> int:
    return tag * CODES + DTYPE_CODE.get(dtype, len(DTYPES))


@functools.cache  # the import is cheap only the first time; every message asks for MPI
def _mpi():
    """The mpi4py.MPI module, imported on first use: importing it initialises MPI."""
    from mpi4py import MPI

    return MPI


def _native_type(dtype: torch.dtype):
    """The MPI datatype MPI can *reduce* for this torch dtype, or None."""
    MPI = _mpi()
    return {
        torch.float32: MPI.FLOAT,
        torch.float64: MPI.DOUBLE,
        torch.int8: MPI.INT8_T,
        torch.int16: MPI.INT16_T,
        torch.int32: MPI.INT32_T,
        torch.int64: MPI.INT64_T,
        torch.uint8: MPI.UINT8_T,
    }.get(dtype)


class _RequestWork:
    """One MPI request, waited on with a timeout; `status` (receives) tells what arrived."""

    def __init__(self, comm: MPIComm, request, what: str, seq: int, peer=None, keep=None, tag=None):
        self.comm = comm
        self.request = request
        self.what = what
        self.seq = seq
        self.peer = peer
        self.tag = tag  # a message's: its timeout says what the peer sent instead (see wait)
        self.keep = keep  # the tensors whose memory MPI reads or writes: alive until done
        self.status = None  # a receive sets an MPI.Status: polling allocates nothing
        self.done = False
        self.stuck = None  # called while a wait drags on: may raise to say why
        self.next_look = 0.0  # when to look at the comm's roll again (time.monotonic())
        self.left = None  # (words, when first seen) of a rank it waits for that has ended

    def is_completed(self) -> bool:
        if not self.done:
            try:
                self.done = self.request.Test(self.status)
            except _mpi().Exception as e:  # e.g. a message larger than the receive buffer
                raise CommError(f"{self.describe()}: {e.Get_error_string()}") from None
            if self.done:  # a receive's stuck closes over this work and its buffer: a cycle
                self.stuck = None  # only the garbage collector would free, buffer and all
        return self.done

    def describe(self) -> str:
        return describe(self.comm, self.what, self.seq, self.peer)

    def cancel(self) -> None:
        """Withdraw a receive that timed out: left posted, it would take a later message into
        a buffer nobody holds, and keep MPI_Finalize waiting on it at exit."""
        self.request.Cancel()
        self.request.Wait()
        self.done = True

    def wait(self) -> None:
        if self.is_completed():
            return
        try:
            poll_until(self.is_completed, self.comm.timeout, self.describe, self._stuck)
        except CommTimeout as e:
            if self.status is not None:  # a receive: cancel it, as _other_dtype does
                self.cancel()
            if self.tag is None:
                raise
            sent = self.comm.unclaimed(self.peer)
            raise CommTimeout(f"{e}{timeout_note(self.tag, self.peer, sent)}") from None

    def _stuck(self) -> None:
        """While the wait drags on: the receive's own check (stuck), and every LOOK_EVERY s
        the comm's roll. A rank this waits for has ended (a message: its peer; a collective:
        every rank of the comm): PeerFailed naming it, after GRACE s more (its last messages
        may still be on their way when its end is seen), so a wait ends within a second of
        a peer leaving instead of at the timeout."""
        if self.stuck is not None:
            self.stuck()
        now = time.monotonic()
        if self.comm.roll is None or now < self.next_look:
            return
        self.next_look = now + LOOK_EVERY
        if self.left is None:
            ranks = self.comm.world_ranks
            words = left_words(self.comm.roll, ranks if self.tag is None else [ranks[self.peer]])
            self.left = (words, now) if words else None
        if self.left is not None and now - self.left[1] > GRACE:
            if self.status is not None:  # a receive: cancel it, as a timeout does
                self.cancel()
            raise PeerFailed(f"{self.describe()} failed: {self.left[0]}")


def _buffer(host: torch.Tensor, mpi_type=None) -> list:
    """[memory, type] over host's bytes (contiguous, on the CPU), for mpi4py: no copy, and no
    numpy or byte view per message (they cost more than a small message itself). MPI does not
    hold host alive: the caller keeps it until the request is done."""
    MPI = _mpi()
    memory = MPI.buffer.fromaddress(host.data_ptr(), host.numel() * host.element_size())
    return [memory, MPI.BYTE if mpi_type is None else mpi_type]


class MPIComm(Blocking):
    """A `Comm` over an mpi4py communicator (COMM_WORLD by default)."""

    backend = "mpi"
    codes = CODES  # the wire's tag encoding and the exit word's tag, for leftovers.py
    exit_tag = EXIT_TAG
    fused_bytes = 1024  # a payload this small rides in the agreement (agreement.py): 1 KiB here
    roll = None  # who has ended (exits.py; minidist run's folder): a wait fails naming a peer
    # that left, within a second; None (mpiexec by hand): such a wait lasts until the timeout
    job = None  # the world comm's MPIJob, where no `minidist run` watches (launch.init)

    def __init__(self, mpi_comm=None, timeout: float = DEFAULT_TIMEOUT):
        MPI = _mpi()
        self.mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.rank = self.mpi_comm.Get_rank()
        self.world_size = self.mpi_comm.Get_size()
        # each rank's rank in COMM_WORLD: the roll and the launcher number ranks so
        world = MPI.COMM_WORLD.Get_group()
        self.world_ranks = self.mpi_comm.Get_group().Translate_ranks(None, world)
        self.timeout = timeout
        self.seq = 0
        self.collectives = 0  # collectives issued: the number a mismatch is reported with
        self.plan = None  # an AgreedPlan (trust): its collectives skip the per-call agreement
        self.to_self = SelfMessages(self)
        leftovers.watch(self)  # at exit: a message no receive took is an error

    def __repr__(self) -> str:
        return f"MPIComm(rank={self.rank}, world_size={self.world_size})"

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """t itself when MPI can use its memory directly, else a contiguous host copy."""
        if t.is_cpu and t.is_contiguous():
            return t
        return t.detach().to("cpu", memory_format=torch.contiguous_format).contiguous()

    def _back(self, host: torch.Tensor, t: torch.Tensor):
        """A callback that copies `host` into `t` when they are not the same memory."""
        return (lambda: None) if host is t else (lambda: t.copy_(host.reshape(t.shape)))

    # point-to-point: raw bytes, so every dtype (bf16, bool, ...) travels the same way

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0):
        check_peer(self, dst, "dst")
        check_tag(self, tag)
        self.seq += 1
        if dst == self.rank:
            return self.to_self.send(t, tag)
        host = self._host(t)
        req = self.mpi_comm.Isend(_buffer(host), dst, _wire_tag(tag, t.dtype))
        return _RequestWork(self, req, f"send(tag={tag})", self.seq, dst, keep=host, tag=tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> CallbackWork:
        check_peer(self, src, "src")
        check_tag(self, tag)
        self.seq += 1
        if src == self.rank:
            return self.to_self.recv(t, tag, self.seq)
        host = self._host(t)
        req = self.mpi_comm.Irecv(_buffer(host), src, _wire_tag(tag, t.dtype))
        work = _RequestWork(self, req, f"recv(tag={tag})", self.seq, src, keep=host, tag=tag)
        work.status = _mpi().Status()
        work.stuck = lambda: self._other_dtype(t, src, tag, work)

        def finish():
            got, nbytes = work.status.Get_count(_mpi().BYTE), host.numel() * host.element_size()
            if got != nbytes:
                raise CommError(
                    f"{describe(self, 'recv', work.seq, src)}: the message holds {got} bytes, "
                    f"the buffer {nbytes} ({t.numel()} x {t.dtype})"
                )
            if host is not t:
                t.copy_(host.reshape(t.shape))

        return CallbackWork(work, finish)

    def _other_dtype(self, t: torch.Tensor, src: int, tag: int, work: _RequestWork) -> None:
        """Raise CommError if src has sent a message with this tag but another dtype: its wire
        tag differs, so it would never match this receive (probing costs only while waiting).
        The receive is cancelled first: left posted, it would take a later message."""
        status, mine = _mpi().Status(), _wire_tag(tag, t.dtype)
        for code in range(CODES):
            wire = tag * CODES + code
            if wire != mine and self.mpi_comm.Iprobe(src, wire, status):
                work.cancel()
                size = DTYPES[code].itemsize if code < len(DTYPES) else 1
                raise CommError(
                    f"{describe(self, f'recv(tag={tag})', work.seq, src)}: rank {src} sent "
                    f"{status.Get_count(_mpi().BYTE) // size} x {dtype_name(code)}, this rank "
                    f"expects {t.numel()} x {t.dtype} (shape {tuple(t.shape)})"
                )

    def unclaimed(self, peer: int) -> list[tuple[int, str]]:
        """[(tag, '4 x torch.float32')]: the oldest message from peer that no receive here has
        taken, if any (MPI's Iprobe with any tag: asked only when a wait has timed out)."""
        status = _mpi().Status()
        if not self.mpi_comm.Iprobe(peer, _mpi().ANY_TAG, status):
            return []
        tag, code = divmod(status.Get_tag(), CODES)
        size = DTYPES[code].itemsize if code < len(DTYPES) else 1
        return [(tag, f"{status.Get_count(_mpi().BYTE) // size} x {dtype_name(code)}")]

    # collectives

    def iall_reduce(self, t: torch.Tensor, op: str = "sum") -> CallbackWork:
        if start_collective(self, self._gather, "all_reduce", t, op=op):
            return DoneWork()
        host, rows = self._host(t), None
        mpi_type = _native_type(t.dtype)
        if mpi_type is None:  # no MPI reduction for this dtype: gather bytes, fold in torch
            rows = torch.empty((self.world_size, host.numel()), dtype=t.dtype)  # (p, N)
            req = self.mpi_comm.Iallgather(_buffer(host), _buffer(rows))
            fold = lambda: host.copy_(reduce_rows(rows, op).reshape(host.shape))  # noqa: E731
        else:
            buf = _buffer(host, mpi_type)
            req = self.mpi_comm.Iallreduce(_mpi().IN_PLACE, buf, self._mpi_op(op))
            fold = lambda: None  # noqa: E731
        work = _RequestWork(self, req, f"all_reduce(op={op})", self.seq, keep=(host, rows))

        def finish():
            fold()
            if op == "avg":
                host.div_(self.world_size)
            self._back(host, t)()

        return CallbackWork(work, finish)

    def ireduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum"):
        if start_collective(self, self._gather, "reduce_scatter", out, inp, op=op):
            return DoneWork()
        src = self._host(inp)
        dst = self._host(out)
        rows = None
        mpi_type = _native_type(inp.dtype)
        if mpi_type is None:  # each rank receives every rank's copy of its chunk, then folds
            rows = torch.empty((self.world_size, out.numel()), dtype=out.dtype)
            req = self.mpi_comm.Ialltoall(_buffer(src), _buffer(rows))
            fold = lambda: dst.copy_(reduce_rows(rows, op).reshape(dst.shape))  # noqa: E731
        else:
            req = self.mpi_comm.Ireduce_scatter_block(
                _buffer(src, mpi_type),
                _buffer(dst, mpi_type),
                self._mpi_op(op),
            )
            fold = lambda: None  # noqa: E731
        work = _RequestWork(self, req, f"reduce_scatter(op={op})", self.seq, keep=(src, dst, rows))

        def finish():
            fold()
            if op == "avg":
                dst.div_(self.world_size)
            self._back(dst, out)()

        return CallbackWork(work, finish)

    def iall_gather(self, out: torch.Tensor, inp: torch.Tensor) -> CallbackWork:
        if start_collective(self, self._gather, "all_gather", out, inp):
            return DoneWork()
        src, dst = self._host(inp), self._host(out)
        req = self.mpi_comm.Iallgather(_buffer(src), _buffer(dst))
        work = _RequestWork(self, req, "all_gather", self.seq, keep=(src, dst))
        return CallbackWork(work, self._back(dst, out))

    def ibroadcast(self, t: torch.Tensor, src: int) -> CallbackWork:
        if start_collective(self, self._gather, "broadcast", t, src=src):
            return DoneWork()
        host = self._host(t)
        req = self.mpi_comm.Ibcast(_buffer(host), root=src)
        work = _RequestWork(self, req, f"broadcast(src={src})", self.seq, src, keep=host)
        return CallbackWork(work, self._back(host, t))

    def barrier(self) -> None:
        # an all-gather: no rank leaves before all arrive
        start_collective(self, self._gather, "barrier")

    def trust(self, signatures: list[str]) -> None:
        """Agree once, with every rank, on the library collectives this comm will serve from now
        on, in this order, repeating (agreement.trust): each is then checked on its own rank
        alone, without an agreement of its own. Collective."""
        _trust(self, signatures, self._gather)

    def _gather(self, row: bytes, what: str) -> bytearray:
        """Every rank's row of a collective's agreement (agreement.start_collective), rank after
        rank: MPI alone would match the payloads by order, checking nothing."""
        rows = bytearray(self.world_size * slot_bytes(self))
        MPI = _mpi()
        req = self.mpi_comm.Iallgather([row, MPI.BYTE], [rows, MPI.BYTE])
        _RequestWork(self, req, what, self.seq).wait()
        return rows

    def split(self, color: int) -> MPIComm:
        """Ranks with equal `color` form a new comm, keeping their order. Collective."""
        # agree first under a timeout, so a rank that never calls split cannot hang the rest
        self.all_gather(torch.empty(self.world_size, dtype=torch.int64), torch.tensor([color]))
        comm = MPIComm(self.mpi_comm.Split(color, self.rank), self.timeout)
        comm.roll = self.roll
        return comm

    def _mpi_op(self, op: str):
        MPI = _mpi()
        return {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
