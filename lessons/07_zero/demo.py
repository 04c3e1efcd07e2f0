"""Lesson 07: ZeRO-1/2/3 train exactly like one process, while each rank holds less.

python lessons/07_zero/demo.py                                # 4 ranks as threads
minidist run -n 4 --backend mpi lessons/07_zero/demo.py      # or --backend gloo
"""

import torch
from torch import nn

from minidist.comm import Counter, ObservedComm
from minidist.launch.launcher import demo_init
from minidist.zero import cost as zero_cost
from minidist.zero import stages as zero

WIDTH, B = 8, 4  # three Linear(8, 8): 72 elements each, 216 in all; B rows per rank


def model() -> nn.Sequential:
    net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, dtype=torch.float64) for _ in range(3)))
    g = torch.Generator().manual_seed(0)  # the same start everywhere, without the global RNG
    start = torch.randn(3 * WIDTH * (WIDTH + 1), generator=g, dtype=torch.float64) * 0.5
    nn.utils.vector_to_parameters(start, net.parameters())
    return net


def train(comm, stage: int, steps: int = 3) -> tuple[float, dict, float]:
    """AdamW, `steps` steps: max |difference| from one process, bytes held, bytes sent."""
    p = comm.world_size
    r = comm.rank
    g = torch.Generator().manual_seed(1)
    ref = model()
    counter = Counter()
    held = {}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    c = ObservedComm(comm, counter)  # with the hand-written ring, every byte sent is counted
    z = zero.wrap(model(), c, torch.optim.AdamW, stage, {"lr": 0.01}, algorithm="ring")
    for _ in range(steps):
        x = torch.randn(B * p, WIDTH, generator=g, dtype=torch.float64)  # the whole batch
        nn.functional.mse_loss(ref(x), x.flip(1)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        counter.reset()
        x_local = x[r * B : (r + 1) * B]  # (B, WIDTH): this rank's share
        nn.functional.mse_loss(z(x_local), x_local.flip(1)).backward()
        before = zero_cost.memory_nbytes(z)  # ZeRO-1 still holds full gradients here
        z.finish_gradient_sync()
        after = zero_cost.memory_nbytes(z)  # gradient shards only (and last step's optimizer state)
        held = {k: max(before[k], after[k], held.get(k, 0)) for k in after}
        z.step()
        z.zero_grad()
    sent = comm.all_reduce(torch.tensor([float(counter.bytes_sent)]), "sum").item() / p
    with z.gathered():  # ZeRO-3 keeps only shards: gather them to compare
        mine = nn.utils.parameters_to_vector(z.parameters())
    return (mine - nn.utils.parameters_to_vector(ref.parameters())).abs().max().item(), held, sent


def main(comm) -> None:
    p, n = comm.world_size, 3 * WIDTH * (WIDTH + 1)
    names = [k for k, _ in model().named_parameters()]
    plan = zero.partition([WIDTH**2, WIDTH] * 3, p)  # ZeRO-1's: one flat buffer, cut in p
    if comm.rank == 0:
        print(f"ZeRO on {p} ranks ({comm.backend}), float64, AdamW; one flat buffer of {n}:")
        for r in range(p):
            mine = " ".join(f"{names[c.index]}[{c.lo}:{c.hi}]" for c in plan.pieces(r))
            print(f"  rank {r} owns flat[{r}S : {r + 1}S], S={plan.shard_numel}: {mine}")
        print(
            "bytes per rank measured (formula: zero_cost.model_state_nbytes, zero_cost.sent_nbytes)"
        )
    for stage in (1, 2, 3):
        diff, held, sent = train(comm, stage)
        want = zero_cost.model_state_nbytes(stage, n, p, 8, 2)  # float64: b = 8; AdamW: k = 2
        flags = 2 * (p - 1) / p * 6 * 8  # + the used-flags: a float64 per parameter tensor
        cells = "  ".join(f"{k} {held[k]:5d} ({want[k]:5.0f})" for k in want)
        if comm.rank == 0:
            print(f"ZeRO-{stage}: |diff| vs one process {diff:.0e}  {cells}  sent/step", end=" ")
            print(f"{sent:5.0f} ({zero_cost.sent_nbytes(stage, n, p, 8) + flags:5.0f})")


if __name__ == "__main__":
    comm = demo_init(__file__)  # plain `python demo.py`: 4 thread-ranks
    main(comm)
