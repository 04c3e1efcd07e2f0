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
messages each sent to each and how many receives each posted, and name any message left
unreceived. With every message the sender sends a small header (element count and dtype),
started together with the data (neither send waits for the other), that the receiver checks
against its buffer. The price is two extra all-gathers per collective and one extra message per
send: turn it on while debugging (`minidist.init(debug=True)` or MINIDIST_DEBUG=1), not for speed.
"""

from __future__ import annotations

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
        self.sent = [0] * self.world_size  # messages sent to each rank, since the start
        self.received = [0] * self.world_size  # receives posted from each rank

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
        receive posted for it: a later receive with its tag would take it, silently stale."""
        p = self.world_size
        rows = torch.empty((p, 2 * p), dtype=torch.int64, device=self.device)
        self.inner.all_gather(rows, torch.tensor(self.sent + self.received, device=self.device))
        rows = rows.cpu().tolist()  # rows[i] = (rank i's sends to each rank, receives from each)
        unmatched = [
            f"rank {i} sent rank {j} {rows[i][j]} messages, rank {j} posted {rows[j][p + i]} "
            f"receives from rank {i}"
            for i in range(p)
            for j in range(p)
            if rows[i][j] != rows[j][p + i]
        ]
        if unmatched:
            raise CommError(
                f"before collective #{self.n_collectives} ({sig}) on {self.backend}: "
                + "; ".join(unmatched)
                + ": every message must be received before the next collective (debug mode)"
            )

    # point-to-point: a header message first, checked by the receiver at wait()

    def isend(self, t, dst, tag=0):
        # both sends start before either is waited on: a blocking header would make any
        # exchange where both sides send first hang on Gloo, whose sends wait for their receive
        head_work = self.inner.isend(_header(t, self.device), dst, tag)
        data_work = self.inner.isend(t, dst, tag)
        self.sent[dst] += 1
        return _Both(head_work, lambda: None, data_work)

    def irecv(self, t, src, tag=0):
        self.received[src] += 1
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


class _Both:
    """Wait for the header, check it, then wait for the data."""

    def __init__(self, head_work, check, data_work):
        self.head_work, self.check, self.data_work = head_work, check, data_work

    def wait(self) -> None:
        self.head_work.wait()
        self.check()
        self.data_work.wait()

    def is_completed(self) -> bool:
        return self.head_work.is_completed() and self.data_work.is_completed()
