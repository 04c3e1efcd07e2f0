"""The planner's step time against `minidist train` measured on this machine (target: within 25%).

    PYTHONPATH=$PWD python tools/plan_validate.py [--steps 4] [--repeats 2] [--backend mpi]

Calibrates this machine from measurements only, none of them of a training step:
  links    alpha and B fitted to `minidist bench p2p --json` (cluster.calibrated);
  memory   a core's copy bandwidth: plan.step prices the elementwise work (elementwise_nbytes)
           and the optimizer (16 bytes a parameter, read and written) with it;
  compute  a core's FLOP/s on the job's own layer: one toy block's forward and backward as
           the job builds it (ParallelTransformerBlock, at tp = 1 too) at the layout's
           microbatch shape (b, s, h), cut over tp as a rank runs it (tp ranks as threads),
           its FLOPs as plan.Shape counts them (the layer's matmuls, its attention scores;
           1/tp of them) over a rank's CPU time, every rank of the layout running at once
           (they share the memory), less the elementwise bytes at the copy bandwidth. What
           is left of the LayerNorms, GELU, softmax (exp, erf: more than memory traffic on a
           CPU), torch's per-op overhead (about 17 us an op, 137 ops a whole block) and the
           smaller matmuls of a tp slice stays in that rate, which a bare matmul leaves out
           (a 256 x 256 matmul ran 20-60% faster a FLOP).
Then for each layout runs `minidist train --json` (one rank per core) and prints the plan's
seconds per step (plan.step, e=4: float32; efficiencies 1, no overlap) beside the measured
median over the steps after the first (the first is warm-up), in rank 0's CPU time and wall
clock. On a loaded machine the wall clock stretches with the other jobs (about load / cores):
the CPU time is what this job's rank spent, and a quiet machine's wall clock is close to it.
A benchmark, not a test: the ratios depend on this machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch

from minidist import plan, plan_cli
from minidist.tensor_parallel_blocks import ParallelTransformerBlock, TransformerBlock
from minidist.testing import run_threads

MODEL = {"seq-len": 128, "d-model": 256, "n-heads": 4, "d-ff": 1024, "n-layers": 4}
SHAPE = plan.Shape("toy", 4, 256, 4, 1024, 256, 128, dropout=False)  # MODEL, bytes vocabulary
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]  # dp, pp, tp: two ranks, one a core
BATCH, MICROBATCHES = 16, 4


def minidist(*args: str) -> dict:
    """`minidist args --json`'s object (its first line: mpiexec may print more)."""
    command = [sys.executable, "-m", "minidist.cli", *args, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(done.stdout.splitlines()[0])


def measured_step(dp: int, pp: int, tp: int, steps: int, backend: str) -> tuple[float, float]:
    """(CPU, wall) seconds per step of rank 0 of `minidist train`: the medians over the steps
    after the first."""
    flags = [f"--{k}={v}" for k, v in MODEL.items()]
    layout = [f"--dp={dp}", f"--pp={pp}", f"--tp={tp}", f"--microbatches={MICROBATCHES}"]
    run = [f"--batch={BATCH}", f"--steps={steps}", "--warmup=0", f"--backend={backend}"]
    summary = minidist("train", *layout, *flags, *run, "--out", tempfile.mkdtemp())
    cpu, wall = summary["step_cpu_seconds"][1:], summary["step_seconds"][1:]
    return statistics.median(cpu), statistics.median(wall)


def _cpu_median(work, repeats: int) -> float:
    """The median CPU seconds of work() in this thread (another job's load does not count)."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        work()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def layer_flops_rate(b: int, tp: int, world: int, memory_bw: float, repeats: int = 21) -> float:
    """A core's FLOP/s on one toy block as a rank of tp runs it, forward and backward, x (b, s,
    h): its matmul FLOPs over its CPU time (the slowest rank's; all `world` ranks of the job at
    once, as threads whose waits sleep, in groups of tp: the job's ranks share the memory,
    which cost one alone about 10% here) less what plan.step prices apart (the elementwise
    bytes at memory_bw; the toy's attention keeps its scores: flash=False)."""
    s, h = SHAPE.seq, SHAPE.hidden
    flops = b * s * 3 * (2 * SHAPE.layer_params() + 4 * s * h) / tp  # step_flops, one layer
    one = plan.Layout(1, 1, tp, b=b)
    memory = plan.elementwise_nbytes(SHAPE, one, False, 4) / SHAPE.layers / memory_bw
    # one torch thread for the whole run: the setting is the process's, not a rank thread's
    with plan_cli._one_thread(torch):
        seconds = max(run_threads(_block_seconds, world, tp, b, repeats, timeout=600))
    return flops / (seconds - memory)


def _block_seconds(comm, tp: int, b: int, repeats: int) -> float:
    """This rank's median CPU seconds of its slice of a toy block, forward and backward, on the
    tp group of its neighbours (as the mesh puts tp ranks: adjacent)."""
    tp_comm = comm.split(comm.rank // tp)
    # the job's own block at every tp, 1 too: its f and g and parallel linears cost time even
    # on one rank (a plain TransformerBlock put dp 2 at 0.68-0.74 of the measured step)
    block = TransformerBlock(SHAPE.hidden, SHAPE.heads, SHAPE.ffn)
    block = ParallelTransformerBlock.from_full(block, tp_comm)
    x = torch.randn(b, SHAPE.seq, SHAPE.hidden, requires_grad=True)  # (b, s, h)
    block(x).sum().backward()  # the first call allocates: not timed
    return _cpu_median(lambda: block(x).sum().backward(), repeats)


def copy_bandwidth(nbytes: int = 1 << 26, repeats: int = 5) -> float:
    """A core's memory bandwidth (B/s): a copy of nbytes reads and writes each byte once."""
    a, b = torch.empty(nbytes // 4), torch.ones(nbytes // 4)
    with plan_cli._one_thread(torch):
        return 2 * nbytes / _cpu_median(lambda: a.copy_(b), repeats)


def planned_step(cluster, dp: int, pp: int, tp: int) -> dict:
    """plan.step's parts for the layout, with the compute rate of its microbatch shape."""
    x = plan.Layout(dp, pp, tp, b=BATCH // (dp * MICROBATCHES), scatter=False)
    rate = layer_flops_rate(x.b, tp, dp * pp * tp, cluster.gpu.memory_bw)
    gpu = replace(cluster.gpu, peak_flops=rate)
    return plan.step(SHAPE, x, replace(cluster, gpu=gpu), BATCH, plan_cli.MEASURED, 4, False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="per run; the first is left out")
    p.add_argument("--repeats", type=int, default=2, help="runs of each layout")
    p.add_argument("--backend", default="mpi")
    args = p.parse_args()
    if args.steps < 2 or args.repeats < 1:
        sys.exit(f"--steps={args.steps} must be at least 2, --repeats={args.repeats} at least 1")
    p2p = minidist("bench", "p2p", "-n", "2", f"--backend={args.backend}")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(json.dumps(p2p) + "\n")
    cluster = plan_cli.this_machine(f.name)
    cluster = replace(cluster, gpu=replace(cluster.gpu, memory_bw=copy_bandwidth()))
    link = cluster.intra
    print(f"this machine: a = {link.latency * 1e6:.1f} us, B = {link.bandwidth / 1e9:.2f} GB/s,")
    print(f"copy {cluster.gpu.memory_bw / 1e9:.1f} GB/s; load {os.getloadavg()[0]:.1f} on")
    print(f"{os.cpu_count()} cores; {args.repeats} runs of {args.steps} steps (first left out)")
    print(f"{'dp pp tp':>8} {'planned s':>9} {'cpu s':>11} {'ratio':>9} {'wall s':>11} {'load':>5}")
    for dp, pp, tp in LAYOUTS:
        parts = planned_step(cluster, dp, pp, tp)
        runs = [measured_step(dp, pp, tp, args.steps, args.backend) for _ in range(args.repeats)]
        planned, cpu, wall = sum(parts.values()), [r[0] for r in runs], [r[1] for r in runs]
        ratio = f"{planned / max(cpu):.2f}-{planned / min(cpu):.2f}"
        print(
            f"{dp:>2} {pp:>2} {tp:>2} {planned:9.3f} {min(cpu):5.3f}-{max(cpu):5.3f} {ratio:>9}"
            f" {min(wall):5.2f}-{max(wall):5.2f} {os.getloadavg()[0]:5.1f}"
        )
        print("         plan: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items() if v))


if __name__ == "__main__":
    main()
