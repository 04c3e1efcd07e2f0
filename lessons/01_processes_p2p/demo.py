"""Lesson 01: who am I (rank), how many are we (world size), and passing messages.

python lessons/01_processes_p2p/demo.py                             # 4 ranks as threads
minidist run -n 4 --backend mpi lessons/01_processes_p2p/demo.py    # 4 MPI processes
minidist run -n 4 --backend gloo lessons/01_processes_p2p/demo.py   # 4 Gloo processes
"""

from __future__ import annotations

import os
import time

import torch

from minidist.launch.launcher import demo_init


def who_is_where(comm) -> None:
    """Rank 0 receives every rank's process id and prints them: threads share one process."""
    me = torch.tensor([os.getpid()])
    if comm.rank != 0:
        comm.send(me, dst=0)
        return
    print(f"{comm.world_size} ranks over {comm.backend}:")
    for r in range(comm.world_size):
        got = me.clone() if r == 0 else comm.recv(torch.zeros_like(me), src=r)
        print(f"  rank {r}: process {got.item()}")


def ring_pass(comm) -> None:
    """A token goes 0 -> 1 -> ... -> p-1 -> 0; every rank adds its rank to it."""
    p, r = comm.world_size, comm.rank
    token = torch.zeros(1, dtype=torch.int64)
    if r != 0:  # rank 0 starts: if every rank received first, none would ever send
        comm.recv(token, src=r - 1)
    comm.send(token + r, dst=(r + 1) % p)
    if r == 0:
        comm.recv(token, src=p - 1)
        print(f"ring: the token came back to rank 0 holding {token.item()} = 0+1+...+{p - 1}")


def ping_pong(comm, peer: int, nbytes: int, iters: int) -> float:
    """Seconds one message of nbytes takes one way: half the mean round trip to `peer`."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    # one side sends first, the other receives first: both receiving first would wait forever
    first, then = (comm.send, comm.recv) if comm.rank < peer else (comm.recv, comm.send)
    for i in range(iters + 10):
        if i == 10:  # the first 10 round trips warm the link up: not timed
            start = time.perf_counter()
        first(buf, peer)
        then(buf, peer)
    return (time.perf_counter() - start) / iters / 2


def main(comm) -> None:
    who_is_where(comm)
    if comm.world_size == 1:
        return
    ring_pass(comm)
    if comm.rank == 0:
        print("ping-pong with rank 0   8 B one way (us)   1 MiB one way (us)   bandwidth (GB/s)")
    for peer in range(1, comm.world_size):  # one pair at a time; the others wait
        if comm.rank in (0, peer):
            other = peer if comm.rank == 0 else 0
            small, big = ping_pong(comm, other, 8, 1000), ping_pong(comm, other, 1 << 20, 20)
            if comm.rank == 0:
                row = f"  rank {peer} {small * 1e6:23.1f} {big * 1e6:20.0f}"
                print(row, f"{2**20 / big / 1e9:18.2f}")
        comm.barrier()


if __name__ == "__main__":
    comm = demo_init(__file__)  # plain `python demo.py`: 4 thread-ranks
    main(comm)
