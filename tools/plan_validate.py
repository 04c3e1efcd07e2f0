"""The planner's step time against `minidist train` measured on this machine (target: within 25%).

    PYTHONPATH=$PWD python tools/plan_validate.py [--steps 4] [--repeats 2] [--backend mpi]

For each layout, runs `minidist plan --cluster this` (cluster/calibrate.py: the link fitted to
`minidist bench p2p --json`, a core's copy bandwidth, its FLOP/s on the job's own block at the
layout's microbatch shape and tp; none of it a training step) on that one layout, then
`minidist train --json` (one rank per core), and prints the plan's seconds per step beside the
measured median over the steps after the first (the first is warm-up), in rank 0's CPU time
and wall clock. On a loaded machine the wall clock stretches with the other jobs (about load /
cores): the CPU time is what this job's rank spent, and a quiet machine's wall clock is close
to it. A benchmark, not a test: the ratios depend on this machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MODEL = {"seq-len": 128, "d-model": 256, "n-heads": 4, "d-ff": 1024, "n-layers": 4}
SHAPE = {"seq-len": 128, "hidden": 256, "heads": 4, "ffn": 1024, "layers": 4}  # MODEL, to plan
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


def planned_step(calibration: str, dp: int, pp: int, tp: int) -> dict:
    """`minidist plan --cluster this`'s row for the layout train runs (b = batch / (dp m),
    one chunk, no ZeRO, no recompute)."""
    b = BATCH // (dp * MICROBATCHES)
    only = [f"--dp={dp}", f"--pp={pp}", f"--tp={tp}", f"--microbatch-size={b}", "--chunks=1"]
    only += ["--zero=0", "--recompute=none", f"--gpus={dp * pp * tp}", f"--batch={BATCH}"]
    shape = [f"--{k}={v}" for k, v in SHAPE.items()]
    cluster = ["--cluster=this", f"--calibration={calibration}"]
    (row,) = minidist("plan", *cluster, *shape, *only)["layouts"]
    return row


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
    print(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.repeats} runs of")
    print(f"{args.steps} steps each (the first left out); the plan: minidist plan --cluster this")
    print(f"{'dp pp tp':>8} {'planned s':>9} {'cpu s':>11} {'ratio':>9} {'wall s':>11} {'load':>5}")
    for dp, pp, tp in LAYOUTS:
        row = planned_step(f.name, dp, pp, tp)
        runs = [measured_step(dp, pp, tp, args.steps, args.backend) for _ in range(args.repeats)]
        planned = row["seconds"]
        cpu = [r[0] for r in runs]
        wall = [r[1] for r in runs]
        parts = row["parts"]
        ratio = f"{planned / max(cpu):.2f}-{planned / min(cpu):.2f}"
        print(
            f"{dp:>2} {pp:>2} {tp:>2} {planned:9.3f} {min(cpu):5.3f}-{max(cpu):5.3f} {ratio:>9}"
            f" {min(wall):5.2f}-{max(wall):5.2f} {os.getloadavg()[0]:5.1f}"
        )
        print("         plan: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items() if v))


if __name__ == "__main__":
    main()
