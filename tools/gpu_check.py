"""The GPU check: one short run, on a machine with a GPU, that prints one summary.

    make gpu-check                      # or: .venv/bin/python tools/gpu_check.py

1. the gpu-marked tests (tests/test_gpu.py: CUDA tensors on threads and mpi, and nccl);
2. `minidist bench allreduce --backend nccl` over every GPU (one rank per GPU): busbw at the
   largest size beside the NVLink figure of the matching preset in minidist/cluster/hardware.py;
3. a ParallelTransformerBlock (tp = 2 ranks as threads on cuda:0) in bf16, forward and
   backward timed: achieved TFLOP/s beside the GPU's dense bf16 peak from cluster/hardware.py's
   presets, matched by torch.cuda.get_device_name();
4. the main job on nccl with --check (dp = the number of GPUs).
Each step has its own time limit (150 + 90 + 90 + 120 s): under 8 minutes in all. Without
CUDA it prints one line, "no GPU: skipped", and exits 0. The exit code is 1 if a step failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINIDIST = [sys.executable, "-m", "minidist.cli"]


def gpu_preset():
    """The first cluster preset whose GPU model (A100, H100, H200) is in the device's name."""
    from minidist.cluster.hardware import PRESETS

    name = torch.cuda.get_device_name()
    for cluster in PRESETS.values():
        if cluster.gpu.name.split("-")[0] in name:
            return cluster
    return None


def run(argv: list[str], limit: float) -> tuple[bool, str, float]:
    """(passed, stdout, seconds) of a command run from the repository root, within limit s."""
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=ROOT)
    try:
        done = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit
        )
    except subprocess.TimeoutExpired:
        return False, f"timed out after {limit:.0f} s", time.perf_counter() - start
    out = done.stdout if done.returncode == 0 else done.stdout[-2000:] + done.stderr[-2000:]
    return done.returncode == 0, out, time.perf_counter() - start


def gpu_tests() -> tuple[bool, str]:
    ok, out, s = run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/"], 150)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    return ok, f"gpu tests: {last} ({s:.0f} s)"


def nccl_allreduce(cluster) -> tuple[bool, str]:
    n = torch.cuda.device_count()
    if n < 2:
        return True, "nccl all-reduce: skipped, one GPU (NCCL needs one GPU per rank)"
    argv = [*MINIDIST, "bench", "allreduce", "-n", str(n), "--backend", "nccl"]
    ok, out, s = run([*argv, "--min-bytes", "1M", "--max-bytes", "256M", "--json"], 90)
    if not ok:
        return False, f"nccl all-reduce: failed ({s:.0f} s)\n{out}"
    (line,) = [line for line in out.splitlines() if line.startswith('{"bench"')]
    row = json.loads(line)["rows"][-1]
    raw, best = row["raw"]["busbw"], row[row["best"]]["busbw"]
    link = f"{cluster.intra.name} {cluster.intra.bandwidth / 1e9:.0f} GB/s" if cluster else "?"
    text = f"nccl all-reduce {row['nbytes'] >> 20} MiB, {n} GPUs: busbw {raw:.1f} GB/s raw NCCL"
    return True, f"{text}, {best:.1f} GB/s {row['best']}; {link} per direction (preset)"


def block_flops(b: int, t: int, d: int) -> float:
    """FLOPs of one transformer block forward and backward (d_ff = 4d): the linears 24 b t d^2
    and the attention scores and mix 4 b t^2 d (computed in full, causal or not), forward; the
    backward twice the forward."""
    return 3 * (24 * b * t * d * d + 4 * b * t * t * d)


def tp_block(comm, b: int, t: int, d: int, steps: int) -> float:
    """Seconds per forward + backward of a bf16 ParallelTransformerBlock, median of steps."""
    from minidist.tensor_parallel.blocks import ParallelTransformerBlock

    cuda = torch.device("cuda", 0)
    block = ParallelTransformerBlock(d, d // 128, 4 * d, comm, dtype=torch.bfloat16, device=cuda)
    x = torch.randn(b, t, d, dtype=torch.bfloat16, device=cuda)
    times = []
    for _ in range(steps + 2):  # two warm-up steps
        comm.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        block(x).float().square().mean().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[2:])[steps // 2]


def tp_tflops(cluster) -> tuple[bool, str]:
    from minidist.testing import run_threads

    b = 4
    t = 1024
    d = 4096
    seconds = max(run_threads(tp_block, 2, b, t, d, 10, timeout=90))
    achieved = block_flops(b, t, d) / seconds / 1e12
    peak = "no preset matches this GPU"
    if cluster:
        peak = f"{cluster.gpu.peak_flops / 1e12:.0f} TFLOP/s dense bf16 peak ({cluster.gpu.name})"
    text = f"tp block bf16 (tp=2 on one GPU, B={b} T={t} D={d}): {achieved:.0f} TFLOP/s"
    return True, f"{text}, {seconds * 1e3:.1f} ms/step; {peak}"


def train_check() -> tuple[bool, str]:
    n = str(torch.cuda.device_count())
    argv = [*MINIDIST, "train", "--dp", n, "--backend", "nccl", "--steps", "20", "--check"]
    ok, out, s = run(argv, 120)
    lines = [line for line in out.splitlines() if "check against one process" in line]
    return ok, f"train --check on nccl, dp={n}: {lines[0] if lines else out[-500:]} ({s:.0f} s)"


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU: skipped")
        return 0
    cluster = gpu_preset()
    steps = (gpu_tests, lambda: nccl_allreduce(cluster), lambda: tp_tflops(cluster), train_check)
    results = []
    for step in steps:
        try:
            results.append(step())
        except Exception as e:  # one failing step still leaves the others' lines
            results.append((False, f"{step}: {type(e).__name__}: {e}"))
    print(f"# GPU check: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
    for ok, line in results:
        print(("PASS " if ok else "FAIL ") + line)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
