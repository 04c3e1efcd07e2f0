"""Wrappers any comm can wear: counting messages and bytes, and tracing a timeline.

    counter = Counter()
    comm = ObservedComm(comm, counter)      # use it like the comm it wraps
    ring_all_reduce(x, comm)
    counter.sent_to        # {right_neighbour: 2 (p-1)/p * x.nbytes}

    tracer = Tracer()
    comm = ObservedComm(comm, tracer)
    ...
    write_chrome_trace("trace.json", {comm.rank: tracer.events})   # open in ui.perfetto.dev

What is counted. Point-to-point operations are exact: a send of t adds t.nbytes to
`sent_to[dst]`, a receive to `received_from[src]`. A library collective (comm.all_reduce, ...)
is one opaque call: the counter records the call and its payload (the input tensor's bytes),
not the wire bytes, which depend on the library's algorithm. The hand-written collectives in
`minidist.collectives.algorithms` are built from send/recv, so their every byte is counted exactly.
"""

from __future__ import annotations

import json
import time
from collections import Counter as _Tally

import torch

from .protocol import Blocking


class Counter:
    """Tallies per operation (calls, payload bytes) and per peer (messages, bytes)."""

    def __init__(self):
        self.calls: _Tally[str] = _Tally()
        self.nbytes: _Tally[str] = _Tally()
        self.sent_to: _Tally[int] = _Tally()
        self.messages_to: _Tally[int] = _Tally()
        self.received_from: _Tally[int] = _Tally()

    def start(self, op: str, peer: int | None, nbytes: int, seq: int) -> None:
        self.calls[op] += 1
        self.nbytes[op] += nbytes
        if op == "send":
            self.sent_to[peer] += nbytes
            self.messages_to[peer] += 1
        elif op == "recv":
            self.received_from[peer] += nbytes
        return None

    def end(self, token) -> None:
        return None

    @property
    def bytes_sent(self) -> int:
        """Bytes sent point-to-point, to all peers together."""
        return sum(self.sent_to.values())

    def reset(self) -> None:
        self.__init__()

    def summary(self) -> dict:
        """A plain dict for printing or --json."""
        return {
            "calls": dict(self.calls),
            "nbytes": dict(self.nbytes),
            "sent_to": dict(self.sent_to),
            "received_from": dict(self.received_from),
        }


class Tracer:
    """Records each operation as a Chrome trace event: issued at start, ended at wait()."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.t0 = time.perf_counter()
        self.events: list[dict] = []

    def start(self, op: str, peer: int | None, nbytes: int, seq: int) -> dict:
        event = {
            "name": op if peer is None else f"{op} {peer}",
            "ph": "X",
            "pid": self.rank,
            "tid": 0,
            "ts": (time.perf_counter() - self.t0) * 1e6,  # microseconds, as Chrome wants
            "args": {"seq": seq, "nbytes": nbytes, "peer": peer},
        }
        self.events.append(event)
        return event

    def end(self, event: dict) -> None:
        event["dur"] = (time.perf_counter() - self.t0) * 1e6 - event["ts"]

    def span(self, name: str) -> _Span:
        """A context manager that records a compute span (e.g. 'forward mb 3')."""
        return _Span(self, name)


class _Span:
    def __init__(self, tracer: Tracer, name: str):
        self.tracer, self.name = tracer, name

    def __enter__(self):
        self.event = self.tracer.start(self.name, None, 0, -1)
        self.event["tid"] = 1  # compute on its own row, below communication
        return self

    def __exit__(self, *exc):
        self.tracer.end(self.event)


def write_chrome_trace(path: str, events_by_rank: dict[int, list[dict]]) -> None:
    """Write one JSON trace (Chrome trace format) with a process row per rank."""
    events = []
    for rank, evs in sorted(events_by_rank.items()):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        events += [dict(e, pid=rank) for e in evs if "dur" in e]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


class _ObservedWork:
    def __init__(self, work, observer, token):
        self.work = work
        self.observer = observer
        self.token = token
        self.ended = False

    def wait(self) -> None:
        self.work.wait()
        if not self.ended:
            self.ended = True
            self.observer.end(self.token)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class ObservedComm(Blocking):
    """A comm that reports every operation to an observer (a Counter or a Tracer)."""

    def __init__(self, inner, observer):
        self.inner = inner
        self.observer = observer
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.backend = inner.backend
        self.timeout = inner.timeout
        self.n_ops = 0
        if isinstance(observer, Tracer):
            observer.rank = inner.rank

    def __getattr__(self, name):  # device, group, ... of the inner comm
        return getattr(self.inner, name)

    def _observe(self, op: str, peer, t: torch.Tensor | None, issue) -> _ObservedWork:
        self.n_ops += 1
        nbytes = 0 if t is None else t.numel() * t.element_size()
        token = self.observer.start(op, peer, nbytes, self.n_ops)
        return _ObservedWork(issue(), self.observer, token)

    def isend(self, t, dst, tag=0):
        return self._observe("send", dst, t, lambda: self.inner.isend(t, dst, tag))

    def irecv(self, t, src, tag=0):
        return self._observe("recv", src, t, lambda: self.inner.irecv(t, src, tag))

    def iall_reduce(self, t, op="sum"):
        return self._observe("all_reduce", None, t, lambda: self.inner.iall_reduce(t, op))

    def ireduce_scatter(self, out, inp, op="sum"):
        issue = lambda: self.inner.ireduce_scatter(out, inp, op)  # noqa: E731
        return self._observe("reduce_scatter", None, inp, issue)

    def iall_gather(self, out, inp):
        return self._observe("all_gather", None, inp, lambda: self.inner.iall_gather(out, inp))

    def ibroadcast(self, t, src):
        return self._observe("broadcast", src, t, lambda: self.inner.ibroadcast(t, src))

    def barrier(self):
        token = self.observer.start("barrier", None, 0, self.n_ops)
        self.inner.barrier()
        self.observer.end(token)

    def split(self, color: int) -> ObservedComm:
        """The sub-comm reports to the same observer."""
        return ObservedComm(self.inner.split(color), self.observer)
