"""Lesson 14: a mixture-of-experts layer with its experts spread over the ranks equals the layer
in one process; what its all-to-alls send; the load imbalance the auxiliary loss removes.

python lessons/14_expert_parallel/demo.py                               # 4 ranks as threads
minidist run -n 4 --backend mpi lessons/14_expert_parallel/demo.py      # or --backend gloo
"""

import timeit

import torch

from minidist.comm import Counter, ObservedComm
from minidist.expert_parallel.moe import Expert, ExpertParallelMoE, MoE, step_nbytes, sync_grads
from minidist.launch.launcher import demo_init

D = 16  # width
F = 32  # an expert's hidden width
E = 8  # experts
N = 64  # tokens per rank


def tokens(step: int, p: int) -> torch.Tensor:  # (N p, D); a shared offset: few experts win
    gen = torch.Generator().manual_seed(step)
    return 2 + torch.randn(N * p, D, generator=gen, dtype=torch.float64)


def equal_demo(comm, k: int = 2, cf: float = 1.0) -> None:
    p, r = comm.world_size, comm.rank
    x, mine = tokens(0, p), slice(r * N, (r + 1) * N)
    y_full, _ = MoE(D, F, E, k, cf, seed=1)(x, [N] * p)  # one process, one group per rank
    counter = Counter()
    layer = ExpertParallelMoE(D, F, E, ObservedComm(comm, counter), k, cf, seed=1)
    y, aux = layer(x[mine].clone().requires_grad_())  # as inside a model: dL/dx goes back too
    (y.square().sum() + aux).backward()
    routes = [layer.router(xg) for xg in x.split(N)]  # every group's routing, for the formula
    owner = torch.arange(E) // (E // p)  # (E,): the rank of each expert
    out = int(routes[r].counts[owner != r].sum())
    into = sum(int(routes[g].counts[owner == r].sum()) for g in range(p) if g != r)
    want = step_nbytes(out, into, D, 8, E // p, p)
    diff = comm.all_reduce((y - y_full[mine]).abs().max().reshape(1), "max").item()
    if r == 0:
        print(f"E={E} experts over ep={p} ranks ({comm.backend}), top-{k}, capacity factor {cf}")
        print(f"  max |y - one process| {diff:.1e}; rank 0 dropped {routes[0].dropped} of {k * N}")
        print(f"  rank 0 sent {counter.bytes_sent:,} bytes forward+backward, formula {want:,}")


def imbalance_demo(comm, alpha: float, steps: int = 30) -> None:
    p, r = comm.world_size, comm.rank
    layer = ExpertParallelMoE(D, F, E, comm, 1, None, alpha, seed=1)  # no capacity: raw load
    opt = torch.optim.SGD(layer.parameters(), lr=0.1 / p)
    for step in range(steps):
        x = tokens(step + 1, p)[r * N : (r + 1) * N]  # (N, D) this rank's tokens
        y, aux = layer(x)
        ((y - torch.tanh(x)).square().mean() + aux).backward()
        sync_grads(layer, comm)
        opt.step()
        opt.zero_grad()
    load = comm.all_reduce(layer.router(x).first.double(), "sum")  # (E,) tokens per expert
    share, cap = load.max().item() / load.sum().item(), 1.25 * N * p / E
    if r == 0:
        dropped = (load - cap).clamp(min=0).sum().item() / load.sum().item()
        print(f"\nalpha={alpha}: tokens per expert after {steps} steps {load.int().tolist()}")
        print(
            f"  slowest expert {share:.0%} of tokens (balanced {1 / E:.0%}); capacity 1.25 "
            f"would drop {dropped:.0%}"
        )
        busy, even = (expert_ms(round(n)) for n in (load.max().item(), N * p / E))
        print(
            f"  its forward+backward at D=512: {busy:.1f} ms, balanced {even:.1f} ms: "
            f"{busy / even:.1f}x the time for {share * E:.1f}x the tokens"
        )
    comm.barrier()  # the others wait while rank 0 times; at the combine they would wait too


def expert_ms(rows: int) -> float:
    """One expert's forward+backward on rows tokens at D=512, F=2048 (the matmuls take the time,
    not Python), in ms: the fastest of 9, the least disturbed by other jobs on the machine."""
    expert, x = Expert(512, 2048, 0, 0, torch.float32), torch.randn(rows, 512)
    return min(timeit.repeat(lambda: expert(x).sum().backward(), number=1, repeat=9)) * 1e3


if __name__ == "__main__":
    comm = demo_init(__file__)  # plain `python demo.py`: 4 thread-ranks
    torch.set_num_threads(1)  # one core per rank: the ranks share the machine
    equal_demo(comm)
    for alpha in (0.0, 1.0):
        imbalance_demo(comm, alpha)
