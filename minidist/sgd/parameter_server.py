"""Parameter server: server ranks hold the parameters; workers pull them, compute a gradient on
their own data and push it back; a server applies every gradient the moment it arrives.

Equals: with one worker, plain SGD bitwise (w <- w - lr * g: the same two roundings). With
staleness=0, synchronous SGD: every gradient of clock c is computed on the parameters after
exactly the gradients of clocks < c (asserted exactly on the log), so the parameters equal the
all-reduce average to float64 1e-12 (a round's W gradients are added one at a time, in arrival
order, instead of summed in rank order). For every interleaving: replaying the log in one
process gives bitwise the server's parameters; every gradient a server receives is applied
exactly once; with staleness=s the recorded staleness is at most (W-1)(2s+1).
Communication per gradient, per worker (N parameters of b bytes, S servers): a push of
N b + 32 S bytes and a reply of N b + 16 S bytes. A server carries W times its shard N b / S per
round: its link is the bottleneck, which sharding over S servers divides by S.
Memory per rank: a server N/S parameters (+ one gradient shard); a worker N parameters + N grad.
Ladder: serve(staleness=None) (fully asynchronous, Downpour) -> staleness=s (bounded staleness:
a worker more than s gradients ahead of the slowest waits) -> n_servers=S (sharded parameters)
-> lost workers (silent past worker_timeout: dropped, the rest go on, or on_lost="raise").
Paper: Dean et al., Large Scale Distributed Deep Networks (NIPS 2012), Downpour SGD; Ho et al.,
More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server (NIPS 2013).
Lesson: lessons/08_sync_async_sgd/.   Run: minidist bench sgd -n 4 --backend mpi

Roles: ranks 0..S-1 serve (server s holds w_full[lo:hi], shard_range(N, S, s)), ranks S..p-1
are workers 0..W-1. Every message is a header of known size, then its payload:

    worker -> each server   (kind, clock, numel, dtype) int64, HEADER; PUSH, LAST: + gradient
                            shard, DATA (numel and dtype describe it: checked before it is read)
    server -> worker        (version, staleness) int64, HEADER; PULL, PUSH: + parameter shard

    kind   meaning                               the server
    PULL   "send me the parameters" (first)      replies with its shard (when the bound allows)
    PUSH   gradient of my clock-th step          applies it, replies with the next parameters
    LAST   my last gradient; I leave after it    applies it, acknowledges, forgets the worker
    LEAVE  I leave now, no gradient              forgets the worker

A waiting worker is answered once its SSP clock (its requests for parameters so far: the PULL,
then one per PUSH) is at most s ahead of the slowest live worker's. A push's reply carries the
next parameters (push and pull in one round trip); with staleness=0 that makes rounds exact:
every worker is answered in the same pass (the first round too: a PULL waits for everyone's),
before any gradient of the next step exists. version = gradients applied so far by this server;
a gradient's staleness = version when applied - version it was computed on. The bound: worker k
got step c's parameters when every live worker had pushed all steps < c - s, and each can push
steps up to c + s before k's gradient lands: at most 2s+1 of them each.

Bad requests: a header whose kind is unknown, whose gradient has the wrong number of elements
or the wrong dtype (float64 bytes read as int64 are other numbers), a clock that is not the next,
or a gradient with nan or inf: the server drops that worker alone (never applying the gradient),
names it and why in log.lost, and serves the rest; the dropped worker is not answered again.

Liveness: a worker the server owes nothing (it is computing) that sends no whole request
(header and gradient) for worker_timeout seconds is lost: dropped with the gradients applied so
far, named in the log, the bound then taken over the live workers (on_lost="raise": stop with
WorkerLost instead). A half-sent gradient is never applied. Over threads this lets the run finish
when a worker thread dies. Over real processes `minidist run` stops the whole job when a process
dies, so there the clean way out is LEAVE/LAST; a live worker dropped for being slower than
worker_timeout is not answered again and times out (CommTimeout) waiting.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from minidist.comm.protocol import CommError, PeerFailed

# the kinds of request a worker sends
PULL = 0
PUSH = 1
LAST = 2
LEAVE = 3
HEADER, DATA = 81, 82  # tags: every header travels on HEADER, every tensor payload on DATA
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32)


def dtype_code(dtype: torch.dtype) -> int:
    """The number a header carries for dtype (-1: none of DTYPES)."""
    return DTYPES.index(dtype) if dtype in DTYPES else -1


class WorkerLost(CommError):
    """A worker fell silent past its deadline and the server was told to stop, not go on."""


class BadRequest(CommError):
    """A worker's request the server cannot take: unknown kind, wrong size, dtype or clock,
    a gradient with nan or inf."""


def shard_range(n: int, n_servers: int, server: int) -> tuple[int, int]:
    """[lo, hi) of `server`'s contiguous slice of n parameters; the first n % S get one more."""
    if not 1 <= n_servers <= n:
        raise ValueError(f"n={n} parameters cannot be split over n_servers={n_servers}")
    base, extra = divmod(n, n_servers)
    lo = server * base + min(server, extra)
    return lo, lo + base + int(server < extra)


def staleness_bound(n_workers: int, staleness: int | None) -> int | None:
    """The most gradients that can land between a pull and its push: (W-1)(2s+1); None: none."""
    return None if staleness is None else (n_workers - 1) * (2 * staleness + 1)


@dataclass(frozen=True)
class Event:
    """One applied gradient: worker k's clock-th, computed on version `pulled`, applied to
    version `version` (so its staleness is version - pulled)."""

    worker: int
    clock: int
    pulled: int
    version: int


@dataclass
class ServerLog:
    """What a server did: the final shard, every applied gradient in order, who left or was lost,
    and (trace_every > 0) snapshots (seconds since start, version, shard copy)."""

    params: torch.Tensor
    events: list[Event] = field(default_factory=list)
    left: dict[int, int] = field(default_factory=dict)  # worker -> its gradients applied
    lost: dict[int, str] = field(default_factory=dict)  # worker -> why it was dropped
    trace: list[tuple[float, int, torch.Tensor]] = field(default_factory=list)


@dataclass
class _Link:
    """The server's view of one worker."""

    worker: int
    rank: int
    clock: int = 0  # gradients applied from this worker
    asked: int = 0  # parameter requests so far (PULL, then one per PUSH): its SSP clock
    pulled: int = -1  # version of the parameters it last received
    staleness: int = -1  # of its last applied gradient, sent back in the reply
    waiting: bool = False  # owed a reply (bounded staleness may hold it back)
    heard: float = 0.0  # when it last spoke or was answered
    gone: str = ""  # "" while served; "left" or why it was lost


class _Server:
    """The state of one server's loop; `serve` builds one and runs it.

    One receiver thread per worker blocks in recv and hands whole requests (header and
    gradient) to the main thread through `inbox`: a server cannot poll "has anyone sent?"
    portably (Gloo's point-to-point receives report completion only inside wait()), and a
    thread per worker waits without burning a core. Only the main thread sends and applies.
    """

    def __init__(self, comm, w, lr, n_servers, staleness, worker_timeout, on_lost, trace_every):
        if on_lost not in ("continue", "raise"):
            raise ValueError(f"on_lost={on_lost!r} is not 'continue' or 'raise'")
        if staleness is not None and staleness < 0:
            raise ValueError(f"staleness={staleness} must be >= 0 (or None: unbounded)")
        self.comm = comm
        self.w = w
        self.lr = lr
        self.s = staleness
        self.timeout = comm.timeout if worker_timeout is None else worker_timeout
        self.on_lost, self.trace_every = on_lost, trace_every
        self.version = 0
        self.log = ServerLog(w)
        self.start = time.monotonic()
        self.inbox: queue.Queue = queue.Queue()  # (link, kind, clock, gradient or error text)
        self.links = [_Link(k, r) for k, r in enumerate(range(n_servers, comm.world_size))]

    def live(self) -> list[_Link]:
        return [link for link in self.links if not link.gone]

    def run(self) -> ServerLog:
        self.snapshot()
        for link in self.links:
            link.heard = time.monotonic()
            threading.Thread(target=self.receive, args=(link,), daemon=True).start()
        while self.live():
            try:  # wake on a request, or every 50 ms to check the deadlines
                requests = [self.inbox.get(timeout=0.05)]
            except queue.Empty:
                requests = []
            while not self.inbox.empty():  # all that came: none may look silent below
                requests.append(self.inbox.get())
            for request in requests:
                self.handle(*request)
            self.answer()
            self.check_deadlines()
        if self.trace_every and self.log.trace[-1][1] != self.version:
            self.snapshot()  # the final parameters
        return self.log

    def receive(self, link: _Link) -> None:
        """On its own thread: link's requests, each whole, into the inbox, until it leaves."""
        kind = PULL
        try:
            while kind not in (LAST, LEAVE):
                header = self.comm.recv(torch.zeros(4, dtype=torch.int64), link.rank, HEADER)
                kind, clock, numel, code = header.tolist()
                self.check_header(kind, numel, code)
                g = None
                if kind in (PUSH, LAST):
                    g = self.comm.recv(torch.empty_like(self.w), link.rank, DATA)  # (hi - lo,)
                self.inbox.put((link, kind, clock, g))
        except Exception as e:  # a dead or silent peer, a bad request: the main thread decides
            self.inbox.put((link, None, 0, e))

    def check_header(self, kind: int, numel: int, code: int) -> None:
        """Raise BadRequest unless the header's kind is known and its gradient (if any) has
        this shard's size and dtype: checked before the payload is read, never after."""
        if kind not in (PULL, PUSH, LAST, LEAVE):
            raise BadRequest(f"unknown request kind {kind}")
        if kind in (PUSH, LAST) and (numel, code) != (self.w.numel(), dtype_code(self.w.dtype)):
            got = DTYPES[code] if 0 <= code < len(DTYPES) else f"dtype code {code}"
            raise BadRequest(
                f"a gradient of {numel} x {got}; this server's shard is "
                f"{self.w.numel()} x {self.w.dtype}"
            )

    def handle(self, link: _Link, kind, clock: int, payload) -> None:
        """Act on one whole request of a live worker."""
        if link.gone:
            return  # already dropped: a late request changes nothing
        link.heard = time.monotonic()
        if kind is None:  # payload: the receiver's error
            self.lose(link, f"{type(payload).__name__}: {payload}", payload)
            return
        if kind in (PUSH, LAST):
            bad = self.refuse(link, clock, payload)
            if bad:
                self.lose(link, f"BadRequest: {bad}", BadRequest(bad))
                return
            self.apply(link, clock, payload)
        if kind in (PULL, PUSH):
            link.waiting = True  # answered by answer(), when the bound allows
            link.asked += 1
        elif kind == LAST:
            self.reply(link, with_params=False)  # an acknowledgement: the worker is leaving
        if kind in (LAST, LEAVE):
            link.gone = "left"
            self.log.left[link.worker] = link.clock

    def refuse(self, link: _Link, clock: int, g: torch.Tensor) -> str:
        """Why gradient g of link's clock-th step must not be applied ("" if it may)."""
        if clock != link.clock:  # a repeat would be applied twice; a gap means one went missing
            return f"pushed gradient #{clock}, expected #{link.clock}"
        bad = int((~torch.isfinite(g)).sum())
        return f"gradient #{clock} has {bad} nan or inf values" if bad else ""

    def apply(self, link: _Link, clock: int, g: torch.Tensor) -> None:
        """Apply worker's gradient shard g, (hi - lo,), and log it (refuse() said it may)."""
        # lab 08.2 begin: log an Event, w <- w - lr * g, count it
        self.log.events.append(Event(link.worker, clock, link.pulled, self.version))
        link.staleness = self.version - link.pulled
        self.w.sub_(self.lr * g)  # two roundings, as in the single-process reference
        self.version += 1
        link.clock += 1
        # lab 08.2 end
        if self.trace_every and self.version % self.trace_every == 0:
            self.snapshot()

    def answer(self) -> None:
        """Reply to every waiting worker the staleness bound lets run."""
        # lab 08.1 begin: reply (with_params) to waiting links at most s asks ahead of the slowest
        slowest = min((link.asked for link in self.live()), default=0)
        for link in self.live():
            if link.waiting and (self.s is None or link.asked - slowest <= self.s):
                self.reply(link, with_params=True)
        # lab 08.1 end

    def reply(self, link: _Link, with_params: bool) -> None:
        self.comm.send(torch.tensor([self.version, link.staleness]), link.rank, HEADER)
        if with_params:
            self.comm.send(self.w, link.rank, DATA)
            link.pulled = self.version
        link.waiting = False
        link.heard = time.monotonic()  # from now on it computes: its deadline runs

    def check_deadlines(self) -> None:
        """Lose every worker that owes a request and has been silent past worker_timeout."""
        now = time.monotonic()
        # lab 08.3 begin: lose (self.lose) live links that are not waiting and silent too long
        for link in self.live():
            if not link.waiting and now - link.heard > self.timeout:
                self.lose(link, f"no whole request for {now - link.heard:.2f}s > {self.timeout:g}s")
        # lab 08.3 end

    def lose(self, link: _Link, why: str, error: CommError | None = None) -> None:
        """Drop link (or, on_lost="raise", stop: a PeerFailed if a peer's failure caused it)."""
        text = (
            f"server {self.comm.rank}: worker {link.worker} (rank {link.rank}) lost after "
            f"{link.clock} gradients: {why}; {len(self.live()) - 1} workers remain"
        )
        if self.on_lost == "raise":
            stop = PeerFailed if isinstance(error, PeerFailed) else WorkerLost
            raise stop(text + " (on_lost='raise' stops the server)") from error
        link.gone = why
        self.log.lost[link.worker] = text

    def snapshot(self) -> None:
        if self.trace_every:
            elapsed = time.monotonic() - self.start
            self.log.trace.append((elapsed, self.version, self.w.clone()))


def serve(
    comm,
    w: torch.Tensor,
    lr: float,
    n_servers: int = 1,
    staleness: int | None = None,
    worker_timeout: float | None = None,
    on_lost: str = "continue",
    trace_every: int = 0,
) -> ServerLog:
    """Serve workers (ranks n_servers..p-1) until each has left or been lost; the log.

    w: this server's shard w_full[lo:hi] (lo, hi = shard_range(N, n_servers, comm.rank)),
    updated in place by w <- w - lr * g for every gradient shard g as it arrives.
    staleness: s (a worker may be at most s gradients ahead of the slowest), None: unbounded.
    worker_timeout: seconds a computing worker may stay silent (default: comm.timeout); callers
    must make it longer than the slowest step.
    """
    if not 0 <= comm.rank < n_servers < comm.world_size:
        raise ValueError(
            f"rank {comm.rank} is no server, or no worker is left: n_servers={n_servers}, "
            f"world_size={comm.world_size}"
        )
    server = _Server(comm, w, lr, n_servers, staleness, worker_timeout, on_lost, trace_every)
    return server.run()


@dataclass
class WorkerLog:
    """A worker's side: the last parameters it received, its gradients acknowledged by every
    server, and each one's staleness as server 0 reported it."""

    params: torch.Tensor
    pushed: int = 0
    staleness: list[int] = field(default_factory=list)


def work(comm, n: int, grad_fn, steps: int, n_servers: int = 1, dtype=torch.float64):
    """Pull, then `steps` times: g = grad_fn(w, step), push g, get the next w; a WorkerLog.

    n: parameters in all; grad_fn(w: (n,), step) -> (n,). The last push is LAST (no parameters
    come back); steps=0 leaves at once (LEAVE). Requests go to every server before any reply is
    awaited, so the servers work in parallel.
    """
    if comm.rank < n_servers:
        raise ValueError(f"rank {comm.rank} is a server (n_servers={n_servers}), not a worker")
    ranges = [shard_range(n, n_servers, s) for s in range(n_servers)]
    w = torch.zeros(n, dtype=dtype)  # (n,): the full parameters, assembled from the shards
    log = WorkerLog(w)
    if steps == 0:
        _request(comm, LEAVE, 0, ranges, w, None, log)
        return log
    _request(comm, PULL, 0, ranges, w, None, log)
    for step in range(steps):
        g = grad_fn(w, step)  # (n,)
        _request(comm, PUSH if step < steps - 1 else LAST, step, ranges, w, g, log)
    return log


def _request(comm, kind: int, clock: int, ranges, w, g, log: WorkerLog) -> None:
    """Send (kind, clock, numel, dtype) [+ g's shard] to every server, then take each reply
    into w."""
    for s, (lo, hi) in enumerate(ranges):
        g_shard = None if g is None else g[lo:hi].contiguous()
        numel, code = (0, -1) if g_shard is None else (g_shard.numel(), dtype_code(g_shard.dtype))
        comm.send(torch.tensor([kind, clock, numel, code]), s, HEADER)
        if g_shard is not None:
            comm.send(g_shard, s, DATA)
    if kind == LEAVE:
        return
    head = torch.zeros(2, dtype=torch.int64)  # (version, staleness of my gradient)
    stale = []
    for s, (lo, hi) in enumerate(ranges):
        comm.recv(head, s, HEADER)
        stale.append(int(head[1]))
        if kind in (PULL, PUSH):
            comm.recv(w[lo:hi], s, DATA)  # a contiguous view: filled in place
    if g is not None:
        log.pushed += 1
        log.staleness.append(stale[0])
