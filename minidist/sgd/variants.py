"""Synchronous vs asynchronous SGD: the all-reduce baseline, local SGD, the parameter-server
variants (minidist/sgd/parameter_server.py) and stragglers made on purpose, under one `train`.

Equals: sync_sgd: SGD on the mean of the W workers' gradients, float64 1e-12 (the all-reduce
sums in its own order); with W = 1 plain SGD bitwise. local_sgd: W replicas stepping alone and
averaged every k steps (and after the last), float64 1e-12; k = 1 equals sync_sgd to 1e-12.
Asynchronous and bounded staleness: see sgd/parameter_server.py; `train` gives the server the step
lr / W per gradient, so W gradients, one from each worker, move w as far as one sync step.
Communication per step, per worker (N parameters of b bytes, W workers, S servers): sync: one
all-reduce of N b bytes (ring: 2(W-1)/W N b sent); local: the same once every k steps;
parameter server: N b + 16 S bytes each way per gradient (a server's link carries W times that).
Memory per rank: N parameters and one gradient (a server: N/S parameters).
Ladder: sync_sgd (every step waits for the slowest) -> async parameter server (never waits,
stale gradients) -> bounded staleness (waits only when s steps ahead) -> local_sgd (waits, but
only every k steps). with_delay makes a straggler, fixed or random, to see the trade-off.
Paper: Dean et al., NIPS 2012 (Downpour SGD); Ho et al., NIPS 2013 (stale synchronous
parallel); Chen et al., Revisiting Distributed Synchronous SGD (2016); Stich, Local SGD
Converges Fast and Communicates Little (ICLR 2019).   Lesson: lessons/08_sync_async_sgd/.
Run: minidist run -n 4 --backend mpi lessons/08_sync_async_sgd/demo.py

Roles in `train`: ranks 0..S-1 serve in the parameter-server variants and sit out sync and
local SGD (comm.split), so the same W = p - S workers compute in every variant and only the way
they synchronize differs.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from minidist.sgd import parameter_server

VARIANTS = ("sync", "async", "ssp", "local")
STRAGGLERS = ("none", "fixed", "random")


def sync_sgd(comm, w: torch.Tensor, grad_fn, steps: int, lr: float, trace=None) -> torch.Tensor:
    """Synchronous SGD, w updated in place: all-reduce (average) the gradients, then step.

    w: (N,), broadcast from rank 0 first; grad_fn(w, step) -> a new (N,) tensor, this rank's
    gradient. trace: a list that gets (seconds, gradients so far in all, w copy) every step.
    """
    comm.broadcast(w, 0)
    start = time.monotonic()
    for step in range(steps):
        g = grad_fn(w, step)  # (N,)
        comm.all_reduce(g, "avg")  # waits for every rank: the slowest sets the pace
        w.sub_(lr * g)
        _record(trace, start, comm.world_size * (step + 1), w)
    return w


def local_sgd(comm, w: torch.Tensor, grad_fn, steps: int, lr: float, k: int, trace=None):
    """Local SGD, w updated in place: every rank steps alone on its own gradients; every k steps
    (and after the last) the ranks average their parameters with one all-reduce.

    Between averages the replicas differ; `trace` gets the average, after each all-reduce.
    """
    if k < 1:
        raise ValueError(f"k={k}: local SGD averages every k >= 1 steps")
    comm.broadcast(w, 0)
    start = time.monotonic()
    for step in range(steps):
        w.sub_(lr * grad_fn(w, step))  # no communication: this replica drifts from the others
        if (step + 1) % k == 0 or step == steps - 1:
            comm.all_reduce(w, "avg")  # the only communication: once per k steps
            _record(trace, start, comm.world_size * (step + 1), w)
    return w


def _record(trace, start: float, gradients: int, w: torch.Tensor) -> None:
    if trace is not None:
        trace.append((time.monotonic() - start, gradients, w.clone()))


def with_delay(grad_fn, delay: float, chance: float = 1.0, seed: int = 0):
    """grad_fn slowed down: each call first sleeps `delay` seconds, with probability `chance`.

    Sleeping, not computing, so a straggler costs no CPU on a shared machine and its delay is
    the same on every backend. The draws come from this wrapper's own random.Random(seed).
    """
    rng = random.Random(seed)

    def slowed(w, step):
        if delay > 0 and rng.random() < chance:
            time.sleep(delay)
        return grad_fn(w, step)

    return slowed


@dataclass(frozen=True)
class LeastSquares:
    """min_w 1/(2n) |X w - y|^2 with y = X w_star: noiseless, so every worker's rows have the
    same optimum w_star and every variant can reach it. Worker k owns rows x[k]."""

    x: torch.Tensor  # (W, R, d): worker k's R rows
    y: torch.Tensor  # (W, R)
    w_star: torch.Tensor  # (d,)
    batch: int

    def grad_fn(self, worker: int):
        """grad(w, step): the gradient on worker's step-th batch (its rows, in turn)."""
        rows = self.x.shape[1]

        def grad(w: torch.Tensor, step: int) -> torch.Tensor:
            lo = step * self.batch % rows
            xb = self.x[worker, lo : lo + self.batch]  # (b, d)
            yb = self.y[worker, lo : lo + self.batch]  # (b,)
            return xb.T @ (xb @ w - yb) / self.batch  # (d,)

        return grad

    def loss(self, w: torch.Tensor) -> float:
        r = self.x.reshape(-1, self.x.shape[2]) @ w - self.y.reshape(-1)  # (W R,)
        return 0.5 * r.square().mean().item()


def least_squares(n_workers: int, rows: int, d: int, batch: int, seed: int) -> LeastSquares:
    """A random well-conditioned problem, float64, the same from the same seed on every rank."""
    if rows % batch != 0:
        raise ValueError(f"rows={rows} per worker is not divisible by batch={batch}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_workers, rows, d, generator=g, dtype=torch.float64)  # (W, R, d)
    w_star = torch.randn(d, generator=g, dtype=torch.float64)  # (d,)
    return LeastSquares(x, x @ w_star, w_star, batch)


@dataclass(frozen=True)
class Config:
    """One training run. steps: gradients per worker; lr: the synchronous step."""

    variant: str = "async"  # one of VARIANTS
    steps: int = 100
    lr: float = 0.1
    staleness: int = 2  # ssp: how many gradients a worker may run ahead of the slowest
    k: int = 8  # local: average every k steps
    n_servers: int = 1
    compute: float = 0.0  # seconds every gradient takes (slept), on every worker
    straggler: str = "none"  # fixed: the last worker, every step; random: anyone, by chance
    delay: float = 0.0  # the straggler's extra seconds
    chance: float = 0.1  # random: the probability of the delay, per worker and step
    trace_every: int = 0  # parameter server: a snapshot every this many gradients


def train(comm, problem: LeastSquares, cfg: Config) -> dict:
    """Run cfg.variant on this rank's role; {"role": "server"|"worker"|"idle", ...}.

    A worker's dict holds "params" and "trace" (sync, local) or a WorkerLog "log"; a server's
    its ServerLog "log". Every rank must call it (sync and local split the comm).
    """
    if cfg.variant not in VARIANTS or cfg.straggler not in STRAGGLERS:
        raise ValueError(f"variant={cfg.variant!r} / straggler={cfg.straggler!r}: see VARIANTS")
    n_workers = comm.world_size - cfg.n_servers
    if n_workers != problem.x.shape[0]:
        raise ValueError(f"the problem has {problem.x.shape[0]} workers' data, W={n_workers}")
    server = comm.rank < cfg.n_servers
    w = torch.zeros(problem.x.shape[2], dtype=torch.float64)  # (d,) w0, the same everywhere
    if cfg.variant in ("sync", "local"):
        workers = comm.split(int(not server))  # servers sit out: the same W workers compute
        if server:
            return {"role": "idle"}
        trace = []
        grad = _slowed(problem, workers.rank, n_workers, cfg)
        if cfg.variant == "sync":
            sync_sgd(workers, w, grad, cfg.steps, cfg.lr, trace)
        else:
            local_sgd(workers, w, grad, cfg.steps, cfg.lr, cfg.k, trace)
        return {"role": "worker", "params": w, "trace": trace}
    bound = cfg.staleness if cfg.variant == "ssp" else None
    if server:
        lo, hi = parameter_server.shard_range(w.numel(), cfg.n_servers, comm.rank)
        step = cfg.lr / n_workers  # W gradients, one per worker: one synchronous step
        log = parameter_server.serve(
            comm, w[lo:hi].clone(), step, cfg.n_servers, bound, trace_every=cfg.trace_every
        )
        return {"role": "server", "log": log}
    grad = _slowed(problem, comm.rank - cfg.n_servers, n_workers, cfg)
    log = parameter_server.work(comm, w.numel(), grad, cfg.steps, cfg.n_servers)
    return {"role": "worker", "log": log}


def _slowed(problem: LeastSquares, worker: int, n_workers: int, cfg: Config):
    """The worker's gradient with the configured compute time and straggler delay."""
    grad = with_delay(problem.grad_fn(worker), cfg.compute)
    if cfg.straggler == "fixed" and worker == n_workers - 1:
        return with_delay(grad, cfg.delay)
    if cfg.straggler == "random":
        return with_delay(grad, cfg.delay, cfg.chance, seed=worker)
    return grad
