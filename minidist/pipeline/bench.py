"""Benchmark: the measured pipeline bubble and activation memory beside the formulas.

    minidist bench pipeline -n 2 --backend mpi [--microbatches 1,2,4,8,16] [--json]
    minidist bench pipeline -n 4 --backend mpi      # on 2 cores: oversubscribed, noted

For each schedule (gpipe, 1f1b, interleaved with v = 2, zb) and each m, a stack of
Linear(width, width) + tanh layers, layers_per_stage * p of them, is split into p * v balanced
chunks (minidist.pipeline.partition) and trained for a few steps with a Tracer on every rank. Per
step: the compute spans of every stage (pipeline.measured_timeline) give

    bubble = 1 - busy / (p * makespan)      (schedules.bubble_fraction, idle / total)

printed beside the papers' formula (schedules.bubble_formula: (p-1)/(m+p-1) for GPipe and 1F1B,
(p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1, all assuming equal stages, t_b = 2 t_f for
ZB's t_F = t_B = t_W, and free communication) and beside the schedule simulated with the op
times measured in the same run (schedules.simulate with the mean t_f, t_b, t_w): the formula
is the ideal, the simulation says what the measured op times allow, and the difference between
that and the measurement is what the real run adds (messages, Python, a rank without a core).
One such cost: over MPI (no progress thread) an isend above the eager limit (4 KiB here) moves
only while its sender is inside an MPI call, so an activation sent just before a long op may
wait for that op to end; Gloo moves messages on threads of its own, which need a core too.
Peak activation bytes per stage are measured (pipeline.ActivationMemory) and predicted as
schedules.peak_activations(program) x the bytes of one microbatch. Medians over the timed
steps, one warm-up step first. A shared, noisy machine: quote ratios from one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

from minidist.bench import Bench, rank_main
from minidist.comm.wrappers import Tracer
from minidist.pipeline.partition import param_counts, partition, stage_chunks
from minidist.pipeline.schedules import (
    NAMES,
    bubble_formula,
    bubble_fraction,
    build_schedules,
    peak_activations,
    simulate,
)
from minidist.pipeline.stage import PipelineStage, measured_timeline, split_microbatches


def make_stage(comm, name: str, m: int, args: argparse.Namespace, tracer: Tracer):
    """This rank's PipelineStage over a balanced plan of the layer stack, and its program."""
    p, v = comm.world_size, 2 if name == "interleaved" else 1
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers_per_stage * p):
        linear = nn.Linear(args.width, args.width)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) / args.width**0.5)
        layers += [linear, nn.Tanh()]
    plan = partition(param_counts(layers), p, v)  # equal Linear layers: perfectly balanced
    chunks = stage_chunks(layers, plan, comm.rank, p)
    program = build_schedules(name, p, m, v)[comm.rank]
    return PipelineStage(chunks, comm, nn.functional.mse_loss, tracer), program


def timed_steps(comm, stage: PipelineStage, program, m: int, args) -> tuple[list, list, dict]:
    """Per timed step: the measured bubble and seconds; the durations of each kind of op."""
    g = torch.Generator().manual_seed(1)
    xs = split_microbatches(torch.randn(m * args.rows, args.width, generator=g), m)
    ys = split_microbatches(torch.randn(m * args.rows, args.width, generator=g), m)
    bubbles = []
    seconds = []
    costs = {"F": [], "B": [], "W": []}
    for step in range(args.steps + 1):  # step 0 warms up
        comm.barrier()  # all stages start together
        start = time.perf_counter()
        stage.run(program, xs, ys)
        took = time.perf_counter() - start
        rows = measured_timeline(stage)
        for chunk in stage.chunks:
            chunk.zero_grad()
        if step > 0:
            bubbles.append(bubble_fraction(rows))
            seconds.append(took)
            for _, a, b, label in rows:  # ZB's B counts as "B", its W apart
                costs[label[0]].append(b - a)
    return bubbles, seconds, {k: statistics.mean(c) if c else 0.0 for k, c in costs.items()}


def measure(comm, name: str, m: int, args: argparse.Namespace) -> dict:
    """One row: medians over args.steps traced steps of schedule `name` with m microbatches."""
    p = comm.world_size
    v = 2 if name == "interleaved" else 1
    split = name == "zb"
    stage, program = make_stage(comm, name, m, args, Tracer(comm.rank))
    bubbles, seconds, t = timed_steps(comm, stage, program, m, args)
    # simulated with eager sends, as pipeline/stage.py does
    programs = build_schedules(name, p, m, v)
    cost_b = t["B"] + t["W"] if split else t["B"]
    timeline = simulate(programs, t["F"], cost_b, t["W"] if split else None, rendezvous=False)
    peak = torch.tensor([stage.memory.peak, max(stage.memory.bytes_of.values())])
    every = comm.all_gather(torch.empty(p, 2, dtype=peak.dtype), peak)  # (p, 2)
    counts = [peak_activations(ops, until_weight=split) for ops in programs]
    return {
        "schedule": name,
        "m": m,
        "v": v,
        "step_ms": 1e3 * statistics.median(seconds),
        "t_f_ms": 1e3 * t["F"],
        "t_b_ms": 1e3 * t["B"],
        "t_w_ms": 1e3 * t["W"],
        "bubble": statistics.median(bubbles),
        "bubble_simulated": bubble_fraction(timeline),
        "bubble_formula": bubble_formula(name, p, m, v),
        "peak_bytes": every[:, 0].tolist(),
        "peak_bytes_predicted": [n * b for n, b in zip(counts, every[:, 1].tolist(), strict=True)],
    }


def format_rows(rows: list[dict]) -> str:
    """The table: times, the three bubbles and their ratio, peak KiB per stage."""
    head = f"{'schedule':>11} {'m':>3} {'v':>2} {'step ms':>8} {'t_f':>6} {'t_b':>6} {'t_w':>6}"
    head += f" {'bubble':>7} {'sim.':>6} {'formula':>7} {'meas/form':>9}  peak KiB per stage"
    lines = [head + ": measured (predicted)"]
    for r in rows:
        kib = " ".join(
            f"{a / 1024:.0f} ({b / 1024:.0f})"
            for a, b in zip(r["peak_bytes"], r["peak_bytes_predicted"], strict=True)
        )
        ratio = f"{r['bubble'] / r['bubble_formula']:9.2f}" if r["bubble_formula"] else f"{'-':>9}"
        lines.append(
            f"{r['schedule']:>11} {r['m']:>3} {r['v']:>2} {r['step_ms']:8.1f} {r['t_f_ms']:6.2f}"
            f" {r['t_b_ms']:6.2f} {r['t_w_ms']:6.2f} {r['bubble']:7.3f}"
            f" {r['bubble_simulated']:6.3f} {r['bubble_formula']:7.3f} {ratio}  {kib}"
        )
    return "\n".join(lines)


def flags(p: argparse.ArgumentParser) -> None:
    """The flags of `minidist bench pipeline` beyond -n and --backend."""
    p.add_argument("--microbatches", default="1,2,4,8,16", help="values of m, comma-separated")
    p.add_argument("--width", type=int, default=512, help="features of every Linear layer")
    p.add_argument("--rows", type=int, default=64, help="samples per microbatch")
    p.add_argument("--layers-per-stage", type=int, default=4, help="Linear + tanh pairs")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")


def problems(args: argparse.Namespace) -> list[str]:
    """Why these flags cannot run, one line each (the CLI prints them before starting ranks;
    every number is already in its range)."""
    words = args.microbatches.split(",")
    if all(w.strip().isdigit() and int(w) >= 1 for w in words):
        return []
    return [f"--microbatches {args.microbatches}: counts of at least 1, comma-separated (1,2,4)"]


def run(comm, args: argparse.Namespace) -> dict:
    """Every schedule and m: the rows, and what they ran on, as --json prints them."""
    p, cores = comm.world_size, os.cpu_count() or 1
    ms = [int(m) for m in args.microbatches.split(",")]
    rows = [
        measure(comm, name, m, args)
        for name in NAMES
        for m in ms
        if not (name == "interleaved" and m % p)  # interleaved needs m a multiple of p
    ]
    info = dict(bench="pipeline", backend=comm.backend, world_size=p, cores=cores)
    info.update(width=args.width, rows_per_microbatch=args.rows, steps=args.steps)
    return dict(info, dtype="float32", rows=rows)


def report(result: dict, args: argparse.Namespace) -> str:
    p, cores = result["world_size"], result["cores"]
    layers = f"{args.layers_per_stage * p} x (Linear {args.width} + tanh)"
    lines = [
        f"# minidist bench pipeline: {result['backend']}, {p} stages on {cores} cores, float32, "
        f"{layers}",
        f"# {args.rows} rows per microbatch, medians of {args.steps} steps, times in ms; "
        "interleaved runs only m a multiple of p",
    ]
    if p > cores:
        lines.append(
            f"# OVERSUBSCRIBED: {p} ranks share {cores} cores; waits for a core inflate bubbles"
        )
    return "\n".join([*lines, format_rows(result["rows"])])


PIPELINE = Bench(
    "pipeline",
    "measured pipeline bubble and activation memory",
    __name__,
    flags,
    run,
    report,
    problems,
    ranks_help="number of ranks = pipeline stages",
)

if __name__ == "__main__":
    rank_main(sys.argv[1:], PIPELINE)
