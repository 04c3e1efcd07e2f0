"""Lesson 11: a k times larger batch, trained with k times the rate and a warm-up, follows the
small batch's loss; without the warm-up it does worse. Accumulation makes the large batch fit.

python lessons/11_large_batches/demo.py                                    # 4 ranks as threads
minidist run -n 4 --backend mpi lessons/11_large_batches/demo.py           # or --backend gloo
"""

import torch
from torch import nn

from minidist.data_parallel.wrappers import DataParallelBucketed, shard
from minidist.large_batches.accumulation import train_step
from minidist.large_batches.bench import mlp, task, train_curve
from minidist.large_batches.lr import lr_at, scaled_lr
from minidist.launch.launcher import demo_init

B0 = 16
LR0 = 0.06
K = 8
WARMUP = 8


def schedule(say) -> None:
    """The large batch's rate at a few steps: linear warm-up from LR0, then cosine decay."""
    peak = scaled_lr(LR0, B0, K * B0, "linear")
    steps = [0, 1, 3, WARMUP - 1, WARMUP, 16, 24, 31]  # of 32 steps: 4096 samples / 128
    rates = [lr_at(s, peak, WARMUP, 32, "cosine", start=1 / K) for s in steps]
    say(
        f"batch {B0} -> {K * B0}: rate {LR0} -> {peak:.2f} (linear rule), "
        f"{scaled_lr(LR0, B0, K * B0, 'sqrt'):.3f} by the sqrt rule"
    )
    pairs = ", ".join(f"{s}: {r:.3f}" for s, r in zip(steps, rates, strict=True))
    say(f"  warm-up from lr0 over {WARMUP} steps, then cosine; step: rate  {pairs}")


def accumulation_is_one_big_step(comm, say) -> None:
    """4 microbatches per rank, no_sync until the last, equal one step on the whole batch."""
    data = task(8 * 4 * comm.world_size)
    x, y = data["x"], data["y"]  # (32p, 32), (32p,): the global batch
    ref = mlp(1, 64, 2)
    nn.functional.cross_entropy(ref(x), y).backward()
    model = DataParallelBucketed(mlp(1, 64, 2), comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.functional.cross_entropy
    train_step(
        model,
        loss_fn,
        shard(x, comm),
        shard(y, comm),
        opt,
        4,
        no_sync=model.no_sync,
        finish=model.finish_gradient_sync,
    )
    worst = max(
        (q.grad - q_ref.grad).abs().max().item()
        for q, q_ref in zip(model.parameters(), ref.parameters(), strict=True)
    )
    worst = comm.all_reduce(torch.tensor([worst]), "max").item()
    say(
        f"4 microbatches x {comm.world_size} ranks vs one batch of {len(x)}: max |grad diff| "
        f"{worst:.1e} (float32 rounding: the rows are summed in another order)"
    )


def main(comm):
    torch.set_num_threads(1)
    say = print if comm.rank == 0 else lambda *_: None
    schedule(say)
    accumulation_is_one_big_step(comm, say)
    data = task(4096)
    big = dict(batch=K * B0, lr=scaled_lr(LR0, B0, K * B0), micro=2)  # 2 microbatches per rank
    runs = [
        dict(name="small", batch=B0, lr=LR0, warmup=0, start=0.0, micro=1),
        dict(name="large + warm-up", warmup=WARMUP, start=1 / K, **big),
        dict(name="large, no warm-up", warmup=0, start=0.0, **big),
    ]
    say(
        f"held-out loss every 512 samples (the labels' entropy, the best possible: "
        f"{data['floor']:.3f}):"
    )
    for run in runs:
        curve = train_curve(comm, run, data, eval_every=512)
        say(f"  {run['name']:18} " + " ".join(f"{loss:.3f}" for _, loss in curve))


if __name__ == "__main__":
    comm = demo_init(__file__)  # plain `python demo.py`: 4 thread-ranks
    main(comm)
