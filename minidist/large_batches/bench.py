"""Large batches and memory: learning-rate scaling with warm-up, and what mixed precision and
checkpointing save.

    minidist bench batch [-n 2 --backend threads|mpi|gloo] [--k 8] [--json]

Part 1, large batches (Goyal et al.): a student MLP learns a fixed random teacher's classes
(cross-entropy), every run on the same --samples samples in the same order, once each, and
data-parallel over the world (each global batch split into p equal shares; the large batches
also into --micro accumulated microbatches per rank). Four runs:
    small            batch B0, rate lr0 (SGD, momentum 0.9), cosine decay
    large + warm-up  batch k B0, rate k lr0 (linear rule), warm-up from lr0 over --warmup steps
    large, no warm-up   batch k B0, rate k lr0 from the first step
    sqrt + warm-up   batch k B0, rate sqrt(k) lr0 (square-root rule), the same warm-up
The held-out loss against samples seen is drawn to out/batch_curves.png; the table gives the
final loss and the mean relative gap to the small-batch curve at equal samples seen.
Part 2, memory (rank 0 alone, one process): --blocks residual MLP blocks in float32, bfloat16
and float16 (minidist.mixed_precision.amp), each with no checkpointing, every block, every sqrt(n)
blocks:
    activations  peak saved-tensor bytes (SavedTensorMeter) beside predicted_peak(n, k, A, b)
    model state  parameters + gradients + masters + float32 gradient buffer + Adam state,
                 measured, beside 16 N (float32) and 20 N (mixed) bytes, N parameters
    time         forward + backward; recomputation overhead beside (t + F) / t, F a forward
Times are the fastest of --repeats, the policies taken in turn, on a shared, noisy machine;
ratios come from one run.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
from torch import nn

from minidist.bench import Bench, rank_main
from minidist.checkpointing.recompute import (
    CheckpointedSequential,
    SavedTensorMeter,
    predicted_peak,
)
from minidist.data_parallel.wrappers import DataParallelBucketed, shard
from minidist.large_batches.accumulation import train_step
from minidist.large_batches.lr import WarmupDecay, scaled_lr
from minidist.mixed_precision.amp import PRECISIONS, LossScaler, MixedPrecisionOptimizer

# the student: 4 hidden layers of 128
D_IN = 32
CLASSES = 8
WIDTH = 128
DEPTH = 4


def mlp(seed: int, width: int, depth: int) -> nn.Sequential:
    """ReLU MLP D_IN -> width x depth -> CLASSES, He-initialised from `seed`."""
    g = torch.Generator().manual_seed(seed)
    sizes = [D_IN] + [width] * depth + [CLASSES]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        linear = nn.Linear(a, b)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(b, a, generator=g) * math.sqrt(2 / a))
            linear.bias.zero_()
        layers += [linear, nn.ReLU()] if i < depth else [linear]
    return nn.Sequential(*layers)


def task(samples: int) -> dict:
    """`samples` training rows and 2048 held-out rows, labels drawn from a fixed random
    teacher's softmax (one seed). Noisy labels make the gradient noisy, which is what a larger
    batch averages away; the best possible loss is the labels' entropy (the "floor")."""
    g = torch.Generator().manual_seed(0)
    teacher = mlp(100, 64, 2)
    x, x_eval = torch.randn(samples, D_IN, generator=g), torch.randn(2048, D_IN, generator=g)
    with torch.no_grad():
        probs, probs_eval = torch.softmax(teacher(x), 1), torch.softmax(teacher(x_eval), 1)
    floor = -(probs_eval * probs_eval.log()).sum(1).mean().item()
    return {
        "x": x,
        "y": torch.multinomial(probs, 1, generator=g)[:, 0],  # (samples,)
        "x_eval": x_eval,
        "y_eval": torch.multinomial(probs_eval, 1, generator=g)[:, 0],
        "floor": floor,
    }


def runs(args) -> list[dict]:
    """The four settings of part 1: batch, peak rate, warm-up steps, start fraction, micro."""
    k = args.k
    b0 = args.base_batch
    lr0 = args.base_lr
    big = dict(batch=k * b0, micro=args.micro)
    return [
        dict(name="small", batch=b0, lr=lr0, warmup=0, start=0.0, micro=1),
        dict(
            name="large + warm-up",
            lr=scaled_lr(lr0, b0, k * b0),
            warmup=args.warmup,
            start=1 / k,
            **big,
        ),
        dict(name="large, no warm-up", lr=scaled_lr(lr0, b0, k * b0), warmup=0, start=0.0, **big),
        dict(
            name="sqrt + warm-up",
            lr=scaled_lr(lr0, b0, k * b0, "sqrt"),
            warmup=args.warmup,
            start=1 / math.sqrt(k),
            **big,
        ),
    ]


def train_curve(comm, run: dict, data: dict, eval_every: int) -> list[tuple[int, float]]:
    """Train one setting data-parallel; (samples seen, held-out loss) every eval_every."""
    model = DataParallelBucketed(mlp(1, WIDTH, DEPTH), comm)
    opt = torch.optim.SGD(model.parameters(), lr=run["lr"], momentum=0.9)
    steps = len(data["x"]) // run["batch"]
    schedule = WarmupDecay(opt, run["warmup"], steps, "cosine", start=run["start"])
    loss_fn = nn.functional.cross_entropy
    curve = []
    for step in range(steps):
        lo, hi = step * run["batch"], (step + 1) * run["batch"]
        x, y = shard(data["x"][lo:hi], comm), shard(data["y"][lo:hi], comm)  # this rank's rows
        train_step(
            model,
            loss_fn,
            x,
            y,
            opt,
            run["micro"],
            no_sync=model.no_sync,
            finish=model.finish_gradient_sync,
        )
        schedule.step()
        if hi % eval_every == 0:
            with torch.no_grad():  # replicas are identical: each rank evaluates its own
                curve.append((hi, loss_fn(model(data["x_eval"]), data["y_eval"]).item()))
    return curve


def large_batches(comm, args) -> tuple[list[dict], float]:
    """The four runs with their curves, final loss and mean gap; and the loss floor."""
    data = task(args.samples)
    rows = [dict(run, curve=train_curve(comm, run, data, args.eval_every)) for run in runs(args)]
    small = [loss for _, loss in rows[0]["curve"]]
    for row in rows:
        losses = [loss for _, loss in row["curve"]]
        gaps = [abs(a - b) / b for a, b in zip(losses, small, strict=True)]
        row["final"], row["gap"] = losses[-1], statistics.fmean(gaps)
    return rows, data["floor"]


class Block(nn.Module):
    """x + W2 gelu(W1 x): saves x, W1 x and gelu(W1 x) for backward: A = B (d + 2f) bytes."""

    def __init__(self, d: int, f: int, g: torch.Generator):
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, f), nn.Linear(f, d)
        with torch.no_grad():
            for q in self.parameters():
                q.copy_(torch.randn(q.shape, generator=g) / math.sqrt(q.shape[-1]))

    def forward(self, x):  # x: (B, d) -> (B, d)
        return x + self.l2(nn.functional.gelu(self.l1(x)))


def fastest(fns: list, repeats: int) -> list[float]:
    """The fastest of `repeats` runs of each fn, taking the fns in turn: on a shared machine
    the least disturbed run is the best estimate, and a change of load hits all fns alike."""
    for fn in fns:
        fn()  # warm-up
    best = [math.inf] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def model_state_bytes(model: nn.Module, opt, mp) -> int:
    """Parameters + gradients (at their peak, just after backward) + masters + fp32 buffer +
    optimizer state tensors the size of a parameter (Adam's two moments)."""
    params = sum(q.nbytes for q in model.parameters())
    grads = params  # every gradient exists at the end of backward, in the model's dtype
    state = sum(
        v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    )
    masters = 0 if mp is None else sum(m.nbytes for m in mp.master) + mp.grad_flat.nbytes
    return params + grads + masters + state


def memory_cell(args, precision: str, policy: str) -> tuple[dict, object]:
    """One (precision, policy) cell of part 2: its row (activations, model state) and a
    function running one forward + backward."""
    g = torch.Generator().manual_seed(0)
    blocks = [Block(args.d, 4 * args.d, g) for _ in range(args.blocks)]
    model = CheckpointedSequential(blocks, policy)
    mp = None
    if precision == "fp32":
        opt = torch.optim.Adam(model.parameters())
        backward = torch.Tensor.backward
    else:
        scaler = LossScaler(2.0**8, dynamic=precision == "fp16")
        mp = MixedPrecisionOptimizer(model, torch.optim.Adam, PRECISIONS[precision], scaler)
        opt, backward = mp.optimizer, mp.backward
    x = torch.randn(args.batch, args.d, generator=g).to(PRECISIONS[precision].compute)  # (B, d)

    def fwd_bwd():  # mean(): a head that saves no tensor, so the meter sees the blocks alone
        backward(model(x).float().mean())

    with SavedTensorMeter(exclude=model.parameters()) as meter:
        fwd_bwd()
    (mp or opt).step()  # the optimizer state exists from the first step on
    a = args.batch * (args.d + 2 * 4 * args.d) * x.element_size()  # x, W1 x, gelu(W1 x)
    b = args.batch * args.d * x.element_size()
    n = sum(q.numel() for q in model.parameters())
    row = {
        "precision": precision,
        "policy": policy,
        "k": model.k,
        "peak": meter.peak,
        "predicted": predicted_peak(args.blocks, model.k, a, b),
        "state": model_state_bytes(model, opt, mp),
        "state_formula": (16 if mp is None else 20) * n,
    }

    def forward():  # F: what a recomputation adds, a forward that records the graph
        model(x)

    return row, fwd_bwd, forward


def memory_table(args) -> list[dict]:
    """Every cell; times per precision taken in turn, with the plain model's forward F."""
    rows = []
    for precision in ("fp32", "bf16", "fp16"):
        cells = [memory_cell(args, precision, policy) for policy in ("none", "block", "sqrt")]
        *times, f = fastest([cell[1] for cell in cells] + [cells[0][2]], args.repeats)
        for (row, _, _), t in zip(cells, times, strict=True):
            row["time"] = t
            row["forward"] = f
            row["overhead"] = t / times[0]
            row["overhead_formula"] = 1.0 if row["k"] == 0 else 1 + f / times[0]  # (t + F) / t
            rows.append(row)
    return rows


def draw(rows: list[dict], floor: float, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for row in rows:
        seen, loss = zip(*row["curve"], strict=True)
        ax.plot(seen, loss, label=f"{row['name']} (batch {row['batch']}, lr {row['lr']:.3g})")
    ax.axhline(floor, color="gray", linestyle=":", label=f"floor: the labels' entropy {floor:.3f}")
    ax.set(
        xlabel="samples seen", ylabel="held-out loss", title="large batches: scaled rate, warm-up"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(result: dict, args) -> str:
    batch_rows, floor = result["large_batches"], result["floor"]
    lines = [
        f"large batches: world {args.n} ({args.backend}), {args.samples} samples, k = {args.k}, "
        f"base batch {args.base_batch}, base lr {args.base_lr}, SGD momentum 0.9, cosine decay; "
        f"loss floor (the labels' entropy) {floor:.4f}",
        f"  {'run':18} {'batch':>5} {'micro':>5} {'peak lr':>8} {'warm-up':>7} {'final loss':>10} "
        f"{'- floor':>8} {'gap to small':>12}",
    ]
    for r in batch_rows:
        lines.append(
            f"  {r['name']:18} {r['batch']:5d} {r['micro']:5d} {r['lr']:8.3f} {r['warmup']:7d} "
            f"{r['final']:10.4f} {r['final'] - floor:8.4f} {r['gap']:12.1%}"
        )
    lines += [
        f"memory: {args.blocks} blocks x (d={args.d}, f={4 * args.d}), batch {args.batch}, Adam "
        "(MiB; time in ms, a shared machine: noisy)",
        f"  {'dtype':5} {'ckpt':5} {'k':>2} {'activations':>11} {'predicted':>9} "
        f"{'model state':>11} {'16N/20N':>8} {'time':>8} {'overhead':>8} {'(t+F)/t':>8}",
    ]
    for r in result["memory"]:
        lines.append(
            f"  {r['precision']:5} {r['policy']:5} {r['k']:2d} {_mib(r['peak']):>11} "
            f"{_mib(r['predicted']):>9} {_mib(r['state']):>11} {_mib(r['state_formula'])} "
            f"{r['time'] * 1e3:8.1f} {r['overhead']:8.2f} {r['overhead_formula']:8.2f}"
        )
    lines.append(f"  curves -> {result['picture']}")
    return "\n".join(lines)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--k", type=int, default=8, help="large batch = k x base batch")
    p.add_argument("--base-batch", type=int, default=16)
    p.add_argument("--base-lr", type=float, default=0.06)
    p.add_argument("--warmup", type=int, default=16, help="warm-up steps of the large runs")
    p.add_argument("--micro", type=int, default=2, help="microbatches per rank, large runs")
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--eval-every", type=int, default=512, help="samples between evaluations")
    p.add_argument("--blocks", type=int, default=8, help="memory: residual blocks")
    p.add_argument("--d", type=int, default=256, help="memory: block width (f = 4d)")
    p.add_argument("--batch", type=int, default=64, help="memory: rows")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="out")


def problems(args: argparse.Namespace) -> list[str]:
    """Why these flags cannot run, one line each (the CLI prints them before starting ranks;
    every number is already in its range): every batch splits evenly over the ranks (and a
    large one's share over its microbatches), every run evaluates at the same samples seen
    (multiples of --eval-every, which the large batch must divide), and the warm-up fits."""
    found, big = [], args.k * args.base_batch
    if args.base_batch % args.n:
        found.append(f"--base-batch {args.base_batch} is not divisible by -n {args.n}")
    elif big // args.n % args.micro:
        found.append(
            f"a rank's share of the large batch, --k {args.k} x --base-batch {args.base_batch} "
            f"/ -n {args.n} = {big // args.n}, is not divisible by --micro {args.micro}"
        )
    if args.eval_every % big:
        found.append(f"--eval-every {args.eval_every} is not a multiple of the large batch {big}")
    if args.samples < args.eval_every:
        found.append(f"--samples {args.samples} is fewer than --eval-every {args.eval_every}")
    if args.warmup > args.samples // big:
        found.append(
            f"--warmup {args.warmup} is more than the large runs' {args.samples // big} steps "
            f"(--samples / the large batch)"
        )
    return found


def measure(comm, args) -> dict | None:
    """Both parts, and the curves drawn: rank 0's result, as --json prints it; None elsewhere."""
    batch_rows, floor = large_batches(comm, args)
    memory_rows = memory_table(args) if comm.rank == 0 else []
    comm.barrier()
    if comm.rank != 0:
        return None
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "batch_curves.png")
    draw(batch_rows, floor, path)
    return {"large_batches": batch_rows, "floor": floor, "memory": memory_rows, "picture": path}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:8.2f}"


WAIT = 900  # seconds a rank may wait: the others wait at a barrier while rank 0 measures memory
BATCH = Bench(
    "batch",
    "large batches (LR scaling, warm-up) and memory tables",
    __name__,
    flags,
    measure,
    report,
    problems,
    backends=("threads", "mpi", "gloo"),
    wait=WAIT,
)

if __name__ == "__main__":
    rank_main(sys.argv[1:], BATCH)
