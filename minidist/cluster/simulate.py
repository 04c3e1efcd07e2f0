"""A simulated cluster: minidist's own code runs unchanged on threads, timed as on a real one.

Equals: the numbers are the threads backend's, bitwise (the code and the messages are real);
only time is simulated. Every rank keeps a virtual clock. A message of n bytes from rank a to
rank b leaves when a's clock has reached the send and a's link of that class (cluster.link:
inside the node or across) is free, occupies that link n / B, and arrives alpha later; the
receiver's clock moves to the arrival if it is behind. A library collective (comm.all_reduce,
...) starts when the last of its ranks calls it and takes cluster.ring_seconds over its ranks
(broadcast and barrier: a tree's rounds on the slowest link). Compute moves the clock by its
FLOPs (torch's flop counter: matmuls, attention, convolutions; elementwise work is free) over
peak x efficiency. The clocks depend
only on what each rank sends and computes, never on this machine's speed: deterministic.
Communication: the code's own; Report.traffic counts each rank's bytes per link class.
Memory per rank: the code's own, plus one timestamp per message in flight.
Ladder: SimulatedComm (messages priced link by link, library collectives by formula) ->
FlopClock (compute priced by FLOPs) -> simulate(fn, cluster, p): run fn on p simulated ranks
and report each one's time, compute and traffic.
Paper: the alpha-beta model of Hockney (Parallel Computing, 1994); cluster/hardware.py's sources.
Lesson: lessons/13_beyond_one_machine/.   Run: python lessons/13_beyond_one_machine/demo.py
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from minidist.cluster.hardware import Cluster, ring_seconds
from minidist.comm.protocol import Blocking
from minidist.comm.threads import ThreadsWorld
from minidist.launch.thread_ranks import run_thread_ranks


@dataclass
class RankState:
    """One simulated rank: its clock (s), when each of its outgoing links is free again, the
    compute time it was charged, and the bytes it sent on each link class."""

    clock: float = 0.0
    link_free: dict = field(default_factory=lambda: {"intra": 0.0, "inter": 0.0})
    compute: float = 0.0
    traffic: dict = field(default_factory=lambda: {"intra": 0, "inter": 0})


class _Sim:
    """What the simulated ranks share: the cluster, every rank's state, and the timestamps of
    messages and collectives in flight (the threads backend's ranks share one process)."""

    def __init__(self, cluster: Cluster, world_size: int):
        self.cluster = cluster
        self.states = [RankState() for _ in range(world_size)]
        self.lock = threading.Lock()
        self.arrivals: dict[tuple, float] = {}  # (channel, k) -> when message k arrives
        self.starts: dict[tuple, list] = {}  # (comm id, collective k) -> each rank's clock

    def link_class(self, a: int, b: int) -> str:
        same = self.cluster.node_of(a) == self.cluster.node_of(b)
        return "intra" if same else "inter"


class _Timed:
    """A Work: waits for the real operation, then moves this rank's clock (on_done)."""

    def __init__(self, work, on_done):
        self.work, self.on_done = work, on_done

    def wait(self) -> None:
        self.work.wait()
        if self.on_done is not None:
            self.on_done()
            self.on_done = None

    def is_completed(self) -> bool:
        return self.work.is_completed()


class SimulatedComm(Blocking):
    """A comm whose operations move this rank's virtual clock (see the module docstring).

    inner: a threads comm; ranks: the world ranks of inner's members (cluster placement).
    """

    def __init__(self, inner, sim: _Sim, ranks: list[int], cid: tuple = ()):
        self.inner = inner
        self.sim = sim
        self.ranks = ranks
        self.cid = cid
        self.rank, self.world_size = inner.rank, inner.world_size
        self.backend, self.timeout = "simulated", inner.timeout
        self.me = sim.states[ranks[inner.rank]]
        self.sent, self.posted = {}, {}  # channel -> messages sent / receives posted
        self.n_collectives = self.n_splits = 0

    def __getattr__(self, name):  # device and the like, from the inner comm
        return getattr(self.inner, name)

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0):
        a, b = self.ranks[self.rank], self.ranks[dst]
        channel = (self.cid, a, b, tag)
        k = self.sent[channel] = self.sent.get(channel, -1) + 1
        cls, nbytes = self.sim.link_class(a, b), t.numel() * t.element_size()
        link = self.sim.cluster.link(a, b)
        depart = max(self.me.clock, self.me.link_free[cls])
        done = depart + nbytes / link.bandwidth  # the last byte is on the wire
        self.me.link_free[cls] = done
        self.me.traffic[cls] += nbytes
        with self.sim.lock:  # before the real send: the receiver reads it once it has the data
            self.sim.arrivals[channel, k] = done + link.latency
        return _Timed(self.inner.isend(t, dst, tag), lambda: self._reach(done))

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0):
        channel = (self.cid, self.ranks[src], self.ranks[self.rank], tag)
        # receives on a channel complete in the order they were posted, as messages were sent
        k = self.posted[channel] = self.posted.get(channel, -1) + 1

        def arrived():
            with self.sim.lock:
                self._reach(self.sim.arrivals.pop((channel, k)))

        return _Timed(self.inner.irecv(t, src, tag), arrived)

    def _reach(self, when: float) -> None:
        self.me.clock = max(self.me.clock, when)

    def _collective(self, work, steps: int, chunk: float, ring: bool = True):
        """Start when the last rank calls; then the ring formula over the members
        (cluster.ring_seconds: steps of chunk bytes), or, for a tree (ring=False), steps
        rounds of alpha + chunk / B on the slowest link."""
        key = (self.cid, self.n_collectives)
        self.n_collectives += 1
        with self.sim.lock:
            self.sim.starts.setdefault(key, [None] * self.world_size)[self.rank] = self.me.clock

        def done():
            with self.sim.lock:  # every rank called it: the real collective completed
                clocks = self.sim.starts[key]
                start = max(c for c in clocks if c is not None)
                clocks[self.rank] = None  # read: the last reader drops the entry
                if all(c is None for c in clocks):
                    del self.sim.starts[key]
            self._reach(start + self._seconds(steps, chunk, ring))

        return _Timed(work, done)

    def _seconds(self, steps: int, chunk: float, ring: bool) -> float:
        members = tuple(self.ranks)
        if ring:
            return ring_seconds(self.sim.cluster, members, steps, chunk)
        right = members[1:] + members[:1]
        links = [self.sim.cluster.link(a, b) for a, b in zip(members, right, strict=True)]
        alpha, beta = max(x.latency for x in links), min(x.bandwidth for x in links)
        return steps * (alpha + chunk / beta)

    def iall_reduce(self, t, op="sum"):
        p, n = self.world_size, t.numel() * t.element_size()
        return self._collective(self.inner.iall_reduce(t, op), 2 * (p - 1), n / p)

    def ireduce_scatter(self, out, inp, op="sum"):
        p, n = self.world_size, inp.numel() * inp.element_size()
        return self._collective(self.inner.ireduce_scatter(out, inp, op), p - 1, n / p)

    def iall_gather(self, out, inp):
        p, n = self.world_size, inp.numel() * inp.element_size()
        return self._collective(self.inner.iall_gather(out, inp), p - 1, n)

    def ibroadcast(self, t, src):
        rounds = math.ceil(math.log2(self.world_size)) if self.world_size > 1 else 0
        nbytes = t.numel() * t.element_size()
        return self._collective(self.inner.ibroadcast(t, src), rounds, nbytes, ring=False)

    def barrier(self) -> None:
        rounds = math.ceil(math.log2(self.world_size)) if self.world_size > 1 else 0
        self._collective(_Barrier(self.inner), rounds, 0, ring=False).wait()

    def split(self, color: int) -> SimulatedComm:
        """A simulated sub-comm: its members' world ranks place them on the cluster."""
        cid = (*self.cid, self.n_splits, color)  # the same on every member
        self.n_splits += 1
        inner = self.inner.split(color)
        members = torch.empty(inner.world_size, dtype=torch.int64)
        inner.all_gather(members, torch.tensor([self.ranks[self.rank]]))  # untimed: set-up
        return SimulatedComm(inner, self.sim, members.tolist(), cid)


class _Barrier:
    def __init__(self, inner):
        self.inner = inner

    def wait(self) -> None:
        self.inner.barrier()

    def is_completed(self) -> bool:
        return True


class FlopClock(TorchDispatchMode):
    """Inside it (one thread), every op torch can count FLOPs for moves the rank's clock by
    flops / (peak x efficiency). Forward and backward alike: autograd runs CPU backward on the
    thread that called it, where this mode is active."""

    def __init__(self, state: RankState, flops_per_second: float):
        super().__init__()
        self.state, self.rate = state, flops_per_second

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            seconds = count(*args, **kwargs, out_val=out) / self.rate
            self.state.clock += seconds
            self.state.compute += seconds
        return out


@dataclass
class Report:
    """What simulate() returns: per rank, its result, its clock at the end (s), the part of it
    charged to compute, and the bytes it sent per link class."""

    results: list
    seconds: list[float]
    compute: list[float]
    traffic: list[dict]

    @property
    def time(self) -> float:
        """The simulated time of the whole run: the slowest rank's clock."""
        return max(self.seconds)


def simulate(
    fn, cluster: Cluster, world_size: int, *args, efficiency: float = 0.5, timeout: float = 60.0
) -> Report:
    """Run fn(comm, *args) on world_size simulated ranks of cluster (threads of this process,
    rank r on node r // gpus_per_node) and report. efficiency: the fraction of the GPU's peak
    that compute achieves (an assumption: measured MFU of large runs is 0.3-0.6)."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency} is not in (0, 1]")
    world = ThreadsWorld(world_size, timeout)
    sim = _Sim(cluster, world_size)
    rate = cluster.gpu.peak_flops * efficiency

    def rank_main(inner):
        comm = SimulatedComm(inner, sim, list(range(world_size)))
        with FlopClock(sim.states[comm.rank], rate):
            return fn(comm, *args)

    def abort_words(r: int, e: BaseException) -> str:
        return f"simulated rank {r} failed: {type(e).__name__}: {e}"

    run = run_thread_ranks(rank_main, world, abort_words=abort_words)  # until every rank ends
    if run.errors:
        first = next(iter(run.errors))  # in the order they happened: the first is the cause
        raise RuntimeError(f"simulated rank {first} failed") from run.errors[first][0]
    s = sim.states
    return Report(run.results, [x.clock for x in s], [x.compute for x in s], [x.traffic for x in s])
