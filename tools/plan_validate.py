"""The planner's step time against `minidist train` measured on this machine (target: within 25%).

    PYTHONPATH=$PWD python tools/plan_validate.py [--steps 10] [--backend mpi]

Calibrates this machine as `minidist plan --cluster this` does (alpha and B fitted to
`minidist bench p2p --json`, a core's float32 matmul rate measured now), then for each layout
runs `minidist train --json` (one rank per core) and prints the plan's seconds per step
(plan.step, e=4: float32; efficiencies 1, no overlap) beside the measured ones and their ratio.
A benchmark, not a test: the ratio depends on this machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from minidist import plan, plan_cli

MODEL = {"seq-len": 128, "d-model": 256, "n-heads": 4, "d-ff": 1024, "n-layers": 4}
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]  # dp, pp, tp: two ranks, one a core
BATCH, MICROBATCHES = 16, 4


def minidist(*args: str) -> dict:
    """`minidist args --json`'s object (its first line: mpiexec may print more)."""
    command = [sys.executable, "-m", "minidist.cli", *args, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(done.stdout.splitlines()[0])


def measured_step(dp: int, pp: int, tp: int, steps: int, backend: str) -> float:
    """Seconds per step of `minidist train`: the mean over its steps (its --json gives the
    sum; the first step, warm-up included, is one of them)."""
    flags = [f"--{k}={v}" for k, v in MODEL.items()]
    layout = [f"--dp={dp}", f"--pp={pp}", f"--tp={tp}", f"--microbatches={MICROBATCHES}"]
    run = [f"--batch={BATCH}", f"--steps={steps}", "--warmup=0", f"--backend={backend}"]
    summary = minidist("train", *layout, *flags, *run, "--out", tempfile.mkdtemp())
    return summary["seconds"] / len(summary["losses"])


def planned_step(cluster, dp: int, pp: int, tp: int) -> dict:
    m = MODEL
    shape = plan.Shape(
        "toy", m["n-layers"], m["d-model"], m["n-heads"], m["d-ff"], 256, m["seq-len"]
    )
    x = plan.Layout(dp, pp, tp, b=BATCH // (dp * MICROBATCHES), scatter=False)
    return plan.step(shape, x, cluster, BATCH, plan_cli.MEASURED, e=4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--backend", default="mpi")
    args = p.parse_args()
    p2p = minidist("bench", "p2p", "-n", "2", f"--backend={args.backend}")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(json.dumps(p2p) + "\n")
    cluster = plan_cli.this_machine(f.name)
    link, core = cluster.intra, cluster.gpu.peak_flops
    print(f"this machine: a = {link.latency * 1e6:.1f} us, B = {link.bandwidth / 1e9:.2f} GB/s,")
    print(f"a core's matmul {core / 1e9:.1f} GFLOP/s; the mean of {args.steps} steps")
    print(f"{'dp pp tp':>8} {'planned s':>10} {'measured s':>11} {'ratio':>6}  plan's parts")
    for dp, pp, tp in LAYOUTS:
        parts = planned_step(cluster, dp, pp, tp)
        measured = measured_step(dp, pp, tp, args.steps, args.backend)
        planned = sum(parts.values())
        detail = " ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items() if v)
        print(
            f"{dp:>2} {pp:>2} {tp:>2} {planned:10.4f} {measured:11.4f} {planned / measured:6.2f}"
            f"  {detail} (ms)"
        )


if __name__ == "__main__":
    main()
