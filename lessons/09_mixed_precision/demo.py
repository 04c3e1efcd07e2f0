"""Lesson 09: train in bfloat16 and float16 with float32 master weights; watch the loss scale
back off after an overflow, every rank skipping the same steps.

python lessons/09_mixed_precision/demo.py                                  # 4 ranks as threads
minidist run -n 4 --backend mpi lessons/09_mixed_precision/demo.py         # or --backend gloo
"""

import torch
from torch import nn

from minidist.comm.wrappers import Counter, ObservedComm
from minidist.launch.launcher import demo_init
from minidist.mixed_precision.amp import BF16, FP16, FP32, LossScaler, MixedPrecisionOptimizer


def underflow(rank: int) -> None:
    """Why the loss is scaled: a small gradient vanishes in float16 unless multiplied first."""
    if rank == 0:
        g = torch.tensor(1e-8)
        print(
            f"a gradient of 1e-8 in float16: {g.half().item():.3g}; scaled by 2^16 first, then"
            f" divided in float32: {(g * 2**16).half().float().item() / 2**16:.3g}"
        )


def train(comm, precision, scaler, steps: int = 12) -> tuple:
    """Data-parallel training of a small MLP: losses, scales, the optimizer, bytes reduced."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 1))
    with torch.no_grad():
        for q in model.parameters():
            q.copy_(torch.randn(q.shape, generator=g) * 0.2)
    counter = Counter()
    make = lambda params: torch.optim.AdamW(params, lr=3e-3)  # noqa: E731
    mp = MixedPrecisionOptimizer(model, make, precision, scaler, ObservedComm(comm, counter))
    losses, scales = [], []
    for _ in range(steps):
        x = torch.randn(16 * comm.world_size, 32, generator=g)  # (B, 32): the global batch
        y = x[:, :1].sin() + x[:, 1:2]  # (B, 1)
        lo, hi = 16 * comm.rank, 16 * (comm.rank + 1)  # this rank's share
        counter.reset()
        mp.zero_grad()
        loss = nn.functional.mse_loss(model(x[lo:hi].to(precision.compute)).float(), y[lo:hi])
        mp.backward(loss)
        mp.step()
        losses.append(comm.all_reduce(loss.detach().reshape(1), "avg").item())
        scales.append(mp.scaler.scale)
    return losses, scales, mp, counter.nbytes["all_reduce"]


def main(comm):
    underflow(comm.rank)
    runs = {
        "fp32": (FP32, None),
        "bf16": (BF16, None),  # float32's exponent range: no scaling needed
        "fp16": (FP16, LossScaler(2.0**20, growth_interval=4)),  # too large on purpose
    }
    results = {name: train(comm, *setting) for name, setting in runs.items()}
    if comm.rank != 0:
        return
    print(f"\n{comm.world_size} ranks, loss per step (the fp16 scale after each step):")
    for step in range(len(results["fp32"][0])):
        row = "  ".join(f"{name} {r[0][step]:.4f}" for name, r in results.items())
        _, scales, fp16, _ = results["fp16"]
        mark = " skipped" if step in fp16.skipped else ""
        print(f"  step {step:2d}: {row}   scale {scales[step]:>9g}{mark}")
    for name, (_, _, mp, nbytes) in results.items():
        dtypes = f"model {mp.params[0].dtype}, masters {mp.master[0].dtype}"
        print(
            f"{name}: {dtypes}, all-reduced per step: {nbytes} bytes (gradients in "
            f"{mp.precision.reduce}, + 4 for the overflow flag)"
        )


if __name__ == "__main__":
    comm = demo_init(__file__)  # plain `python demo.py`: 4 thread-ranks
    main(comm)
