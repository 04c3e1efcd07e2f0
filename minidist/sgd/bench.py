"""Synchronous vs asynchronous SGD under stragglers: time and gradients to a target loss.

    minidist bench sgd -n 4 --backend mpi [--steps 80 --compute 0.01 --delay 0.03] [--json]

Rank 0 serves (parameter-server variants) or sits out (sync, local), so the same W = n - 1
workers compute in every row. Each worker takes --steps gradients of a least-squares problem
(minidist.sgd.variants.least_squares); a gradient "costs" --compute seconds, slept, so the rates
come from the schedule and not from a crowded CPU. Scenarios:

    none     every worker alike
    fixed    the last worker sleeps --delay more every step (a slow machine)
    random   every worker, every step, with probability --chance sleeps --spike more (hiccups)

Variants: sync (all-reduce every step), async (parameter server, no bound), ssp (bound
--staleness), local (average every --k steps). Measured: wall time; time and gradients until the
loss falls below --target times the initial loss, and their ratio, the gradients per second
while getting there (the whole run always ends with the slowest worker's last step); the
staleness of every applied gradient. Predicted gradients per second, W workers, t = compute,
d = delay:

    none     every variant   W / t
    fixed    sync, ssp, local  W / (t + d)        (each waits for the slow one, ssp after s steps)
             async             (W - 1) / t + 1 / (t + d)
    random   sync              W / (t + spike (1 - (1 - chance)^W))   (a step waits for any spike)
             async             W / (t + chance spike)                 (nobody waits)

Pictures under out/: sgd_loss.png (loss against gradients and against seconds, per scenario)
and sgd_staleness.png (histograms). Times come from one run on a shared machine: noisy; compare
the ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from minidist.bench import Bench, rank_main
from minidist.sgd.variants import STRAGGLERS, VARIANTS, Config, least_squares, train


def predicted_rate(variant: str, scenario: str, n_workers: int, args) -> float | None:
    """Gradients per second from the formulas in the module docstring (None: no formula)."""
    t, w = args.compute, n_workers
    if t == 0:  # --compute 0: communication alone, no formula divides by it
        return None
    if scenario == "none":
        return w / t
    if scenario == "fixed":
        return (w - 1) / t + 1 / (t + args.delay) if variant == "async" else w / (t + args.delay)
    if variant == "sync":
        return w / (t + args.spike * (1 - (1 - args.chance) ** w))
    return w / (t + args.chance * args.spike) if variant == "async" else None


def run_one(comm, problem, cfg: Config) -> dict | None:
    """Train once; on rank 0: the curve (seconds, gradients, loss), staleness list, wall time."""
    comm.barrier()
    start = time.monotonic()
    res = train(comm, problem, cfg)
    wall = comm.all_reduce(torch.tensor([time.monotonic() - start]), "max").item()
    if cfg.variant in ("sync", "local"):  # the first worker holds the trace
        if comm.rank == 1:
            rows = torch.stack([torch.cat([torch.tensor([s, g]), w]) for s, g, w in res["trace"]])
            comm.send(torch.tensor([rows.shape[0]]), 0)  # the size first, then the payload
            comm.send(rows, 0)
        if comm.rank != 0:
            return None
        n = comm.recv(torch.zeros(1, dtype=torch.int64), 1)
        rows = comm.recv(torch.zeros(int(n), 2 + problem.w_star.numel(), dtype=torch.float64), 1)
        trace, staleness = [(r[0].item(), int(r[1]), r[2:]) for r in rows], []
    elif comm.rank != 0:
        return None
    else:
        trace = res["log"].trace
        staleness = [e.version - e.pulled for e in res["log"].events]
    w0 = torch.zeros_like(problem.w_star)
    curve = [(0.0, 0, problem.loss(w0))] + [(s, g, problem.loss(w)) for s, g, w in trace]
    return {"curve": curve, "staleness": staleness, "wall": wall}


def summarize(run: dict, target: float) -> dict:
    """Time and gradients to the target loss (None if never), rate, staleness statistics."""
    hit = next(((s, g) for s, g, loss in run["curve"] if loss <= target), (None, None))
    stale = run["staleness"]
    return {
        "wall_s": run["wall"],
        "rate": hit[1] / hit[0] if hit[0] else None,  # while reaching the target
        "time_to_target_s": hit[0],
        "gradients_to_target": hit[1],
        "final_loss": run["curve"][-1][2],
        "max_staleness": max(stale, default=None),
        "mean_staleness": sum(stale) / len(stale) if stale else None,
    }


def measure(comm, args) -> dict | None:
    """On rank 0: every row, the ratios and the pictures, as --json prints them; None elsewhere."""
    n_workers = comm.world_size - 1
    problem = least_squares(n_workers, args.rows, args.d, args.batch, seed=0)
    target = args.target * problem.loss(torch.zeros(args.d, dtype=torch.float64))
    out = {"rows": {}, "curves": {}, "staleness": {}}
    for scenario in STRAGGLERS:
        delay = {"none": 0.0, "fixed": args.delay, "random": args.spike}[scenario]
        for variant in VARIANTS:
            cfg = Config(
                variant,
                args.steps,
                args.lr,
                args.staleness,
                args.k,
                1,
                args.compute,
                scenario,
                delay,
                args.chance,
                trace_every=n_workers,
            )
            run = run_one(comm, problem, cfg)
            if run is None:
                continue
            key = f"{scenario}/{variant}"
            row = summarize(run, target)
            row["predicted_rate"] = predicted_rate(variant, scenario, n_workers, args)
            out["rows"][key], out["curves"][key] = row, run["curve"]
            out["staleness"][key] = run["staleness"]
    if comm.rank != 0:
        return None
    pictures = draw(out, args.out)
    return {"rows": out["rows"], "ratios": ratios(out["rows"]), "pictures": pictures}


def ratios(rows: dict) -> dict:
    """Time to target of sync divided by each other variant's, per scenario (>1: faster)."""
    out = {}
    for key, row in rows.items():
        scenario, variant = key.split("/")
        sync = rows[f"{scenario}/sync"]["time_to_target_s"]
        mine = row["time_to_target_s"]
        if variant != "sync" and sync and mine:
            out[f"{scenario}: sync / {variant}"] = sync / mine
    return out


def report(out: dict, args) -> str:
    n = args.n
    lines = [
        f"sync vs async SGD, world {n} ({args.backend}): 1 server (or idle) + {n - 1} workers, "
        f"{args.steps} gradients each, compute {args.compute * 1e3:g} ms, fixed straggler "
        f"+{args.delay * 1e3:g} ms, random +{args.spike * 1e3:g} ms at p={args.chance:g}; "
        f"target loss {args.target:g} x initial",
        f"{'scenario/variant':16} {'wall s':>7} {'grad/s':>7} {'predicted':>9} "
        f"{'to target s':>11} {'grads':>6} {'final loss':>10} {'max st':>6} {'mean st':>7}",
    ]
    for key, r in out["rows"].items():
        lines.append(
            f"{key:16} {r['wall_s']:7.2f} {_or_dash(r['rate'], '7.0f'):>7} "
            f"{_or_dash(r['predicted_rate'], '9.0f'):>9} "
            f"{_or_dash(r['time_to_target_s'], '11.3f'):>11} "
            f"{_or_dash(r['gradients_to_target'], '6d'):>6} "
            f"{r['final_loss']:10.2e} {_or_dash(r['max_staleness'], '6d'):>6} "
            f"{_or_dash(r['mean_staleness'], '7.2f'):>7}"
        )
    lines.append("time to target, sync / variant (above 1: the variant is faster):")
    lines += [f"  {name:26} {value:5.2f}x" for name, value in out["ratios"].items()]
    lines.append(f"pictures: {out['pictures']}")
    return "\n".join(lines)


def draw(out: dict, folder: str) -> list[str]:
    """Loss curves and staleness histograms as PNG files under folder; their paths."""
    from matplotlib.figure import Figure

    os.makedirs(folder, exist_ok=True)
    fig = Figure(figsize=(11, 9))
    axes = fig.subplots(len(STRAGGLERS), 2)
    for i, scenario in enumerate(STRAGGLERS):
        for variant in VARIANTS:
            curve = out["curves"][f"{scenario}/{variant}"]
            secs, grads, loss = zip(*curve, strict=True)
            axes[i][0].semilogy(grads, loss, label=variant)
            axes[i][1].semilogy(secs, loss, label=variant)
        axes[i][0].set(ylabel=f"{scenario}: loss", xlabel="gradients computed (all workers)")
        axes[i][1].set(xlabel="seconds")
        axes[i][0].legend(fontsize=8)
    fig.tight_layout()
    loss_png = os.path.join(folder, "sgd_loss.png")
    fig.savefig(loss_png, dpi=100)
    fig = Figure(figsize=(11, 3.2))
    axes = fig.subplots(1, len(STRAGGLERS))
    for ax, scenario in zip(axes, STRAGGLERS, strict=True):
        for variant in ("async", "ssp"):
            stale = out["staleness"][f"{scenario}/{variant}"]
            ax.hist(stale, bins=range(max(stale) + 2), alpha=0.6, label=variant)
        ax.set(title=f"staleness, {scenario}", xlabel="updates since the pull")
        ax.legend(fontsize=8)
    fig.tight_layout()
    stale_png = os.path.join(folder, "sgd_staleness.png")
    fig.savefig(stale_png, dpi=100)
    return [loss_png, stale_png]


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=80, help="gradients per worker")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--staleness", type=int, default=4, help="ssp bound s")
    p.add_argument("--k", type=int, default=8, help="local SGD: average every k steps")
    p.add_argument("--compute", type=float, default=0.01, help="seconds per gradient")
    p.add_argument("--delay", type=float, default=0.03, help="fixed straggler: extra seconds")
    p.add_argument("--spike", type=float, default=0.03, help="random straggler: extra seconds")
    p.add_argument("--chance", type=float, default=0.1, help="random straggler: probability")
    p.add_argument("--rows", type=int, default=256, help="rows per worker")
    p.add_argument("--d", type=int, default=32, help="parameters")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--target", type=float, default=1e-6, help="target loss / initial loss")
    p.add_argument("--out", default="out", help="folder for the pictures")


def problems(args: argparse.Namespace) -> list[str]:
    """Why these flags cannot run, one line each (the CLI prints them before starting ranks;
    every number is already in its range)."""
    found = []
    if args.n < 2:
        found.append(f"-n {args.n}: bench sgd needs a server and at least one worker (2 ranks)")
    if args.chance > 1:
        found.append(f"--chance {args.chance}: a probability, in [0, 1]")
    if args.rows % args.batch:  # each step takes the next batch of a worker's rows, in turn
        found.append(f"--rows {args.rows} per worker is not divisible by --batch {args.batch}")
    return found


def _or_dash(x, spec: str) -> str:
    """x formatted by spec; '-' where there is no value."""
    return "-" if x is None else format(x, spec)


SGD = Bench(
    "sgd",
    "sync, async, bounded-staleness and local SGD, stragglers",
    __name__,
    flags,
    measure,
    report,
    problems,
    ranks=4,
    ranks_help="ranks: 1 server + n-1 workers",
)

if __name__ == "__main__":
    rank_main(sys.argv[1:], SGD)
