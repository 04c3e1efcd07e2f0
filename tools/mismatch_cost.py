"""What the always-on mismatch check costs per call: 2 ranks, 1 KiB of float32.

    minidist run -n 2 --backend mpi tools/mismatch_cost.py
    minidist run -n 2 --backend gloo tools/mismatch_cost.py

Every variant runs in the same job, round after round (7 rounds of ITERS calls), so machine noise
hits all of them alike; rank 0 prints the median microseconds per call. "no agreement" is
comm.all_reduce with the backend's start_collective (its checks and agreement) replaced by
nothing: the difference is the check.
"raw" calls the library directly (mpi4py on numpy, or torch.distributed), outside minidist.
"debug" is the same call through CheckedComm (debug mode): a ping-pong's two messages each
carry a header message beside them; a collective first all-gathers the signatures and the
message counts.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import minidist
from minidist.collectives.algorithms import ring_all_reduce
from minidist.comm.checked import CheckedComm

ITERS = int(sys.argv[1]) if len(sys.argv) > 1 else 1000


def raw_calls(comm, x: torch.Tensor):
    """(all_reduce, ping-pong) through the library itself."""
    if comm.backend == "mpi":
        from mpi4py import MPI

        world, buf = MPI.COMM_WORLD, x.numpy()
        send, recv = (lambda peer: world.Send(buf, peer)), (lambda peer: world.Recv(buf, peer))
        return (lambda: world.Allreduce(MPI.IN_PLACE, buf)), ping_pong(comm, send, recv)
    import torch.distributed as dist

    send, recv = (lambda peer: dist.send(x, peer)), (lambda peer: dist.recv(x, peer))
    return (lambda: dist.all_reduce(x)), ping_pong(comm, send, recv)


def ping_pong(comm, send, recv):
    """Rank 0 sends, rank 1 sends back: one round trip."""
    if comm.rank == 0:
        return lambda: (send(1), recv(1))
    return lambda: (recv(0), send(0))


def without_agreement(comm, x: torch.Tensor):
    backend = sys.modules[type(comm).__module__]  # minidist.comm.mpi or .torchdist
    start = backend.start_collective

    def call():
        backend.start_collective = lambda *args, **kwargs: False  # not finished: go on
        comm.all_reduce(x)
        backend.start_collective = start

    return call


def main() -> None:
    comm = minidist.init()
    assert comm.world_size == 2, "run with -n 2"
    x = torch.ones(256)  # 1 KiB
    raw_all_reduce, raw_ping_pong = raw_calls(comm, x)
    send = lambda peer: comm.send(x, peer)  # noqa: E731
    recv = lambda peer: comm.recv(x, peer)  # noqa: E731
    checked = CheckedComm(comm)
    debug_send = lambda peer: checked.send(x, peer)  # noqa: E731
    debug_recv = lambda peer: checked.recv(x, peer)  # noqa: E731
    cases = {
        "raw all_reduce": raw_all_reduce,
        "comm.all_reduce": lambda: comm.all_reduce(x),
        "comm.all_reduce, no agreement": without_agreement(comm, x),
        "ring_all_reduce": lambda: ring_all_reduce(x, comm),
        "raw ping-pong": raw_ping_pong,
        "comm ping-pong": ping_pong(comm, send, recv),
        "debug all_reduce": lambda: checked.all_reduce(x),
        "debug ping-pong": ping_pong(comm, debug_send, debug_recv),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(7):
        for name, call in cases.items():
            for _ in range(20):  # warm up
                call()
            comm.barrier()
            start = time.perf_counter()
            for _ in range(ITERS):
                call()
            times[name].append((time.perf_counter() - start) / ITERS * 1e6)
    if comm.rank == 0:
        for name, ts in times.items():
            print(f"{comm.backend:5} {name:30} {statistics.median(ts):9.1f} us per call")


if __name__ == "__main__":
    main()
