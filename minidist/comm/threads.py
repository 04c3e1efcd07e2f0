"""The threads backend: every rank is a thread of one process, every link a queue.

Fast and deterministic, no MPI needed: lessons start here and most property tests run here.
Tensors may live on the CPU or a GPU (one GPU can host a whole small "cluster").

How it works. A `ThreadsWorld` holds the shared state of one group of ranks: a mailbox per
(src, dst, tag) for point-to-point messages, and a table of rendezvous slots for collectives.
A send puts a *copy* of the tensor into the mailbox (so the sender may reuse its buffer at once).
What happens next is the world's choice of `sends`:
- "buffered" (the default, for demos): the send completes at once, as MPI_Bsend, or as a small
  message does in most MPI libraries (eager protocol);
- "rendezvous" (the tests and grading): a send completes only when its matching receive has
  been posted, as MPI_Ssend, and a non-blocking send's `wait` likewise. Any program correct
  under it is correct under every MPI library's buffering, at every message size; an ordering
  that can deadlock on some real system (two ranks that both send first) deadlocks here, every
  time, whatever the size.
Sends to self are buffered in both (the protocol promises it).

A collective is matched by its sequence number on the group: the k-th collective of every rank
meets in slot k. Each rank leaves a copy of its input; the first rank to wait after all have
arrived computes the result once, folding the inputs in rank order, so every rank gets bitwise
the same tensor. Because the threads share memory, the signature check of debug mode is always
on: ranks calling different collectives get `CollectiveMismatch` at once instead of a hang.

And because the world sees every rank, a deadlock needs no timeout: when every live rank is
blocked and nothing in flight can wake any, every rank raises `Deadlock` naming each rank's
call and the wait-for cycle (deadlock.py). At the end, `unreceived()` lists the messages no
receive took: the harness makes them an error.

    world = ThreadsWorld(4, sends="rendezvous")
    comms = [world.comm(r) for r in range(4)]      # hand one to each thread
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from .agreement import mismatch_message, signature
from .deadlock import Blocked, WaitForGraph
from .protocol import (
    DEFAULT_TIMEOUT,
    Blocking,
    CollectiveMismatch,
    CommError,
    CommTimeout,
    DoneWork,
    PeerFailed,
    check_gather,
    check_op,
    check_peer,
    check_tag,
    describe,
    reduce_rows,
)
from .tagged import timeout_note

SENDS = ("buffered", "rendezvous")


class ThreadsWorld:
    """Shared state of one group of `world_size` thread-ranks (a world or a split of one).

    sends: "buffered" (a send completes at once) or "rendezvous" (when its receive is posted,
    as MPI_Ssend). graph, ranks: a split's, given by its parent: the family's wait-for graph
    (whose condition guards every world of the family) and this world's ranks in the root."""

    def __init__(
        self,
        world_size: int,
        timeout: float = DEFAULT_TIMEOUT,
        sends: str = "buffered",
        graph: WaitForGraph | None = None,
        ranks: list[int] | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1")
        if sends not in SENDS:
            raise ValueError(f"sends={sends!r} is not one of {SENDS}")
        self.world_size = world_size
        self.timeout = timeout
        self.sends = sends
        self.graph = graph or WaitForGraph(world_size, __file__)
        self.ranks = list(range(world_size)) if ranks is None else ranks  # rank -> root rank
        self.cond = self.graph.cond
        self.mailbox: dict[tuple[int, int, int], deque] = {}  # (src, dst, tag) -> tensors
        self.posted: dict[tuple[int, int, int], int] = {}  # (src, dst, tag) -> receives posted
        self.slots: dict[int, _Slot] = {}  # collective sequence number -> rendezvous
        self.aborted: str | None = None
        self.children: list[ThreadsWorld] = []
        self.split_table: dict[tuple[int, int], ThreadsWorld] = {}  # (slot, color) -> group

    def comm(self, rank: int) -> ThreadsComm:
        """The communicator for `rank`; give each thread its own."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is out of range for world_size={self.world_size}")
        # the thread that makes a comm acts for its rank: made by hand for several ranks by one
        # thread that then waits, the ranks never all look blocked (no deadlock is invented)
        self.graph.seen(self.ranks[rank])
        return ThreadsComm(self, rank)

    def abort(self, reason: str) -> None:
        """Wake every waiting rank (here and in split groups) with CommError(reason)."""
        with self.cond:
            self.aborted = reason
            self.cond.notify_all()
        for child in self.children:
            child.abort(reason)

    def finish(self, rank: int, how: str = "returned") -> None:
        """`rank` ended without error (the harness says so): a rank waiting for it is told."""
        self.graph.finish(self.ranks[rank], how)

    def unreceived(self) -> list[str]:
        """The messages no receive took, here and in every split: one line each, naming
        source, destination, tag, shape and dtype ([] if none)."""
        with self.cond:
            left = [
                f"rank {self.ranks[src]} -> rank {self.ranks[dst]}, tag {tag}: "
                f"{tuple(msg.shape)} {msg.dtype}"
                for (src, dst, tag), box in sorted(self.mailbox.items())
                for msg in box
            ]
        return left + [line for child in self.children for line in child.unreceived()]

    def wait(
        self,
        ready: Callable[[], bool],
        what: Callable[[], str],
        timeout: float,
        rank: int | None = None,
        call: Callable[[], str] | None = None,
        peers: Callable[[], list[int]] | None = None,
        note: Callable[[], str] = lambda: "",
    ) -> None:
        """Block (holding self.cond) until ready(); CommTimeout/CommError with `what()`.

        rank, call, peers: who waits (this world's rank), in what ('recv(from 1, ...)') and
        for whom (this world's ranks): given, the wait-for graph raises `Deadlock` as soon as
        no rank can ever make ready() true (deadlock.py); not given, only the timeout ends it.
        note: what the deadlock report adds after the call (what the peer sent instead)."""
        if ready():
            return
        blocked = None
        if rank is not None:
            to_root = lambda: [self.ranks[p] for p in peers()]  # noqa: E731
            blocked = Blocked(call or what, ready, to_root, note)
        deadline = time.monotonic() + timeout
        try:
            while not ready():
                if self.aborted is not None:
                    raise PeerFailed(f"{what()} aborted: {self.aborted}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"{what()} timed out after {timeout:g}s")
                if blocked is not None:
                    self.graph.check(self.ranks[rank], blocked)
                self.cond.wait(min(left, 0.5))
        finally:
            if blocked is not None:
                self.graph.unblock()


class _Slot:
    """The meeting point of one collective: each rank's input and signature, then the result."""

    def __init__(self, p: int):
        self.inputs: list[torch.Tensor | None] = [None] * p
        self.sigs: list[str | None] = [None] * p
        self.result = None
        self.taken = 0


class _CollectiveWork:
    """Waits for all ranks at slot `seq`, then copies this rank's share of the result out."""

    def __init__(self, comm: ThreadsComm, slot: int, seq: int, name: str, finish: Callable):
        self.comm = comm
        self.slot = slot
        self.seq = seq
        self.name = name
        self.finish = finish
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        world, p = self.comm.world, self.comm.world_size
        with world.cond:
            slot = world.slots[self.slot]

            def arrived():
                return all(s is not None for s in slot.sigs)

            def missing():
                return [r for r, s in enumerate(slot.sigs) if s is None]

            def what():
                return describe(self.comm, self.name, self.seq) + f" waiting for ranks {missing()}"

            def call():  # a deadlock report numbers ranks as the root world does
                late = [world.ranks[r] for r in missing()]
                return f"{self.name} #{self.slot + 1} (waiting for ranks {late})"

            world.wait(arrived, what, self.comm.timeout, self.comm.rank, call, missing)
            if len(set(slot.sigs)) > 1:
                raise CollectiveMismatch(mismatch_message(self.comm, self.slot + 1, slot.sigs))
            if slot.result is None:
                slot.result = torch.stack([x.reshape(-1) for x in slot.inputs]) if p else None
            rows = slot.result  # (p, n): rank r's flattened input in row r
            slot.taken += 1
            if slot.taken == p:
                del world.slots[self.slot]
        self.finish(rows)
        self.done = True

    def is_completed(self) -> bool:
        if self.done:
            return True
        slot = self.comm.world.slots.get(self.slot)
        return slot is not None and all(s is not None for s in slot.sigs)


class _RecvWork:
    """A posted receive; receives on one channel complete in the order they were posted."""

    def __init__(self, comm: ThreadsComm, t: torch.Tensor, src: int, tag: int, seq: int):
        self.comm = comm
        self.t = t
        self.src = src
        self.tag = tag
        self.seq = seq
        self.done = False

    def wait(self) -> None:
        pending = self.comm.pending[(self.src, self.tag)]
        if self.src == self.comm.rank and not self.done:
            self._check_self(pending)
        try:
            while not self.done:
                pending[0]._complete()
                pending.popleft()
        except CommTimeout as e:
            raise CommTimeout(f"{e}{timeout_note(self.tag, self.src, self._unclaimed())}") from None

    def _unclaimed(self) -> list[tuple[int, str]]:
        """[(tag, '4 x torch.float32')]: src's oldest message to this rank on each other tag."""
        with self.comm.world.cond:
            firsts = [(key, box[0]) for key, box in self.comm.world.mailbox.items() if box]
        link = (self.src, self.comm.rank)
        return [(k[2], f"{m.numel()} x {m.dtype}") for k, m in firsts if k[:2] == link]

    def _call(self) -> str:
        """This receive in words, for a deadlock report: 'recv(from 1, tag 0, 4 float32)'."""
        src = self.comm.world.ranks[self.src]  # a deadlock report numbers ranks as the root
        return f"recv(from {src}, tag {self.tag}, {_shape(self.t)})"

    def _note(self) -> str:
        """What the peer sent instead: '; waiting in ring_all_reduce(sum); rank 1 sent this
        rank 4 x torch.float32 from ring_all_gather, which no receive here takes; ...'."""
        return timeout_note(self.tag, self.src, self._unclaimed())

    def _peers(self) -> list[int]:
        return [self.src]

    def _check_self(self, pending: deque) -> None:
        """A receive from self fails at once when no message waits for it: nobody else could
        send it, so waiting for the timeout would only hide the bug."""
        box = self.comm.world.mailbox.get((self.src, self.src, self.tag), ())
        if len(box) < list(pending).index(self) + 1:  # the receives ahead take a message each
            raise CommError(
                f"{describe(self.comm, f'recv(tag={self.tag})', self.seq, self.src)}: a receive "
                f"from self, and this rank sent itself no message"
            )

    def is_completed(self) -> bool:
        box = self.comm.world.mailbox.get((self.src, self.comm.rank, self.tag))
        return self.done or bool(box)

    def _complete(self) -> None:
        # lab 01.2 begin: wait (world.wait, naming rank, call, peer) for a message, check, copy it
        world, key = self.comm.world, (self.src, self.comm.rank, self.tag)
        with world.cond:
            box = world.mailbox.setdefault(key, deque())
            what = lambda: describe(self.comm, f"recv(tag={self.tag})", self.seq, self.src)  # noqa: E731
            rank = self.comm.rank
            call = self._call
            peers = self._peers
            world.wait(lambda: bool(box), what, self.comm.timeout, rank, call, peers, self._note)
            msg = box.popleft()
        if msg.numel() != self.t.numel() or msg.dtype != self.t.dtype:
            raise CommError(
                f"{describe(self.comm, 'recv', self.seq, self.src)}: the message holds "
                f"{msg.numel()} x {msg.dtype}, the buffer {self.t.numel()} x {self.t.dtype}"
            )
        self.t.copy_(msg.reshape(self.t.shape))
        self.done = True
        # lab 01.2 end


class _SendWork:
    """A rendezvous send: complete once the receiver has posted its receive for this message
    (the n-th message on a channel is matched by the n-th receive posted on it, as in MPI)."""

    def __init__(self, comm: ThreadsComm, dst: int, tag: int, n: int, t: torch.Tensor):
        self.comm = comm
        self.dst = dst
        self.tag = tag
        self.n = n
        self.seq = comm.seq
        self.shape = _shape(t)
        self.done = False

    def _matched(self) -> bool:
        key = (self.comm.rank, self.dst, self.tag)
        return self.comm.world.posted.get(key, 0) >= self.n

    def wait(self) -> None:
        if self.done:
            return
        world = self.comm.world
        what = lambda: describe(self.comm, f"send(tag={self.tag})", self.seq, self.dst)  # noqa: E731
        dst = world.ranks[self.dst]  # a deadlock report numbers ranks as the root world does
        call = lambda: f"send(to {dst}, tag {self.tag}, {self.shape})"  # noqa: E731
        with world.cond:
            try:
                world.wait(self._matched, what, self.comm.timeout, self.comm.rank, call, self._peer)
            except CommTimeout as e:
                raise CommTimeout(f"{e}; rank {self.dst} never posted its receive") from None
        self.done = True

    def _peer(self) -> list[int]:
        return [self.dst]

    def is_completed(self) -> bool:
        return self.done or self._matched()


def _shape(t: torch.Tensor) -> str:
    """'4 x 2 float32': a message's shape and dtype, as the deadlock report prints it."""
    sides = " x ".join(str(n) for n in t.shape) or "0-d"
    return f"{sides} {str(t.dtype).removeprefix('torch.')}"


class ThreadsComm(Blocking):
    """One thread-rank's view of a `ThreadsWorld`; implements the `Comm` protocol."""

    backend = "threads"

    def __init__(self, world: ThreadsWorld, rank: int):
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.timeout = world.timeout
        self.seq = 0  # operations issued by this rank on this comm (p2p and collective)
        self.collectives = 0  # collectives issued: the slot number of the next one
        self.pending: dict[tuple[int, int], deque] = {}  # (src, tag) -> posted receives
        self.sent: dict[tuple[int, int], int] = {}  # (dst, tag) -> messages sent (rendezvous)

    def __repr__(self) -> str:
        return f"ThreadsComm(rank={self.rank}, world_size={self.world_size})"

    # point-to-point

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> DoneWork | _SendWork:
        check_peer(self, dst, "dst")
        check_tag(self, tag)
        self.seq += 1
        self.world.graph.seen(self.world.ranks[self.rank])
        # lab 01.1 begin: append a copy of t to the mailbox (self.rank, dst, tag), wake waiters
        msg = t.detach().clone()  # buffered: the sender may overwrite t right away
        with self.world.cond:
            self.world.mailbox.setdefault((self.rank, dst, tag), deque()).append(msg)
            self.world.cond.notify_all()
        # lab 01.1 end
        if self.world.sends == "buffered" or dst == self.rank:
            return DoneWork()
        n = self.sent[(dst, tag)] = self.sent.get((dst, tag), 0) + 1
        return _SendWork(self, dst, tag, n, t)

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> _RecvWork:
        check_peer(self, src, "src")
        check_tag(self, tag)
        self.seq += 1
        self.world.graph.seen(self.world.ranks[self.rank])
        work = _RecvWork(self, t, src, tag, self.seq)
        self.pending.setdefault((src, tag), deque()).append(work)
        with self.world.cond:  # posted: a rendezvous send of src's waits for this
            key = (src, self.rank, tag)
            self.world.posted[key] = self.world.posted.get(key, 0) + 1
            self.world.cond.notify_all()
        return work

    # collectives: deposit a copy of the input, return a Work that computes this rank's share

    def _collective(self, name: str, inp: torch.Tensor, sig: str, finish) -> _CollectiveWork:
        self.seq += 1
        self.world.graph.seen(self.world.ranks[self.rank])
        slot_id = self.collectives
        self.collectives += 1
        with self.world.cond:
            slot = self.world.slots.setdefault(slot_id, _Slot(self.world_size))
            slot.inputs[self.rank] = inp.detach().clone()
            slot.sigs[self.rank] = sig
            self.world.cond.notify_all()
        return _CollectiveWork(self, slot_id, self.seq, name, finish)

    def iall_reduce(self, t: torch.Tensor, op: str = "sum") -> _CollectiveWork:
        check_op(op, t.dtype)

        def finish(rows):
            out = reduce_rows(rows, op)
            t.copy_((out / self.world_size if op == "avg" else out).reshape(t.shape))

        return self._collective("all_reduce", t, signature("all_reduce", t, op=op), finish)

    def ireduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum"):
        check_op(op, inp.dtype)
        check_gather(out, inp, self.world_size, "reduce_scatter")
        n = out.numel()

        def finish(rows):
            mine = reduce_rows(rows[:, self.rank * n : (self.rank + 1) * n], op)
            out.copy_((mine / self.world_size if op == "avg" else mine).reshape(out.shape))

        sig = signature("reduce_scatter", inp, op=op)
        return self._collective("reduce_scatter", inp, sig, finish)

    def iall_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _CollectiveWork:
        check_gather(out, inp, self.world_size, "all_gather")
        finish = lambda rows: out.copy_(rows.reshape(out.shape))  # noqa: E731
        return self._collective("all_gather", inp, signature("all_gather", inp), finish)

    def ibroadcast(self, t: torch.Tensor, src: int) -> _CollectiveWork:
        check_peer(self, src, "src")
        finish = lambda rows: t.copy_(rows[src].reshape(t.shape))  # noqa: E731
        return self._collective("broadcast", t, signature("broadcast", t, src=src), finish)

    def barrier(self) -> None:
        empty = torch.empty(0)
        self._collective("barrier", empty, "barrier()", lambda rows: None).wait()

    def split(self, color: int) -> ThreadsComm:
        """Ranks with equal `color` form a new comm, keeping their order. Collective."""
        colors = torch.empty(self.world_size, dtype=torch.int64)
        self.all_gather(colors, torch.tensor([color]))
        members = [r for r, c in enumerate(colors.tolist()) if c == color]
        new_rank = members.index(self.rank)
        # the first member creates the new world; the others pick it up from the same table
        with self.world.cond:
            world = self.world.split_table.get((self.collectives, color))
            if world is None:
                ranks = [self.world.ranks[m] for m in members]
                world = ThreadsWorld(
                    len(members), self.timeout, self.world.sends, self.world.graph, ranks
                )
                self.world.split_table[(self.collectives, color)] = world
                self.world.children.append(world)
        return world.comm(new_rank)
