"""Debug mode: catch ranks that disagree about what they are doing, instead of hanging.

Three mistakes make a distributed program hang or, worse, mix data silently:
- ranks call different collectives (rank 0 all_reduce, rank 1 all_gather), or the same one with
  different shapes or dtypes;
- a receive expects another size or dtype than the matching send carries;
- a message nobody receives, which a later receive with the same tag takes as if it were new.
(The backends check the first two on their own too, more cheaply: see lessons/03.)

`CheckedComm(comm)` wraps any comm. Before every collective, the ranks all-gather a short text
signature ("all_reduce(shape=(4,), float32, op=sum)") and compare them; every rank then raises
the same `CollectiveMismatch` naming which ranks called what. Then they all-gather how many
messages each sent to each and how many receives each posted, per peer, with a mark of their
tags (a sum over the messages of a number drawn from each tag: sent and posted differ when the
tags do), and name any message left unreceived: which tag, which of that (peer, tag)'s messages
by number (#1 the first), and how many receives took the earlier ones. Every message before a
collective must be received before it, so a receive can never take a message of an earlier
phase across one. Between two collectives nothing tells such a receive from a right one (the
same peer, tag and size): that is found at the next collective, or at the end of the program
(leftovers.py, every backend). With every message the sender sends a small header (element
count and dtype), started together with the data (neither send waits for the other), that the
receiver checks against its buffer. The price is two extra all-gathers per collective and one
extra message per send (lessons/03 measures it): turn it on while debugging
(`minidist.init(debug=True)` or MINIDIST_DEBUG=1), not for speed.
"""

from __future__ import annotations

import json

import torch

from .agreement import SIG_BYTES, mismatch_message
from .agreement import decode_signature as _decode
from .agreement import encode_signature as _encode
from .agreement import signature as _signature
from .protocol import DTYPES as _DTYPES
from .protocol import (
    Blocking,
    CallbackWork,
    CollectiveMismatch,
    CommError,
    describe,
)

DETAIL_BYTES = 4096  # a rank's (peer, tag) counts, exchanged only once a mismatch is found


def _mark(tag: int) -> int:
    """A number drawn from tag (Knuth's multiplicative hash): sums of marks differ when the
    multisets of tags do, but for a collision of chance."""
    return (tag + 1) * 2654435761 % (1 << 31)


def _header(t: torch.Tensor, device) -> torch.Tensor:
    code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
    return torch.tensor([t.numel(), code], dtype=torch.int64, device=device)


class CheckedComm(Blocking):
    """A comm that checks every collective's signature and every message's header."""

    def __init__(self, inner):
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.backend = inner.backend
        self.timeout = inner.timeout
        self.device = getattr(inner, "device", torch.device("cpu"))
        self.n_collectives = 0
        self.sent: dict[tuple[int, int], int] = {}  # (dst, tag) -> messages sent, since the start
        self.received: dict[tuple[int, int], int] = {}  # (src, tag) -> receives posted
        # per peer: messages sent, their tags' marks, receives posted, their marks (4 p numbers)
        self.counts = [0] * (4 * self.world_size)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def check(self, sig: str) -> None:
        """All-gather every rank's signature; if any differ, raise CollectiveMismatch on all."""
        self.n_collectives += 1
        # lab 03.1 begin: all-gather the encoded signatures; if any differ, raise on every rank
        rows = torch.empty((self.world_size, SIG_BYTES), dtype=torch.uint8, device=self.device)
        self.inner.all_gather(rows, _encode(sig).to(self.device))
        sigs = [_decode(r) for r in rows.cpu()]
        if len(set(sigs)) > 1:
            raise CollectiveMismatch(mismatch_message(self, self.n_collectives, sigs))
        # lab 03.1 end
        self.check_messages(sig)

    def check_messages(self, sig: str) -> None:
        """Raise CommError on every rank if a message sent before this collective has no
        receive posted for it (or a receive no message): a later receive with its tag would
        take it, silently stale. One all-gather of 4 p numbers per rank; a second one, of each
        rank's counts per (peer, tag), only to name what is wrong."""
        p = self.world_size
        rows = torch.empty((p, 4 * p), dtype=torch.int64, device=self.device)
        self.inner.all_gather(rows, torch.tensor(self.counts, device=self.device))
        rows = rows.cpu().tolist()  # rows[i]: rank i's sends to each rank, marks, receives, marks
        pairs = [  # (i, j): what rank i sent rank j is not what rank j posted receives for
            (i, j)
            for i in range(p)
            for j in range(p)
            if rows[i][j : 2 * p : p] != rows[j][2 * p + i :: p]
        ]
        if pairs:
            raise CommError(
                f"before collective #{self.n_collectives} ({sig}) on {self.backend}: "
                + "; ".join(self._unmatched(pairs))
                + ": every message must be received before the next collective (debug mode)"
            )

    def _unmatched(self, pairs: list[tuple[int, int]]) -> list[str]:
        """One line per (sender, receiver, tag) whose counts differ; every rank all-gathers its
        counts for the pairs (every rank sees the same pairs, so all of them call this)."""
        mine = [
            [i, j, tag, self.sent.get((j, tag), 0) if i == self.rank else -1, n]
            for i, j in pairs
            if j == self.rank
            for (src, tag), n in self.received.items()
            if src == i
        ] + [
            [i, j, tag, n, -1]
            for i, j in pairs
            if i == self.rank
            for (dst, tag), n in self.sent.items()
            if dst == j
        ]
        raw = json.dumps(mine).encode()[:DETAIL_BYTES]
        row = torch.zeros(DETAIL_BYTES, dtype=torch.uint8)
        row[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        rows = torch.empty((self.world_size, DETAIL_BYTES), dtype=torch.uint8, device=self.device)
        self.inner.all_gather(rows, row.to(self.device))
        counts: dict[tuple[int, int, int], list[int]] = {}  # (i, j, tag) -> [sent, posted]
        for r in rows.cpu():
            text = bytes(r.tolist()).rstrip(b"\0").decode(errors="replace")
            for i, j, tag, sent, posted in json.loads(text) if text.endswith("]") else []:
                seen = counts.setdefault((i, j, tag), [0, 0])
                seen[0] = max(seen[0], sent)
                seen[1] = max(seen[1], posted)
        return [
            _unmatched_words(i, j, tag, sent, posted)
            for (i, j, tag), (sent, posted) in sorted(counts.items())
            if sent != posted
        ] or [
            f"rank {i} and rank {j}: counts differ (more tags than fit: {DETAIL_BYTES} B)"
            for i, j in pairs
        ]

    def _count(self, counts: dict, peer: int, tag: int, at: int) -> None:
        """One more message (at=0) or receive (at=2) with peer under tag."""
        counts[peer, tag] = counts.get((peer, tag), 0) + 1
        self.counts[at * self.world_size + peer] += 1
        self.counts[(at + 1) * self.world_size + peer] += _mark(tag)

    # point-to-point: a header message first, checked by the receiver at wait()

    def isend(self, t, dst, tag=0):
        # both sends start before either is waited on: a blocking header would make any
        # exchange where both sides send first hang on Gloo, whose sends wait for their receive
        head_work = self.inner.isend(_header(t, self.device), dst, tag)
        data_work = self.inner.isend(t, dst, tag)
        self._count(self.sent, dst, tag, 0)
        return _Both(head_work, lambda: None, data_work)

    def irecv(self, t, src, tag=0):
        self._count(self.received, src, tag, 2)
        head = torch.empty(2, dtype=torch.int64, device=self.device)
        head_work = self.inner.irecv(head, src, tag)
        data_work = self.inner.irecv(t, src, tag)
        seq = getattr(self.inner, "seq", 0)  # the data receive's number on the inner comm

        def check():
            # lab 03.2 begin: compare the header (numel, dtype code) with t; CommError if not
            numel, code = head.tolist()
            dtype = _DTYPES[code] if code >= 0 else "an unknown dtype"
            if numel != t.numel() or dtype != t.dtype:
                raise CommError(
                    f"{describe(self, f'recv(tag={tag})', seq, src)}: rank {src} sent {numel} x "
                    f"{dtype}, this rank expects {t.numel()} x {t.dtype} "
                    f"(shape {tuple(t.shape)})"
                )
            # lab 03.2 end

        return CallbackWork(_Both(head_work, check, data_work), lambda: None)

    # collectives: check, then do

    def iall_reduce(self, t, op="sum"):
        self.check(_signature("all_reduce", t, op=op))
        return self.inner.iall_reduce(t, op)

    def ireduce_scatter(self, out, inp, op="sum"):
        self.check(_signature("reduce_scatter", inp, op=op))
        return self.inner.ireduce_scatter(out, inp, op)

    def iall_gather(self, out, inp):
        self.check(_signature("all_gather", inp))
        return self.inner.iall_gather(out, inp)

    def ibroadcast(self, t, src):
        self.check(_signature("broadcast", t, src=src))
        return self.inner.ibroadcast(t, src)

    def barrier(self):
        self.check("barrier()")
        self.inner.barrier()

    def split(self, color: int) -> CheckedComm:
        self.check("split()")
        return CheckedComm(self.inner.split(color))


def _unmatched_words(i: int, j: int, tag: int, sent: int, posted: int) -> str:
    """'rank 0 sent rank 1 2 messages with tag 7, rank 1 posted 1 receive ...': which of the
    (sender, receiver, tag)'s messages, by number, no receive takes (or which receive waits)."""
    words = (
        f"rank {i} sent rank {j} {sent} messages with tag {tag}, rank {j} posted {posted} "
        f"receives with tag {tag} from rank {i}"
    )
    if sent > posted:
        which = f"#{posted + 1}" + (f" to #{sent}" if sent > posted + 1 else "")
        words += f": message {which} is not received"
        if posted:  # the drill: a receive meant for #2 took #1
            words += (
                f" (if one of rank {j}'s {posted} receives was meant for it, a receive is "
                f"missing before it, and that receive took an earlier phase's message)"
            )
    else:
        words += f": receive #{sent + 1} has no message sent before this collective"
    return words


class _Both:
    """Wait for the header, check it, then wait for the data."""

    def __init__(self, head_work, check, data_work):
        self.head_work = head_work
        self.check = check
        self.data_work = data_work

    def wait(self) -> None:
        self.head_work.wait()
        self.check()
        self.data_work.wait()

    def is_completed(self) -> bool:
        return self.head_work.is_completed() and self.data_work.is_completed()
