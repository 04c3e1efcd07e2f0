"""The main job's training loop, the one that `minidist train`, its one-process check
(reference.train_full), the lesson's demo and the tests share; and one step of the composed job.

Equals: train_step on any layout equals reference.step_full on one process (train.py proves it:
float64 1e-12 relative), so one loop runs both.
Communication per step: train_step's (train.py's docstring counts it); run adds none.
Lesson: lessons/12_3d_parallel/.   Run: minidist train --dp 2 --pp 2 --tp 2 --check
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from minidist.gpt import context
from minidist.gpt.data import batch_at, dp_share
from minidist.mesh import Mesh
from minidist.pipeline.stage import split_microbatches


def run(job, step: Callable, until: int, on_step: Callable | None = None) -> dict:
    """step(job) -> (loss, stepped) until job.step reaches until, on_step(job, loss, stepped)
    after each: {"losses", "skipped" (the steps skipped for inf/nan), "seconds",
    "first_step", "step_seconds", "step_cpu_seconds" (this process's wall-clock and CPU time of
    each step; the first includes the warm-up)}. job: anything with a step counter that step
    advances (a train.Job, a reference.FullJob)."""
    first = job.step
    losses = []
    skipped = []
    walls = []
    cpus = []
    while job.step < until:
        start, cpu = time.perf_counter(), time.process_time()
        loss, stepped = step(job)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
        losses.append(loss)
        if not stepped:
            skipped.append(job.step - 1)
        if on_step is not None:
            on_step(job, loss, stepped)
    return {
        "losses": losses,
        "skipped": skipped,
        "seconds": sum(walls),
        "first_step": first,
        "step_seconds": walls,
        "step_cpu_seconds": cpus,
    }


def train_step(job) -> tuple[float, bool]:
    """One step of every rank of a train.Job: (the full batch's mean loss, on every rank;
    stepped). The batch, this replica's share (and cp rank's tokens), the pipeline's program
    inside replicas.accumulating(), then the replicas' step and the learning-rate schedule's."""
    c, (d, s, _) = job.config, job.mesh.coords
    ids, targets = batch_at(job.data, job.step, c.batch, c.model.seq_len, c.seed)  # (B, T)
    ids, targets = dp_share(ids, d, c.dp), dp_share(targets, d, c.dp)  # (B/dp, T)
    if job.mesh.cp_comm is not None:  # this rank's zigzag chunks: (B/dp, T/cp)
        ids, targets = (context.shard_tokens(t, job.mesh.cp_comm) for t in (ids, targets))
    ids, targets = ids.to(job.device), targets.to(job.device)
    first, last = s == 0, s == c.pp - 1
    with job.replicas.accumulating():
        losses = job.stage.run(
            job.program,
            split_microbatches(ids, c.microbatches) if first else None,
            split_microbatches(targets, c.microbatches) if last else None,
        )
    scale = job.replicas.scale  # the scale this step's losses carry (step() may change it)
    stepped = job.replicas.step()
    job.schedule.step()
    job.step += 1
    return batch_loss_full(losses, job.mesh, scale, job.device), stepped


def batch_loss_full(losses: list, mesh: Mesh, scale: float, device=None) -> float:
    """The mean over the full batch, on every rank: the last stage's mean over microbatches,
    averaged over dp (x cp: each cp rank's mean is over its T/cp tokens), then broadcast along
    the pipeline. Collectives: dp (x cp) all_reduce, pp broadcast (one float64 each)."""
    mean = torch.zeros(1, dtype=torch.float64, device=device)
    if losses:  # the last stage
        mean += torch.stack(losses).double().mean() / scale
    mesh.grad_comm.all_reduce(mean, "sum")
    mesh.pp_comm.broadcast(mean, mesh.layout.pp - 1)
    return mean.item() / (mesh.layout.dp * mesh.layout.cp)
