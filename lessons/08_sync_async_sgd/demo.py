"""Sync vs async SGD: the same workers, one of them slow, four ways to synchronize.

    python lessons/08_sync_async_sgd/demo.py                                   # 4 thread-ranks
    minidist run -n 4 --backend mpi lessons/08_sync_async_sgd/demo.py         # 4 processes

Rank 0 is the parameter server (or sits out), ranks 1..p-1 are workers solving one least-squares
problem; every gradient takes 5 ms, and the last worker takes 20 ms: a straggler. For each
variant rank 0 prints when the loss fell below 1e-4 of its start, when the last worker was
done, and for the parameter server how stale the applied gradients were (updates between a
worker's pull and its push).
"""

import time

import torch

from minidist.launch.launcher import demo_init
from minidist.sgd.variants import Config, least_squares, train

STEPS = 40  # gradients per worker
COMPUTE = 0.005  # seconds a gradient costs
SLOW = 0.015  # the straggler's extra seconds per gradient
TARGET = 1e-4  # "trained": the loss below TARGET times the loss at the start


def main(comm):
    if comm.world_size < 2:
        raise SystemExit("run it with at least 2 ranks: a server and a worker")
    n_workers = comm.world_size - 1
    problem = least_squares(n_workers, rows=128, d=16, batch=16, seed=0)
    start_loss = problem.loss(torch.zeros(16, dtype=torch.float64))
    if comm.rank == 0:
        print(
            f"{n_workers} workers, {STEPS} gradients each, {COMPUTE * 1e3:g} ms per gradient, "
            f"worker {n_workers - 1} {SLOW * 1e3:g} ms slower; loss at start {start_loss:.3g}"
        )
    for variant, label in [
        ("sync", "sync (all-reduce)"),
        ("async", "async (param server)"),
        ("ssp", "bounded staleness s=2"),
        ("local", "local SGD, k=8"),
    ]:
        cfg = Config(variant, STEPS, 0.2, compute=COMPUTE, straggler="fixed", delay=SLOW)
        cfg = Config(**{**cfg.__dict__, "trace_every": n_workers})  # a snapshot per round
        comm.barrier()
        start = time.monotonic()
        result = train(comm, problem, cfg)
        seconds = comm.all_reduce(torch.tensor([time.monotonic() - start]), "max").item()
        trace = result["log"].trace if result["role"] == "server" else result.get("trace", [])
        hits = [s for s, _, w in trace if problem.loss(w) <= TARGET * start_loss]
        hit = torch.tensor([hits[0] if hits else float("inf")], dtype=torch.float64)
        comm.broadcast(hit, 1 if variant in ("sync", "local") else 0)  # from who holds w
        if comm.rank == 0:
            print(
                f"{label:22} trained after {hit.item():5.2f} s, last worker done {seconds:5.2f} s"
            )
            if result["role"] == "server":
                histogram([e.version - e.pulled for e in result["log"].events])


def histogram(staleness):
    """One text bar per staleness value: how many applied gradients were that stale."""
    counts = torch.bincount(torch.tensor(staleness)).tolist()
    for value, count in enumerate(counts):
        if count:
            print(f"    staleness {value:2d}: {'#' * (count // 2):40.40} {count}")


if __name__ == "__main__":
    comm = demo_init(__file__)  # plain `python demo.py`: 4 thread-ranks
    main(comm)
