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

Every operation is non-blocking underneath (Isend, Iallreduce, ...) and waited on by polling,
so every wait has a timeout that names the rank, operation, sequence number and peer.

    mpiexec -n 4 python script.py      # script: comm = minidist.init()
"""

from __future__ import annotations

import functools

import torch

from .protocol import (
    DEFAULT_TIMEOUT,
    CallbackWork,
    CommError,
    check_gather,
    check_op,
    check_peer,
    describe,
    flat_bytes,
    poll_until,
    reduce_rows,
)


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
    """One MPI request, waited on with a timeout; `status` tells a receive's size."""

    def __init__(self, comm: MPIComm, request, what: str, seq: int, peer=None):
        self.comm, self.request, self.what, self.seq, self.peer = comm, request, what, seq, peer
        self.status = _mpi().Status()  # one per operation: polling allocates nothing
        self.done = False

    def is_completed(self) -> bool:
        if not self.done:
            self.done = self.request.Test(self.status)
        return self.done

    def wait(self) -> None:
        describe_me = lambda: describe(self.comm, self.what, self.seq, self.peer)  # noqa: E731
        poll_until(self.is_completed, self.comm.timeout, describe_me)


class MPIComm:
    """A `Comm` over an mpi4py communicator (COMM_WORLD by default)."""

    backend = "mpi"

    def __init__(self, mpi_comm=None, timeout: float = DEFAULT_TIMEOUT):
        MPI = _mpi()
        self.mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.rank = self.mpi_comm.Get_rank()
        self.world_size = self.mpi_comm.Get_size()
        self.timeout = timeout
        self.seq = 0

    def __repr__(self) -> str:
        return f"MPIComm(rank={self.rank}, world_size={self.world_size})"

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """t itself when MPI can use its memory directly, else a contiguous host copy."""
        if t.is_contiguous() and t.device.type == "cpu":
            return t
        return t.detach().to("cpu", memory_format=torch.contiguous_format).contiguous()

    def _back(self, host: torch.Tensor, t: torch.Tensor):
        """A callback that copies `host` into `t` when they are not the same memory."""
        return (lambda: None) if host is t else (lambda: t.copy_(host.reshape(t.shape)))

    # point-to-point: raw bytes, so every dtype (bf16, bool, ...) travels the same way

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> _RequestWork:
        check_peer(self, dst, "dst")
        self.seq += 1
        host = self._host(t)
        req = self.mpi_comm.Isend([flat_bytes(host).numpy(), _mpi().BYTE], dst, tag)
        work = _RequestWork(self, req, f"send(tag={tag})", self.seq, dst)
        work.keep = host  # the buffer must outlive the request
        return work

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> CallbackWork:
        check_peer(self, src, "src")
        self.seq += 1
        host = self._host(t)
        buf = flat_bytes(host)
        req = self.mpi_comm.Irecv([buf.numpy(), _mpi().BYTE], src, tag)
        work = _RequestWork(self, req, f"recv(tag={tag})", self.seq, src)

        def finish():
            got = work.status.Get_count(_mpi().BYTE)
            if got != buf.numel():
                raise CommError(
                    f"{describe(self, 'recv', work.seq, src)}: the message holds {got} bytes, "
                    f"the buffer {buf.numel()} ({t.numel()} x {t.dtype})"
                )
            self._back(host, t)()

        return CallbackWork(work, finish)

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(t, dst, tag).wait()

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self.irecv(t, src, tag).wait()
        return t

    # collectives

    def iall_reduce(self, t: torch.Tensor, op: str = "sum") -> CallbackWork:
        check_op(op, t.dtype)
        self.seq += 1
        host = self._host(t)
        mpi_type = _native_type(t.dtype)
        if mpi_type is None:  # no MPI reduction for this dtype: gather bytes, fold in torch
            rows = torch.empty((self.world_size, host.numel()), dtype=t.dtype)
            req = self.mpi_comm.Iallgather(
                [flat_bytes(host).numpy(), _mpi().BYTE], [flat_bytes(rows).numpy(), _mpi().BYTE]
            )
            fold = lambda: host.copy_(reduce_rows(rows, op).reshape(host.shape))  # noqa: E731
        else:
            buf = [flat_bytes(host).numpy(), mpi_type]
            req = self.mpi_comm.Iallreduce(_mpi().IN_PLACE, buf, self._mpi_op(op))
            fold = lambda: None  # noqa: E731
        work = _RequestWork(self, req, f"all_reduce(op={op})", self.seq)

        def finish():
            fold()
            if op == "avg":
                host.div_(self.world_size)
            self._back(host, t)()

        return CallbackWork(work, finish)

    def ireduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum"):
        check_op(op, inp.dtype)
        check_gather(out, inp, self.world_size, "reduce_scatter")
        self.seq += 1
        src, dst = self._host(inp), self._host(out)
        mpi_type = _native_type(inp.dtype)
        MPI = _mpi()
        if mpi_type is None:  # each rank receives every rank's copy of its chunk, then folds
            rows = torch.empty((self.world_size, out.numel()), dtype=out.dtype)
            req = self.mpi_comm.Ialltoall(
                [flat_bytes(src).numpy(), MPI.BYTE], [flat_bytes(rows).numpy(), MPI.BYTE]
            )
            fold = lambda: dst.copy_(reduce_rows(rows, op).reshape(dst.shape))  # noqa: E731
        else:
            req = self.mpi_comm.Ireduce_scatter_block(
                [flat_bytes(src).numpy(), mpi_type],
                [flat_bytes(dst).numpy(), mpi_type],
                self._mpi_op(op),
            )
            fold = lambda: None  # noqa: E731
        work = _RequestWork(self, req, f"reduce_scatter(op={op})", self.seq)

        def finish():
            fold()
            if op == "avg":
                dst.div_(self.world_size)
            self._back(dst, out)()

        return CallbackWork(work, finish)

    def iall_gather(self, out: torch.Tensor, inp: torch.Tensor) -> CallbackWork:
        check_gather(out, inp, self.world_size, "all_gather")
        self.seq += 1
        src, dst = self._host(inp), self._host(out)
        MPI = _mpi()
        req = self.mpi_comm.Iallgather(
            [flat_bytes(src).numpy(), MPI.BYTE], [flat_bytes(dst).numpy(), MPI.BYTE]
        )
        work = _RequestWork(self, req, "all_gather", self.seq)
        work.keep = src
        return CallbackWork(work, self._back(dst, out))

    def ibroadcast(self, t: torch.Tensor, src: int) -> CallbackWork:
        check_peer(self, src, "src")
        self.seq += 1
        host = self._host(t)
        req = self.mpi_comm.Ibcast([flat_bytes(host).numpy(), _mpi().BYTE], root=src)
        work = _RequestWork(self, req, f"broadcast(src={src})", self.seq, src)
        return CallbackWork(work, self._back(host, t))

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.iall_reduce(t, op).wait()
        return t

    def reduce_scatter(self, out, inp, op: str = "sum") -> torch.Tensor:
        self.ireduce_scatter(out, inp, op).wait()
        return out

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        self.iall_gather(out, inp).wait()
        return out

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        self.ibroadcast(t, src).wait()
        return t

    def barrier(self) -> None:
        self.seq += 1
        _RequestWork(self, self.mpi_comm.Ibarrier(), "barrier", self.seq).wait()

    def split(self, color: int) -> MPIComm:
        """Ranks with equal `color` form a new comm, keeping their order. Collective."""
        # agree first under a timeout, so a rank that never calls split cannot hang the rest
        self.all_gather(torch.empty(self.world_size, dtype=torch.int64), torch.tensor([color]))
        return MPIComm(self.mpi_comm.Split(color, self.rank), self.timeout)

    def _mpi_op(self, op: str):
        MPI = _mpi()
        return {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
