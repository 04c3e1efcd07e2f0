"""Lesson 02: all-reduce by hand three ways: is it exact, what does it send, how fast is it.

python lessons/02_collectives/demo.py                              # 4 ranks as threads
minidist run -n 4 --backend mpi lessons/02_collectives/demo.py     # make demo
minidist run -n 4 --backend gloo lessons/02_collectives/demo.py
"""

import time

import torch

from minidist.collectives import algorithms as collectives
from minidist.comm import Counter, ObservedComm
from minidist.launch.launcher import demo_init

FORMULA = {  # bytes each rank sends, N elements of b bytes (the module docstring's table)
    "naive": "root (p-1) N b, others N b",
    "recursive_doubling": "log2(p) N b (p a power of two)",
    "ring": "2 (p-1)/p N b, all to rank+1",
}


def exact_and_counted(comm, n: int) -> None:
    """All-reduce integer-valued data with each algorithm; check it; count the bytes sent."""
    p = comm.world_size
    x = torch.arange(n, dtype=torch.float64) + comm.rank  # (n,): rank r holds 0+r, 1+r, ...
    want = p * torch.arange(n, dtype=torch.float64) + p * (p - 1) // 2  # exact: small integers
    if comm.rank == 0:
        print(f"all-reduce of {n} float64 ({n * 8 / 2**20:g} MiB) on {p} ranks over {comm.backend}")
        print(f"{'algorithm':20} {'exact':6} {f'MiB sent by rank 0..{p - 1}':25} formula")
    for name in collectives.ALGORITHMS:
        counter = Counter()
        y = collectives.all_reduce(x.clone(), ObservedComm(comm, counter), algorithm=name)
        mine = torch.tensor([counter.bytes_sent, int(torch.equal(y, want))])
        sent = comm.all_gather(torch.empty(p, 2, dtype=torch.int64), mine)  # (p, 2)
        if comm.rank == 0:
            mib = " ".join(f"{b / 2**20:4.1f}" for b in sent[:, 0].tolist())
            exact = "yes" if sent[:, 1].all() else "NO"
            print(f"{name:20} {exact:6} {mib:25} {FORMULA[name]}")


def seconds(comm, fn, x: torch.Tensor, iters: int) -> float:
    """Mean seconds per call of fn(x), the slowest rank's (a collective is as slow as that)."""
    fn(x)  # warm up: first calls set up links and buffers
    comm.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn(x)
    took = torch.tensor([(time.perf_counter() - start) / iters])
    return comm.all_reduce(took, op="max").item()


def timing_table(comm, sizes: list[int]) -> None:
    """Microseconds per all-reduce: each hand-written algorithm next to the library's own."""
    p = comm.world_size
    fns = {name: lambda t, a=name: collectives.all_reduce(t, comm, algorithm=a) for name in FORMULA}
    fns["library"] = comm.all_reduce  # the backend's own all-reduce (MPI_Allreduce, Gloo, ...)
    if comm.rank == 0:
        print("\nmicroseconds per all-reduce of float32 (the slowest rank's mean)")
        names = [k.replace("recursive_", "rec. ") for k in fns]
        print(f"{'size':>10}" + "".join(f"{k:>15}" for k in names) + f"{'ring busbw':>15}")
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)  # (nbytes/4,)
        iters = max(3, min(200, (4 << 20) // nbytes))
        times = {k: seconds(comm, fn, x, iters) for k, fn in fns.items()}
        busbw = 2 * (p - 1) / p * nbytes / times["ring"] / 1e9  # GB/s over each rank's link
        if comm.rank == 0:
            row = "".join(f"{t * 1e6:15.1f}" for t in times.values())
            print(f"{nbytes // 1024:>6} KiB{row}{busbw:>10.2f} GB/s")


if __name__ == "__main__":
    comm = demo_init(__file__)  # plain `python demo.py`: 4 thread-ranks
    exact_and_counted(comm, 1 << 20)
    timing_table(comm, [1 << 10, 1 << 16, 1 << 20, 1 << 24])
