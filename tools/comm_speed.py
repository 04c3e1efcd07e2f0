"""How much minidist's comm layer adds to the library under it, per size: a table.

    minidist run -n 2 --backend mpi tools/comm_speed.py [max_bytes]
    minidist run -n 2 --backend gloo tools/comm_speed.py [max_bytes]

Float32, sizes 1 KiB .. 64 MiB (or max_bytes). Every case runs in the same job, round after
round, so machine noise hits all alike: each rank times ROUNDS rounds of a case, keeps the median
microseconds per call, and the table shows the slowest rank's. Columns:
  raw ar      the library's all-reduce called directly (mpi4py on numpy; torch.distributed)
  comm ar     comm.all_reduce through minidist
  ring        collectives.ring_all_reduce (built from comm.isend/irecv)
  best hand   the faster of ring and recursive_doubling_all_reduce at this size
  plain ring  (mpi) the same ring in 15 lines of mpi4py on numpy: what Python itself costs
  raw p2p     one way, half a ping-pong through the library;  comm p2p: through minidist
Ratios: raw / comm ar (1.0 = no overhead), raw / ring (>= 1: the ring is faster).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

import minidist
from minidist.collectives.algorithms import recursive_doubling_all_reduce, ring_all_reduce

ROUNDS = 5


def plain_ring(buf: np.ndarray, world) -> None:
    """Ring all-reduce (sum) of a float32 numpy array in place: mpi4py only."""
    p, r = world.Get_size(), world.Get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    bounds = [(i * buf.size // p, (i + 1) * buf.size // p) for i in range(p)]
    tmp = np.empty(bounds[-1][1] - bounds[-1][0], dtype=buf.dtype)
    for s in range(p - 1):  # reduce-scatter
        lo, hi = bounds[(r - s - 1) % p]
        rlo, rhi = bounds[(r - s - 2) % p]
        req = world.Isend(buf[lo:hi], right)
        world.Recv(tmp[: rhi - rlo], left)
        np.add(buf[rlo:rhi], tmp[: rhi - rlo], out=buf[rlo:rhi])
        req.Wait()
    for s in range(p - 1):  # all-gather
        lo, hi = bounds[(r - s) % p]
        rlo, rhi = bounds[(r - s - 1) % p]
        req = world.Isend(buf[lo:hi], right)
        world.Recv(buf[rlo:rhi], left)
        req.Wait()


def ping_pong(rank: int, send, recv):
    """Rank 0 sends, rank 1 sends back: one round trip (the table halves it)."""
    if rank == 0:
        return lambda: (send(1), recv(1))
    return lambda: (recv(0), send(0))


def cases(comm, x: torch.Tensor) -> dict:
    """name -> a call doing one operation on x (1-D float32)."""
    send = lambda peer: comm.send(x, peer)  # noqa: E731
    recv = lambda peer: comm.recv(x, peer)  # noqa: E731
    out = {}
    if comm.backend == "mpi":
        from mpi4py import MPI

        world, buf = MPI.COMM_WORLD, x.numpy()
        out["raw ar"] = lambda: world.Allreduce(MPI.IN_PLACE, buf)
        raw_send, raw_recv = (lambda q: world.Send(buf, q)), (lambda q: world.Recv(buf, q))
    else:
        import torch.distributed as dist

        out["raw ar"] = lambda: dist.all_reduce(x)
        raw_send, raw_recv = (lambda q: dist.send(x, q)), (lambda q: dist.recv(x, q))
    out["comm ar"] = lambda: comm.all_reduce(x)
    out["ring"] = lambda: ring_all_reduce(x, comm)
    out["rec. doubling"] = lambda: recursive_doubling_all_reduce(x, comm)
    if comm.backend == "mpi":
        out["plain ring"] = lambda: plain_ring(buf, world)
    out["raw p2p"] = ping_pong(comm.rank, raw_send, raw_recv)
    out["comm p2p"] = ping_pong(comm.rank, send, recv)
    return out


def measure(comm, nbytes: int) -> dict[str, float]:
    """Median us per call of every case at nbytes, the slowest rank's."""
    x = torch.zeros(nbytes // 4)  # sums of zeros stay finite, and cost what others do
    calls = cases(comm, x)
    iters = max(3, min(300, (8 << 20) // nbytes))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            call()  # warm up
            comm.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                call()
            times[name].append((time.perf_counter() - start) / iters * 1e6)
    medians = torch.tensor([statistics.median(times[name]) for name in calls], dtype=torch.float64)
    comm.all_reduce(medians, "max")
    result = dict(zip(calls, medians.tolist(), strict=True))
    result["raw p2p"] /= 2  # one way
    result["comm p2p"] /= 2
    return result


def main() -> None:
    torch.set_num_threads(1)  # one core per rank: the ranks share the machine
    comm = minidist.init()
    if comm.world_size != 2:
        raise SystemExit(f"run with -n 2 (world_size={comm.world_size})")
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
    sizes = [1 << k for k in range(10, 27, 2) if 1 << k <= top]
    rows = []
    for nbytes in sizes:
        m = measure(comm, nbytes)
        m["best hand"] = min(m["ring"], m["rec. doubling"])
        rows.append((nbytes, m))
    if comm.rank != 0:
        return
    names = [n for n in rows[0][1] if n != "rec. doubling"]
    print(f"{comm.backend}, 2 ranks, float32, median us per call, slowest rank")
    print(f"{'size':>9}" + "".join(f"{n:>12}" for n in names) + "  raw/comm  raw/ring  p2p r/c")
    for nbytes, m in rows:
        size = f"{nbytes >> 10} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB"
        cells = "".join(f"{m[n]:12.1f}" for n in names)
        ratios = m["raw ar"] / m["comm ar"], m["raw ar"] / m["ring"], m["raw p2p"] / m["comm p2p"]
        print(f"{size:>9}{cells}" + "".join(f"{q:10.2f}" for q in ratios))


if __name__ == "__main__":
    main()
