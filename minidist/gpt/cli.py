"""`minidist train`: the main job from the command line, with what a person wants to see.

    minidist train --dp 2 --pp 2 --tp 2 --microbatches 4 --backend mpi --check
    mpiexec -n 8 python -m minidist.gpt.cli --dp 2 --pp 2 --tp 2      # the same, by hand
    torchrun --nproc-per-node 8 -m minidist.gpt.cli --dp 2 --pp 2 --tp 2

The parent (`minidist train`) checks the layout and the model's shape before any process
starts, then starts dp*pp*cp*tp ranks of this module (--ep shares out --experts over dp);
every rank trains (train.py); rank 0 shows a progress bar (loss, tokens/s; where the parent's
stderr is a terminal or MINIDIST_PROGRESS=1: a log gets no line of carriage returns), at the end
prints: per-rank memory, bytes sent per dimension (dp/pp/tp, and cp/ep when used: payload per
step from a Counter on each sub-comm, beside the formula of train.predicted_nbytes), the
measured pipeline bubble (the last step's compute spans) beside the formula, throughput; and
writes into --out: loss.png, pipeline.png, trace.json (open in ui.perfetto.dev). --check then
trains the same run in one process (in rank 0's) and reports the largest relative difference
of the loss curve and of the final parameters.
--json prints one object instead of the tables (and no bar), with rank 0's wall-clock and CPU
seconds of each step (step_seconds, step_cpu_seconds; the first includes the warm-up).
Checkpoints (resume.py): --save DIR writes DIR/step-NNNNNNN.pt at the end (and every
--save-every steps; at --stop-at STEP, which ends the run early, as before a time limit);
--resume PATH (a file, or a folder: its newest) continues from one, in any layout of the same
model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import fields

import torch

from minidist.comm.wrappers import Counter, ObservedComm, Tracer
from minidist.gpt import plots, report, resume, sample
from minidist.gpt.config import DTYPES, TrainConfig
from minidist.gpt.gather import parameters_full
from minidist.gpt.loop import run, train_step
from minidist.gpt.model import GPTConfig
from minidist.gpt.reference import differences, train_full
from minidist.gpt.report import AXES
from minidist.gpt.train import Job, build_job
from minidist.launch.init import BACKENDS, init
from minidist.launch.launcher import start_ranks
from minidist.mixed_precision.amp import PRECISIONS
from minidist.pipeline.schedules import NAMES

SIZES = {
    "dp": "data parallel replicas",
    "pp": "pipeline stages",
    "tp": "tensor parallel ranks (heads, d_ff, vocabulary cut)",
    "cp": "context parallel ranks: each holds 2 zigzag chunks of every sequence, ring attention",
    "ep": "expert parallel ranks, carved out of dp (at each cp rank): each holds experts/ep"
    " (needs --experts; composes with --cp and --pp)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags, shared by the parent and every rank (they parse the same argv)."""
    d = TrainConfig()
    for axis, what in SIZES.items():
        p.add_argument(f"--{axis}", type=int, default=1, help=what)
    p.add_argument("--zero", type=int, default=0, choices=range(4), help="0: data parallel")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", choices=NAMES, default=d.schedule)
    p.add_argument("--chunks", type=int, default=1, help="chunks per stage (interleaved)")
    p.add_argument("--amp", choices=tuple(PRECISIONS), default="fp32")
    p.add_argument("--checkpointing", action="store_true", help="recompute block activations")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16, help="sequences per step, all dp ranks")
    p.add_argument("--lr", type=float, default=d.lr)
    wd_help = "AdamW's, on weight matrices only (not biases, norms, embeddings)"
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help=wd_help)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--dtype", choices=tuple(DTYPES), default=d.dtype)
    p.add_argument("--seed", type=int, default=0)
    m = GPTConfig()
    for name in ("seq_len", "d_model", "n_heads", "d_ff", "n_layers"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(m, name))
    p.add_argument("--experts", type=int, default=0, help="E > 0: every MLP a mixture of E")
    p.add_argument("--topk", type=int, default=m.topk, help="experts per token (1 or 2)")
    cf_help = "an expert takes at most ceil(cf topk n / E) of a group's n tokens"
    p.add_argument("--capacity-factor", type=float, default=m.capacity_factor, help=cf_help)
    p.add_argument("--check", action="store_true", help="compare with one process at the end")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--sample", type=int, default=120, help="bytes of text the trained model writes at the end"
    )
    p.add_argument("--out", default="out/train", help="folder for pictures and the trace")
    p.add_argument("--save", metavar="DIR", help="write checkpoints DIR/step-NNNNNNN.pt")
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints")
    p.add_argument("--resume", metavar="PATH", help="a checkpoint, or a folder: its newest")
    p.add_argument(
        "--stop-at",
        type=int,
        default=0,
        metavar="STEP",
        help="stop after this step (saving, with --save), e.g. before a time limit",
    )


def config_from(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in fields(GPTConfig)}
    model = GPTConfig(**{k: v for k, v in vars(args).items() if k in names})
    names = {f.name for f in fields(TrainConfig)} - {"model"}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names}, model=model)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="the main job: a small GPT with dp x pp x tp (+ZeRO)")
    p.add_argument("--backend", choices=BACKENDS, default="mpi")
    add_arguments(p)
    p.set_defaults(func=main)


def to_argv(args: argparse.Namespace) -> list[str]:
    """The flags again, for the ranks: every value explicit."""
    argv = []
    for key, value in vars(args).items():
        if key in ("backend", "func", "command") or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv.append(f"{flag}={value}")
    return argv


def problems(args: argparse.Namespace, found: list[str]) -> list[str]:
    """Every reason this run cannot start, before any rank does: found (the flags' ranges,
    checked by cli.py), then the layout and the model's shape, flags that do not go together,
    the folders, and the checkpoint to resume (read here once, naming the file)."""
    found = list(found)
    config = None if found else config_from(args)  # out-of-range numbers: nothing to build
    found += config.problems() if config is not None else []
    if args.stop_at > args.steps:
        found.append(f"--stop-at {args.stop_at} is beyond --steps {args.steps}")
    if args.check and args.stop_at:
        found.append("--check compares whole runs: it cannot be used with --stop-at")
    for flag, path in (("--out", args.out), ("--save", args.save)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            found.append(f"{flag} {path}: a file, not a folder")
    for flag in ("--save", "--resume"):
        if getattr(args, flag[2:]) and (args.cp > 1 or args.experts):
            found.append(
                f"{flag} is not supported with --cp or --experts (checkpoints hold"
                " dp x pp x tp runs of the dense model)"
            )
    if args.resume and not found:
        found += [f"--resume {why}" for why in resume.problems(args.resume, config)]
    return found


def main(args: argparse.Namespace) -> int:
    """The parent (its flags checked by problems() first): start the ranks."""
    config = config_from(args)
    argv = to_argv(args)
    n = config.layout.world_size
    linger = math.inf if args.check else None  # --check: rank 0 trains alone after the rest
    os.environ.setdefault("MINIDIST_PROGRESS", str(int(sys.stderr.isatty())))  # for the ranks
    env = {"OMP_NUM_THREADS": "1"}  # processes: one core per rank, ranks share this machine
    return start_ranks(__name__, argv, n, args.backend, "minidist train", env=env, linger=linger)


def rank_main(argv: list[str]) -> None:
    """One rank: train (loop.run), then (rank 0) report."""
    parser = argparse.ArgumentParser(prog="python -m minidist.gpt.cli")
    add_arguments(parser)
    args = parser.parse_args(argv)
    config = config_from(args)
    comm = init()
    config.check(comm.world_size)
    torch.set_num_threads(1)
    counters = {axis: Counter() for axis in AXES}
    tracer = Tracer(comm.rank)

    def observe(axis: str, sub):  # count each dimension's bytes; trace every operation
        return ObservedComm(ObservedComm(sub, counters[axis]), tracer)

    job = build_job(comm, config, tracer=tracer, observe=observe)
    if args.resume:  # any layout loads any checkpoint of this model: each rank cuts its slices
        path, payload = resume.load_any(args.resume)
        resume.restore(job, payload)
    for counter in counters.values():
        counter.reset()  # count the steps, not the set-up
    bar = _progress(config, comm.rank == 0 and not args.json, job.step)
    first, start = job.step, time.perf_counter()

    def after_step(job: Job, loss: float, stepped: bool) -> None:
        if stepped and not math.isfinite(loss):  # the same loss on every rank: all stop here
            raise FloatingPointError(
                f"step {job.step}: the loss is {loss}: training diverged "
                f"(lower --lr={config.lr:g}?)"
            )
        last = job.step in (config.steps, args.stop_at)
        if args.save and (last or (args.save_every and job.step % args.save_every == 0)):
            resume.save(job, resume.step_path(args.save, job.step))
        if bar is not None:
            tokens = (job.step - first) * config.batch * config.model.seq_len
            rate = tokens / (time.perf_counter() - start)
            bar.set_postfix_str(f"loss {loss:.4f}  {rate:,.0f} tokens/s")
            bar.update()

    result = run(job, train_step, args.stop_at or config.steps, after_step)
    if bar is not None:
        bar.close()
    tracer.rank = comm.rank  # the sub-comms renamed it
    gathered = report.gather(job, counters, tracer, len(result["losses"]))  # before what sends
    result["parameters"] = parameters_full(job)
    bad = [i for i, t in enumerate(result["parameters"] or []) if not torch.isfinite(t).all()]
    if bad:  # rank 0, after the last collective: a run ending with NaN or inf parameters failed
        raise FloatingPointError(f"after step {job.step}: non-finite parameters in layers {bad}")
    if comm.rank == 0:
        _finish(args, config, result, gathered)


def _finish(args, config: TrainConfig, result: dict, gathered: dict) -> None:
    """Rank 0: the check, the pictures and trace, the tables (or one JSON object)."""
    os.makedirs(args.out, exist_ok=True)
    summary = report.summary(config, result, gathered, args.out)
    reference = train_full(config) if args.check else None
    if reference is not None:
        summary["check"] = differences(result, reference, config)
        summary["check"]["seconds_one_process"] = reference["seconds"]
    plots.draw(summary["files"], config, result, reference, gathered)
    if args.sample:  # as nanoGPT's sample.py: what the model learned, in its own words
        net = sample.load_flat(config.model, result["parameters"])
        summary["sample"] = sample.text(config.model, net, sample.PROMPT, args.sample, seed=0)
    print(json.dumps(summary) if args.json else report.tables(summary))
    if reference is not None and not summary["check"]["ok"]:
        sys.exit(1)  # --check failed: the job fails


def _progress(config: TrainConfig, show: bool, first: int):
    if not show or os.environ.get("MINIDIST_PROGRESS") == "0":  # by hand (mpiexec): shown
        return None
    from tqdm import tqdm

    return tqdm(total=config.steps, initial=first, desc="train", unit="step", file=sys.stderr)


if __name__ == "__main__":
    rank_main(sys.argv[1:])
