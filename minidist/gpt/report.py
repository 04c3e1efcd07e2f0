"""The end of `minidist train`: every rank's numbers gathered (memory, bytes handed to each
sub-comm beside train.predicted_nbytes, the pipeline's measured timeline, the trace events),
the summary rank 0 prints as one JSON object, and the same as tables for a person.
Communication: one all_gather over the world (every rank's row), the pipeline's timeline over
pp, each rank's trace events sent to rank 0.
Lesson: lessons/12_3d_parallel/.   Run: minidist train --dp 2 --pp 2 --tp 2
"""

from __future__ import annotations

import json
import os
import resource
from dataclasses import asdict

import torch

from minidist.comm.wrappers import Tracer
from minidist.gpt.config import TrainConfig
from minidist.gpt.train import Job, predicted_nbytes
from minidist.pipeline.schedules import bubble_formula, bubble_fraction
from minidist.pipeline.stage import measured_timeline

AXES = ("dp", "pp", "tp", "cp", "ep")
FILES = {"loss": "loss.png", "pipeline": "pipeline.png", "trace": "trace.json"}

COLUMNS = ("params", "optimizer", "activations", "rss", *AXES, *(f"{a}_f" for a in AXES))


def gather(job: Job, counters: dict, tracer: Tracer, steps: int) -> dict:
    """Every rank's numbers on every rank (one all_gather over the world), the measured
    timeline of replica 0's pipeline (collective over pp), the trace events (to rank 0)."""
    world = job.mesh.world
    sent = [sum(n for op, n in counters[a].nbytes.items() if op != "recv") / steps for a in AXES]
    predicted = predicted_nbytes(job)
    formula = [-1 if predicted.get(a) is None else predicted[a] for a in AXES]
    held = job.replicas.held_nbytes()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts KiB
    mine = [held["params"], held["optimizer"], job.stage.memory.peak, rss, *sent, *formula]
    every = torch.empty(world.world_size, len(mine), dtype=torch.float64, device=job.device)
    world.all_gather(every, torch.tensor(mine, dtype=torch.float64, device=job.device))
    every = every.cpu()
    rows = measured_timeline(job.stage)  # the last step's compute spans of this pipeline
    per_rank = [dict(zip(COLUMNS, r, strict=True)) for r in every.tolist()]
    events = _gather_events(world, tracer.events, job.device)
    return {"per_rank": per_rank, "timeline": rows, "events": events}


def _gather_events(world, events: list[dict], device) -> dict[int, list[dict]] | None:
    """Every rank's trace events on rank 0 (None elsewhere): lengths, then JSON bytes."""
    mine = torch.frombuffer(bytearray(json.dumps(events).encode()), dtype=torch.uint8)
    mine = mine.to(device)  # NCCL moves device memory only
    lengths = torch.empty(world.world_size, dtype=torch.int64, device=device)
    world.all_gather(lengths, torch.tensor([len(mine)], device=device))
    if world.rank != 0:
        world.send(mine, 0)
        return None
    found = {0: events}
    for r in range(1, world.world_size):
        buf = world.recv(torch.empty(int(lengths[r]), dtype=torch.uint8, device=device), r)
        found[r] = json.loads(bytes(buf.cpu().tolist()).decode())
    return found


def summary(config: TrainConfig, result: dict, report: dict, out: str) -> dict:
    """Rank 0's account of the run (what --json prints): the losses and times of result
    (loop.run's), throughput, the bubble measured beside its formula, every rank's row, and
    the files written into the folder out."""
    tokens = len(result["losses"]) * config.batch * config.model.seq_len
    p = config.pp
    m = config.microbatches
    v = config.chunks
    return {
        "config": asdict(config),
        "losses": result["losses"],
        "first_step": result["first_step"],
        "skipped": result["skipped"],
        "seconds": result["seconds"],
        "step_seconds": result["step_seconds"],  # rank 0's, each step: wall clock
        "step_cpu_seconds": result["step_cpu_seconds"],  # and this process's CPU time
        "tokens_per_second": tokens / result["seconds"],
        "bubble": bubble_fraction(report["timeline"]) if p > 1 else 0.0,
        "bubble_formula": bubble_formula(config.schedule, p, m, v),
        "per_rank": report["per_rank"],
        "files": {k: os.path.join(out, f) for k, f in FILES.items()},
    }


def tables(s: dict) -> str:
    """The end-of-run report as text."""
    c = s["config"]
    first, n = s["first_step"], len(s["losses"])
    lines = [
        f"loss {s['losses'][0]:.4f} -> {s['losses'][-1]:.4f} in steps {first + 1}.."
        f"{first + n} of {c['steps']}, "
        f"{s['seconds']:.1f} s, {s['tokens_per_second']:,.0f} tokens/s"
    ]
    if s["skipped"]:
        lines.append(f"skipped steps (inf/nan): {s['skipped']}")
    axes = [a for a in AXES if a in ("dp", "pp", "tp") or c[a] > 1]  # cp, ep: when used
    lines += [
        "",
        "per rank: MiB held; KiB handed to each comm per step (the collectives' inputs "
        "and the sends), formula beside; '-': a dimension of size 1 sends nothing",
        f"{'rank':>4} {'d,s,t' if c['cp'] == 1 else 'd,s,c,t':>6} {'params':>8} {'optim':>8}"
        f" {'activ.':>8} {'rss':>8}" + "".join(f" {a:>10} {a + ' f.':>10}" for a in axes),
    ]
    layout = TrainConfig(**{a: c[a] for a in AXES}).layout
    for rank, r in enumerate(s["per_rank"]):
        d, st, t = layout.coords(rank)
        where = f"{d},{st},{t}" if c["cp"] == 1 else f"{d},{st},{layout.cp_coord(rank)},{t}"
        lines.append(
            f"{rank:>4} {where:>6} {_mib(r['params'])} {_mib(r['optimizer'])} "
            f"{_mib(r['activations'])} {_mib(r['rss'])}"
            + "".join(
                f" {_kib(r[a])} {_kib(r[a + '_f'])}" if c[a] > 1 else f" {'-':>10} {'-':>10}"
                for a in axes
            )
        )
    lines += [
        "",
        f"pipeline bubble (last step, replica 0): {s['bubble']:.3f} measured, "
        f"{s['bubble_formula']:.3f} formula ({c['schedule']}, pp={c['pp']}, "
        f"m={c['microbatches']})",
    ]
    if "check" in s:
        k, tol = s["check"], s["check"]["tolerance"]
        verdict = "passed" if k["ok"] else "FAILED"
        limits = f"loss {tol['loss']:g}" + (
            f", parameters {tol['parameters']:g}" if tol["parameters"] else ""
        )
        lines.append(
            f"check against one process ({k['seconds_one_process']:.1f} s) {verdict}:"
            f" largest relative difference: loss curve {k['loss']:.2e}, final "
            f"parameters {k['parameters']:.2e} (accepted: {limits}); same skipped "
            f"steps: {k['same_skipped_steps']}"
        )
        if tol.get("parameters_rms"):  # bf16, fp16: every layer's RMS difference is judged
            rms, accepted = k["parameters_rms"], tol["parameters_rms"]
            i = max(range(len(rms)), key=lambda j: rms[j] / accepted[j])
            lines.append(
                f"  {c['amp']}: the parameters are judged layer by layer by their relative RMS "
                f"difference (a largest one is 2 lr a step wherever AdamW's step flips); the "
                f"closest to its limit, layer {i}: {rms[i]:.2e}, accepted {accepted[i]:.2e} "
                f"(u = 2^{-8 if c['amp'] == 'bf16' else -11}, {c['steps']} steps: lesson 09)"
            )
    lines.append("wrote " + ", ".join(s["files"].values()))
    if s.get("sample"):
        lines += ["", "the trained model writes (minidist sample --resume CKPT for more):"]
        lines += ["  " + line for line in s["sample"].splitlines()]
    return "\n".join(lines)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:8.2f}"


def _kib(nbytes: float) -> str:
    """KiB in 10 columns; '-' for a negative count (no formula)."""
    return f"{nbytes / 1024:10.1f}" if nbytes >= 0 else f"{'-':>10}"
