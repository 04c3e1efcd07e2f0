"""The torch.distributed backends: Gloo for CPU tensors, NCCL for GPU tensors.

One class serves both; the backend name decides the device. Gloo runs over TCP, so it works
anywhere (also across machines without MPI); NCCL is what GPUs use (one rank per GPU).

Every operation is issued asynchronously (`async_op=True`) and waited on with this comm's
timeout, so a hang becomes `CommTimeout` naming rank, operation, sequence number and peer.
No wrong numbers from a mismatch (Gloo fills a larger receive buffer silently, aborts on a
smaller one, matches collectives by order alone): messages travel framed with their count and
dtype, a large one's bulk beside the frame straight from storage to storage (frames.py), and
every collective starts with agreement.start_collective (the start every backend shares: the
checks, then one all-gather of the signature, `_gather`, carrying a small payload along so that
it needs no second one; on a comm that trusts a plan, agreed once, a check on its own rank).

Beware: after a timeout Gloo closes the connection, so the comm is unusable afterwards (the run
should end, which is what the launcher does). And Gloo's point-to-point receives report
`is_completed()` only once `wait()` has run: wait on them, do not poll them.

    torchrun --nproc-per-node 4 script.py   # script: comm = minidist.init()
"""

from __future__ import annotations

import atexit
import datetime
import gc
import socket
import time
import weakref

import torch
import torch.distributed as dist

from . import frames, leftovers
from .agreement import slot_bytes, start_collective
from .agreement import trust as _trust
from .exits import StoreJob, left_words
from .protocol import (
    DEFAULT_TIMEOUT,
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
    flat_bytes,
)
from .tagged import timeout_note

_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}
# newer torch renamed the flat-tensor collectives; use whichever this torch has
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def init_process_group(
    backend: str,
    rank: int,
    world_size: int,
    addr: str,
    port: int,
    timeout: float,
    local_rank: int | None = None,
    agent_serves: bool = False,
    watch: bool = False,
    attempt: int = 0,
) -> TorchDistComm:
    """Join the default process group over TCP at addr:port and return the world comm.

    nccl: this process drives GPU local_rank (its rank among the ranks of its machine).
    agent_serves: a launcher serves the store at addr:port (torchrun's agent, minidist run):
    join it.
    watch: no `minidist run` watches this job: the store tells every rank when one fails or
    ends (comm.job, a StoreJob of exits.py; attempt: torchrun's restart count, its keys').
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not 'gloo' or 'nccl'")
    device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend='nccl' needs CUDA, and torch.cuda.is_available() is False")
        local = rank if local_rank is None else local_rank
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is out of range for world_size={world_size}")
    wait = datetime.timedelta(seconds=timeout + 30)  # ours fires first and names the operation
    try:
        store = _store(rank, world_size, addr, port, wait, agent_serves=agent_serves)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=wait
        )
    except CommError:
        raise
    except RuntimeError as e:  # torch raises DistStoreError, a RuntimeError, after the timeout
        raise CommTimeout(
            f"rank {rank} of {world_size} ({backend}): rendezvous at tcp://{addr}:{port} failed "
            f"({e}). Are all WORLD_SIZE={world_size} ranks started, with the same MASTER_ADDR "
            f"and MASTER_PORT?"
        ) from e
    atexit.register(close_all)
    comm = TorchDistComm(None, backend, device, timeout)
    if watch and world_size > 1:
        host = None if agent_serves else 0  # the rank that serves the store, if one does
        prefix = f"minidist/{attempt}/"
        comm.job = StoreJob(store, rank, world_size, host, prefix, linger=timeout)
        comm.roll = comm.job
        # registered after close_all, so it runs before it (atexit runs the last first): this
        # rank's end is in the store before its connections close and wake a waiting peer
        atexit.register(comm.job.close)
    return comm


def _store(rank: int, world_size: int, addr: str, port: int, wait, agent_serves: bool = False):
    """The rendezvous store at addr:port. Rank 0 serves it on a socket it binds itself to addr
    alone (so a local job, MASTER_ADDR=127.0.0.1, is not reachable from other hosts), and a
    port already taken, by another job's store say, is an error at once, not a timeout.

    agent_serves: a launcher already serves the store at addr:port and says so to its ranks
    (TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent, minidist run): then every rank, rank 0
    too, joins it as a client; binding the port would find the launcher there."""
    if rank != 0 or agent_serves:
        return dist.TCPStore(addr, port, world_size, False, wait)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((addr, port))
    except OSError as e:
        listener.close()
        raise CommError(
            f"rank 0 of {world_size}: cannot serve the rendezvous at {addr}:{port}: "
            f"{e.strerror}. Another job may hold the port: give each job its own MASTER_PORT "
            f"(minidist run and torchrun serve the store themselves, on a port no job can take)"
        ) from None
    listener.listen(max(world_size, 1))
    port = listener.getsockname()[1]  # port 0 (a world of one): the one the OS chose
    fd = listener.detach()  # the store owns the socket from here on
    return dist.TCPStore(addr, port, world_size, True, wait, master_listen_fd=fd)


_split_comms: weakref.WeakSet = weakref.WeakSet()  # the comms split from the world: see close_all
_CLOSED = "closed by close_all"


def close_all() -> None:
    """End every process group while the interpreter is still whole (init registers this to run
    at exit). Destroying the groups is not enough: a split comm still holds its group, and the
    group's worker threads go on until the interpreter frees it at shutdown. A Gloo worker that
    frees a finished operation's tensors then needs the GIL, cannot take it, and the process
    aborts ("terminate called without an active exception"): now and then, after all the work
    is done. So drop those references too: each group's destructor joins its threads here (torch
    releases the GIL for it). The comms are unusable afterwards."""
    if is_initialized():
        dist.destroy_process_group()
    for comm in list(_split_comms):
        comm.group = _CLOSED
    gc.collect()


class _TorchWork:
    """torch.distributed Works (one operation's), waited on with a timeout naming the operation."""

    def __init__(self, comm: TorchDistComm, works: list, what: str, seq: int, peer=None):
        self.comm = comm
        self.works = works
        self.what = what
        self.seq = seq
        self.peer = peer
        self.done = False
        self.expects = None  # a receive's tensor: its timeout says what it expected
        self.tag = None  # a message's: its timeout names the collective it waited in

    def is_completed(self) -> bool:
        return self.done or all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        if self.done:
            return
        start = time.monotonic()
        try:
            for work in self.works:  # a message's frame, then its bulk (frames.py)
                work.wait(timeout=datetime.timedelta(seconds=self.comm.timeout))
        except RuntimeError as e:
            where = describe(self.comm, self.what, self.seq, self.peer)
            left = self.comm._left(self.what, self.peer)
            if time.monotonic() - start >= self.comm.timeout * 0.99:
                note = "" if self.tag is None else timeout_note(self.tag, self.peer, None)
                if self.expects is not None:
                    t = self.expects
                    note = f" (expects {t.numel()} x {t.dtype}; far other sizes never match){note}"
                note += f"; {left}" if left else ""
                raise CommTimeout(f"{where} timed out after {self.comm.timeout:g}s{note}") from e
            reason = f"{left}: {e}" if left else e
            raise PeerFailed(f"{where} failed: {reason}") from e
        self.done = True


class TorchDistComm(Blocking):
    """A `Comm` over a torch.distributed process group (None = the default group)."""

    fused_bytes = 16384  # rides in the agreement (agreement.py): gloo's choice; nccl shares it
    roll = None  # who has ended (exits.py): a failed wait names a peer that left; None: no one
    job = None  # the world comm's StoreJob, where no `minidist run` watches (init_process_group)

    def __init__(self, group, backend: str, device: torch.device, timeout=DEFAULT_TIMEOUT):
        self.group = group
        self.backend = backend
        self.device = device
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.seq = 0
        self.collectives = 0  # collectives issued: the number a mismatch is reported with
        self.plan = None  # an AgreedPlan (trust): its collectives skip the per-call agreement
        self.to_self = SelfMessages(self)
        self.sending: list[_TorchWork] = []  # sends not yet waited for (see isend)
        self.spares = frames.Spares(device)  # frame buffers to use again
        leftovers.watch(self)  # at exit: a send no receive took is an error

    def __repr__(self) -> str:
        return f"TorchDistComm({self.backend}, rank={self.rank}, world_size={self.world_size})"

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _dense(self, t: torch.Tensor) -> torch.Tensor:
        """t itself if contiguous, else a contiguous copy (the caller copies results back)."""
        return t if t.is_contiguous() else t.contiguous()

    def _issue(self, what: str, peer, start, *args, **kwargs):
        """start(*args, group=this comm's group, async_op=True, **kwargs), a torch.distributed
        collective. Gloo may fail at once when a peer has died (its connection is closed): that
        is a PeerFailed, as it would be in wait()."""
        return self._call(what, peer, start, *args, group=self.group, async_op=True, **kwargs)

    def _call(self, what: str, peer, fn, *args, **kwargs):
        """fn(*args, **kwargs), a dead peer's error (a closed connection) as a PeerFailed."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if not any(word in str(e) for word in ("closed", "reset", "Broken pipe")):
                raise
            left = self._left(what, peer)
            reason = f"{left}: {e}" if left else e
            raise PeerFailed(f"{describe(self, what, self.seq, peer)} failed: {reason}") from e

    def _left(self, what: str, peer) -> str:
        """'rank 1 ended (exit code 0) while this rank waited for it' when the roll has seen a
        rank that `what` waits for end (a message: its peer; a collective: every rank of this
        comm), else ''. Gloo's own words name an address, not a rank."""
        message = what.startswith(("send(", "recv("))
        waits_for = [peer] if message else range(self.world_size)
        return left_words(self.roll, [self._global(r) for r in waits_for])

    def _work(self, works, what, peer=None, finish=lambda: None) -> CallbackWork:
        works = works if isinstance(works, list) else [works]
        return CallbackWork(_TorchWork(self, works, what, self.seq, peer), finish)

    def _back(self, dense: torch.Tensor, t: torch.Tensor):
        return (lambda: None) if dense is t else (lambda: t.copy_(dense))

    # point-to-point: every message framed, its bulk beside it (frames.py), messages to self
    # kept here

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> CallbackWork:
        check_peer(self, dst, "dst")
        check_tag(self, tag)
        self.seq += 1
        if dst == self.rank:  # Gloo cannot send to itself
            return self.to_self.send(t, tag)
        dense, what = t.detach().contiguous(), f"send(tag={tag})"  # dense: t itself if contiguous
        nbytes = dense.numel() * dense.element_size()
        bulk = frames.bulk_bytes(nbytes)
        frame_bytes = frames.HEADER_BYTES + nbytes - bulk
        frame = frames.make_frame(dense, bulk, self.spares.take(frame_bytes))
        works = [self._p2p("send", what, dst, frame, frames.frame_tag(tag, frame_bytes))]
        if bulk:  # Gloo's Work holds the tensor (dense's memory) until the send is done
            data = flat_bytes(dense)[:bulk]
            works.append(self._p2p("send", what, dst, data, frames.bulk_tag(tag, bulk)))
        done = self._work(works, what, dst, lambda: self.spares.give(frame))
        done.inner.tag, done.inner.holds = tag, (dense.numel(), dense.dtype)  # (leftovers)
        # a Gloo send whose Work is freed before it completes is dropped: keep every send until
        # it is waited for, so a sender that raises (or forgets) still delivers what it started
        self.sending = [w for w in self.sending if not w.done] + [done.inner]
        return done

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> CallbackWork:
        check_peer(self, src, "src")
        check_tag(self, tag)
        self.seq += 1
        if src == self.rank:
            return self.to_self.recv(t, tag, self.seq)
        dense = self._dense(t)
        what = f"recv(tag={tag})"
        seq = self.seq
        nbytes = dense.numel() * dense.element_size()
        bulk = frames.bulk_bytes(nbytes)
        frame_bytes = frames.HEADER_BYTES + nbytes - bulk  # the sender's, if it sent what t holds
        frame = self.spares.take(1 << frame_bytes.bit_length())  # any frame of its size class
        works = [self._p2p("recv", what, src, frame, frames.frame_tag(tag, frame_bytes))]
        if bulk:  # posted now too: a sender that waits on its bulk must not wait for our wait()
            data = flat_bytes(dense)[:bulk]  # dense's own memory: the bulk lands there directly
            works.append(self._p2p("recv", what, src, data, frames.bulk_tag(tag, bulk)))

        def finish():
            sent = frames.mismatch(frame, dense)
            if sent is not None:
                raise CommError(
                    f"{describe(self, what, seq, src)}: rank {src} sent {sent}, this rank "
                    f"expects {t.numel()} x {t.dtype} (shape {tuple(t.shape)})"
                )
            frames.unframe(frame, dense, bulk)
            self.spares.give(frame)
            if rest is not None:  # the bulk, after the header: a bulk of another size never comes
                rest.wait()
            self._back(dense, t)()

        done = self._work(works[:1], what, src, finish)
        rest = self._work(works[1:], what, src) if bulk else None
        for waiting in (done.inner, (rest or done).inner):
            waiting.expects, waiting.tag = t, tag
        return done

    def _p2p(self, start: str, what: str, peer: int, t: torch.Tensor, wire_tag: int):
        """The process group's own send or recv of t with peer (a rank of this comm) under
        wire_tag: dist.isend and dist.irecv add only checks made here already, and a Python
        cost as large as a small message's."""
        pg = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        return self._call(what, peer, getattr(pg, start), [t], peer, wire_tag)

    # collectives

    def iall_reduce(self, t: torch.Tensor, op: str = "sum") -> CallbackWork:
        if start_collective(self, self._gather, "all_reduce", t, op=op):
            return DoneWork()
        dense = self._dense(t)
        reduce_op = getattr(dist.ReduceOp, _OPS[op])
        work = self._issue("all_reduce", None, dist.all_reduce, dense, op=reduce_op)

        def finish():
            if op == "avg":  # a sum then one division: the same numbers on every backend
                dense.div_(self.world_size)
            self._back(dense, t)()

        return self._work(work, f"all_reduce(op={op})", finish=finish)

    def ireduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum"):
        if start_collective(self, self._gather, "reduce_scatter", out, inp, op=op):
            return DoneWork()
        src, dst = self._dense(inp).reshape(-1), self._dense(out)
        reduce_op = getattr(dist.ReduceOp, _OPS[op])
        work = self._issue(
            "reduce_scatter", None, _reduce_scatter_flat, dst.reshape(-1), src, op=reduce_op
        )

        def finish():
            if op == "avg":
                dst.div_(self.world_size)
            self._back(dst, out)()

        return self._work(work, f"reduce_scatter(op={op})", finish=finish)

    def iall_gather(self, out: torch.Tensor, inp: torch.Tensor) -> CallbackWork:
        if start_collective(self, self._gather, "all_gather", out, inp):
            return DoneWork()
        src, dst = self._dense(inp).reshape(-1), self._dense(out)
        work = self._issue("all_gather", None, _all_gather_flat, dst.reshape(-1), src)
        return self._work(work, "all_gather", finish=self._back(dst, out))

    def ibroadcast(self, t: torch.Tensor, src: int) -> CallbackWork:
        if start_collective(self, self._gather, "broadcast", t, src=src):
            return DoneWork()
        dense = self._dense(t)
        work = self._issue("broadcast", src, dist.broadcast, dense, self._global(src))
        return self._work(work, f"broadcast(src={src})", src, self._back(dense, t))

    def barrier(self) -> None:
        # an all-gather: no rank leaves before all arrive
        start_collective(self, self._gather, "barrier")

    def trust(self, signatures: list[str]) -> None:
        """Agree once, with every rank, on the library collectives this comm will serve from now
        on, in this order, repeating (agreement.trust): each is then checked on its own rank
        alone, without an agreement of its own. Collective."""
        _trust(self, signatures, self._gather)

    def _gather(self, row: bytes, what: str):
        """Every rank's row of a collective's agreement (agreement.start_collective), rank after
        rank: Gloo alone would return wrong numbers on some ranks of a mismatch, or abort."""
        mine = torch.frombuffer(bytearray(row), dtype=torch.uint8).to(self.device)
        rows = mine.new_empty(self.world_size * slot_bytes(self))  # (p * slot,) bytes
        work = self._issue(what, None, _all_gather_flat, rows, mine)
        _TorchWork(self, [work], what, self.seq).wait()
        return rows.cpu().numpy()

    def split(self, color: int) -> TorchDistComm:
        """Ranks with equal `color` form a new comm, keeping their order. Collective."""
        mine = torch.tensor([color, _groups_made()], device=self.device)
        every = torch.empty(self.world_size, 2, dtype=torch.int64, device=self.device)
        self.all_gather(every, mine)
        members = [r for r, (c, _) in enumerate(every.tolist()) if c == color]
        ranks = [self._global(r) for r in members]
        # torch names a group after its ranks and the number of groups this process has made,
        # and members that disagree on the name wait for each other forever: first catch up
        # with the member that has made the most, with groups of one (no connections to make)
        target = max(every[r, 1].item() for r in members)
        while _groups_made() < target:
            dist.new_group([dist.get_rank()], use_local_synchronization=True)
        # only the members create (and synchronise on) their group: other colors do the same
        # for theirs at the same time
        group = dist.new_group(ranks, use_local_synchronization=True)
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            raise CommError(f"rank {self.rank}: split(color={color}) made no group")
        comm = TorchDistComm(group, self.backend, self.device, self.timeout)
        comm.roll = self.roll
        _split_comms.add(comm)
        return comm


def _groups_made() -> int:
    """How many process groups this process holds (torch's own count, part of a group's name)."""
    return len(dist.distributed_c10d._world.pg_names)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()
