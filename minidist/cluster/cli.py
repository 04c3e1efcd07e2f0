"""`minidist plan`: the best layouts of a model on a cluster, their time, memory, energy, cost.

    minidist plan --model gpt3-175b --cluster dgx-a100 --gpus 1024 --batch 1536
    minidist plan --model llama-70b --cluster dgx-h100 --gpus 512 --batch 1024 --tokens 2e12
    minidist plan --layers 32 --hidden 4096 --heads 32 --vocab 50304 --seq-len 2048 ...
    minidist plan ... --recompute full --no-sp --zero 1 --no-flash   # what your framework has
    minidist plan --model llama3-405b --cluster dgx-h100 --gpus 8192 --batch 2048 --ends
    minidist plan ... --json         # one object: every feasible layout's numbers
    minidist plan ... --png out/plan.png                     # the time breakdown, drawn
    minidist bench p2p -n 2 --backend mpi --json > p2p.json
    minidist plan --cluster this --calibration p2p.json --gpus 2 --batch 16   # this machine
    minidist plan ... --dp 2 --tp 1 --microbatch-size 2     # only layouts with these numbers
    minidist plan --model llama3-405b --seq-len 131072 --cp 16 --fp8 ...   # cp, ep, FP8
    minidist plan --model mixtral-8x7b --ep 8 --framework fsdp ...   # whose overlap
    minidist plan --model mixtral-8x7b --tp 2 --etp 1 --ep 8 ...   # whole experts, ep over tp
    minidist plan --cluster my_cluster.toml ...             # your cluster (cluster/custom.py)

Prints the best layouts (plan_search.search) with the step time by part, tokens/s, MFU, memory per
GPU, and for the token budget the days, the energy (MWh, at the nodes' full power times the
PUE: an upper bound) and the cost (cluster/report.py); how parameters and FLOPs were counted;
warnings where the best layout lacks a technique the run needs (a long sequence without
context parallelism, a model that fits only with recompute: --json "warnings"); the best one's
error band (plan.error_band: where its step would fall were the planner as wrong as on the
middle 80% of the published runs it was checked on; --json: every layout's seconds_band and
days_band); then why the best one wins, and how many layouts were refused for which reason
(--json: "refused", each reason with its count, also when none runs; "problems": the input's,
when it is refused before any layout).
Bad input is refused with one line per reason (exit 2): every number is read here (numbers) and
one outside LIMITS is refused with its value before any work; a picked dp, pp, tp or cp that
cannot divide the GPUs is refused with the numbers (pick_problems).
`--cluster this` is this computer, one rank per core, as cluster/calibrate.py measures it: alpha and
B fitted to `minidist bench p2p --json`, a core's copy bandwidth, and its FLOP/s on minidist's
own block at each layout's microbatch and tp (measured when a layout that fits first needs it:
seconds), its memory the RAM's share; the layouts are those `minidist train` runs, priced as it
runs them (float32, no overlap), MFU of the measured rate; the model defaults to minidist's
GPT (train's defaults).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, replace

from minidist.cluster import custom, plan, profiles, report, shapes
from minidist.cluster import hardware as clusters
from minidist.cluster import search as plan_search

# the --flags that pick layouts
ONLY = ("dp", "pp", "tp", "cp", "ep", "etp", "microbatch_size", "microbatches", "chunks")
# Every whole-number flag's range. Past these no run is planned (the largest published clusters
# hold about 10^5 GPUs, the largest models about 10^2 layers and 10^4-10^5 wide), and the search's
# work grows with the GPU count's divisors and the layers: the bounds keep it to seconds.
LIMITS = {
    "gpus": (1, 1 << 20),
    "batch": (1, 1 << 24),
    "top": (1, 10_000),
    "layers": (1, 10_000),
    "hidden": (1, 1 << 20),
    "heads": (1, 1 << 16),
    "ffn": (1, 1 << 22),
    "vocab": (1, 1 << 24),
    "seq_len": (1, 1 << 24),
    "dp": (1, 1 << 20),
    "pp": (1, 10_000),
    "tp": (1, 1 << 16),
    "microbatch_size": (1, 1 << 24),
    "microbatches": (1, 1 << 24),
    "chunks": (1, 10_000),
    "cp": (1, 1 << 16),
    "ep": (1, 1 << 16),
    "etp": (1, 1 << 16),
    "kv_heads": (1, 1 << 16),
    "head_dim": (1, 1 << 16),
    "experts": (1, 1 << 16),
    "top_k": (1, 1 << 16),
}
MOST_TOKENS = 1e16  # a run's budget: Llama 3 trained on 1.56e13
MOST_CAPACITY = 64.0  # a capacity factor past the experts' count routes nothing more


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the best layouts of a model on a cluster, from formulas")
    models = ", ".join(plan.SHAPES)
    p.add_argument("--model", help=f"one of {models} (gpt3-175b; minidist with --cluster this)")
    # numbers arrive as text and are read by numbers(): a bad one is refused in one line
    for flag in ("layers", "hidden", "heads", "kv-heads", "head-dim", "ffn", "vocab", "seq-len"):
        p.add_argument(f"--{flag}", help="override the model's shape")
    for flag in ("experts", "top-k"):
        p.add_argument(f"--{flag}", help="override the model's mixture of experts")
    p.add_argument("--capacity", help="a mixture's capacity factor (the model's: 1)")
    p.add_argument(
        "--cluster",
        default="dgx-a100",
        help=f"one of {', '.join(clusters.PRESETS)}, this, or a .json or .toml file "
        "describing one (cluster/custom.py)",
    )
    p.add_argument(
        "--calibration", help="with --cluster this: `minidist bench p2p --json`'s output"
    )
    p.add_argument("--gpus", default=64)
    p.add_argument("--batch", default=512, help="sequences per step, all GPUs")
    p.add_argument("--tokens", default=300e9, help="the run's token budget")
    p.add_argument(
        "--recompute",
        choices=("none", "selective", "full", "op"),
        help="only this one (op: TorchTitan's, every second linear layer)",
    )
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="only this ZeRO stage")
    p.add_argument("--no-sp", action="store_true", help="no sequence parallelism")
    p.add_argument("--no-flash", action="store_true", help="attention stores its s x s scores")
    p.add_argument(
        "--ends", action="store_true", help="the embedding and the head as stages (Llama 3)"
    )
    p.add_argument(
        "--framework",
        choices=[k for k in profiles.PROFILES if k != "minidist"],
        help=f"whose overlap of traffic with compute, rank order and compute rate (default "
        f"{profiles.DEFAULT}; cluster/profiles.py cites each)",
    )
    for flag in ONLY:
        p.add_argument(f"--{flag.replace('_', '-')}", help="only layouts with this")
    p.add_argument("--fp8", action="store_true", help="the layers' matmuls in FP8 (H100, H200)")
    p.add_argument("--top", default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--png", help="draw the time breakdown of the best layouts here")
    p.set_defaults(func=main)


def numbers(args) -> list[str]:
    """Read every numeric flag's text into its number, in place; one line per flag that is not
    a number, or is outside LIMITS (tokens: positive, at most MOST_TOKENS), naming the number.
    A whole number may be written 1e3; 1e30 is read, then refused as too large."""
    found = []
    for flag, (low, high) in LIMITS.items():
        text, name = getattr(args, flag), f"--{flag.replace('_', '-')}"
        if text is None or isinstance(text, int):
            value = text
        else:
            try:
                value = int(text)
            except ValueError:
                value = _whole(text)
        if value is None and text is not None:
            found.append(f"{name}={text} is not a whole number")
        elif value is not None and value < low:
            found.append(f"{name}={value} must be at least {low}")
        elif value is not None and value > high:
            found.append(f"{name}={text} must be at most {high}")
        setattr(args, flag, value)
    try:
        args.tokens = float(args.tokens)
    except ValueError:
        return [*found, f"--tokens={args.tokens} is not a number"]
    if not 0 < args.tokens <= MOST_TOKENS:
        found.append(f"--tokens={args.tokens} must be positive and at most {MOST_TOKENS:g}")
    if args.capacity is not None:
        try:
            args.capacity = float(args.capacity)
        except ValueError:
            return [*found, f"--capacity={args.capacity} is not a number"]
        if not 0 < args.capacity <= MOST_CAPACITY:
            found.append(f"--capacity={args.capacity} must be positive, at most {MOST_CAPACITY}")
    return found


def _whole(text: str) -> int | None:
    """1e3 -> 1000; None if text is no finite whole number."""
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value == int(value) else None


def _inputs(args) -> tuple[plan.Shape, clusters.Cluster, list[str]]:
    """The shape and cluster the flags ask for, and every reason they cannot be used."""
    found = numbers(args)
    if found:
        return None, None, found
    args.model = args.model or ("minidist" if args.cluster == "this" else "gpt3-175b")
    if args.model not in plan.SHAPES:
        found.append(f"unknown model {args.model!r}; known: {', '.join(plan.SHAPES)}")
    if args.cluster == "this" and not args.calibration:
        found.append("--cluster this needs --calibration FILE (minidist bench p2p --json)")
    elif args.calibration and not os.path.isfile(args.calibration):
        found.append(f"--calibration {args.calibration}: no such file")
    elif _is_file(args.cluster) and not os.path.isfile(args.cluster):
        found.append(f"--cluster {args.cluster}: no such file")
    elif (
        args.cluster not in clusters.PRESETS
        and args.cluster != "this"
        and not _is_file(args.cluster)
    ):
        found.append(f"unknown cluster {args.cluster!r}; known: {', '.join(clusters.PRESETS)}")
    if args.ends and args.cluster == "this":
        found.append("--ends: minidist train's pipeline gives the embedding and head no stages")
    if args.framework and args.cluster == "this":
        found.append("--framework: --cluster this plans minidist train, which is its own")
    if args.png and not os.path.isdir(os.path.dirname(os.path.abspath(args.png))):
        found.append(f"--png {args.png}: its folder does not exist")
    if found:
        return None, None, found
    shape = derived_shape(args)
    found += pick_problems(args)
    if shape.hidden % shape.heads:
        found.append(f"hidden={shape.hidden} is not divisible by heads={shape.heads}")
    if args.batch * shape.seq > args.tokens:  # the run would be less than one step
        need = f"--batch={args.batch} x {shape.seq} tokens"
        found.append(f"one step of {need} is more than --tokens={args.tokens:g}")
    if shape.experts == 0 and (args.top_k or args.capacity):
        model = plan.SHAPES[args.model].name
        found.append(f"--top-k, --capacity: {model} has no experts (--experts N)")
    elif shape.top_k > max(1, shape.experts):
        found.append(f"--top-k={shape.top_k} is more than experts={shape.experts}")
    if shape.heads % (shape.kv_heads or shape.heads):
        found.append(f"heads={shape.heads} are not divisible by kv heads={shape.kv_heads}")
    if _is_file(args.cluster):
        try:
            return shape, custom.load(args.cluster), found
        except (ValueError, OSError) as e:
            return shape, None, [*found, f"--cluster {args.cluster}: {e}"]
    if args.cluster != "this":
        return shape, clusters.preset(args.cluster), found
    # only here: measuring this machine runs torch, which the other clusters never import
    from minidist.cluster import calibrate

    found += calibrate.problems(shape)
    try:
        return shape, calibrate.Machine(args.calibration, shape), found
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        return shape, None, [*found, f"--calibration {args.calibration}: {e}"]


def _is_file(cluster: str) -> bool:
    """Whether --cluster names a file (.json, .toml) rather than a preset."""
    return cluster.endswith((".json", ".toml"))


def pick_problems(args) -> list[str]:
    """Why the picked --dp, --pp, --tp, --cp, --chunks can be no layout of --gpus at all, with
    the numbers (the rest, heads, layers, batch, memory, plan.problems() says layout by layout)."""
    found, gpus = [], args.gpus
    axes = ("dp", "pp", "tp", "cp")
    picks = {k: getattr(args, k) for k in axes if getattr(args, k) is not None}
    for k, v in picks.items():
        if gpus % v:
            found.append(f"--{k}={v} does not divide --gpus={gpus}")
    product = math.prod(picks.values())
    whole = all(k in picks for k in ("dp", "pp", "tp"))  # cp, unpicked, is then 1
    if not found and (gpus % product or (whole and product != gpus)):
        what = " x ".join(f"--{k}={v}" for k, v in picks.items())
        fills = "cp" not in picks and gpus % product == 0
        rest = f" (--cp {gpus // product} would fill it)" if fills else ""
        found.append(
            f"{what} = {product}, which leaves no whole dp x pp x tp = --gpus={gpus}{rest}"
        )
    if (args.chunks or 1) > 1 and args.pp == 1:
        found.append(f"--chunks={args.chunks} interleaves pipeline stages: it needs --pp > 1")
    return found


def _picked(args) -> dict:
    """The dimensions held to one value, as search.layouts() takes them."""
    names = {"tp": args.tp, "pp": args.pp, "v": args.chunks, "b": args.microbatch_size}
    names |= {"m": args.microbatches, "cp": args.cp, "ep": args.ep, "etp": args.etp}
    names |= {"fp8": args.fp8 or None}
    names |= {"recompute": args.recompute}
    return {k: v for k, v in names.items() if v is not None}


def derived_shape(args) -> plan.Shape:
    """The --model's shape with the shape flags applied; renamed "custom (<model> with
    <changes>)" if any changes it. The FFN keeps its ratio to the width unless --ffn is given."""
    shape = plan.SHAPES[args.model]
    changes = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads}
    changes |= {"ffn": args.ffn, "vocab": args.vocab, "seq": args.seq_len}
    changes |= {"kv_heads": args.kv_heads, "head_dim": args.head_dim}
    changes |= {"experts": args.experts, "top_k": args.top_k}
    changes |= {"capacity": args.capacity}
    if args.hidden and args.ffn is None:
        changes["ffn"] = shape.ffn * args.hidden // shape.hidden
    changes = {k: v for k, v in changes.items() if v is not None and v != getattr(shape, k)}
    if not changes:
        return shape
    what = ", ".join(f"{k}={v}" for k, v in changes.items())
    return replace(shape, name=f"custom ({shape.name} with {what})", **changes)


def _allowed(args, layout: plan.Layout) -> bool:
    x = layout
    value = {"dp": x.dp, "pp": x.pp, "tp": x.tp, "microbatch_size": x.b, "chunks": x.v}
    value |= {"cp": x.cp, "ep": x.ep, "etp": x.expert_tp()}
    value |= {"microbatches": x.microbatches(args.batch)}
    picked = all(getattr(args, f) in (None, value[f]) for f in ONLY)
    return (
        picked
        and (args.recompute is None or layout.recompute == args.recompute)
        and (args.zero is None or layout.zero == args.zero)
        and not (args.no_sp and layout.sp)
    )


def main(args: argparse.Namespace) -> int:
    shape, cluster, found = _inputs(args)
    if found:
        if args.json:  # the same reasons, for a script: no layout was priced
            print(json.dumps({"layouts": [], "refused": [], "problems": found}))
        for line in found:
            print(f"minidist plan: {line}", file=sys.stderr)
        return 2
    allowed, machine = (lambda x: _allowed(args, x)), None  # noqa: E731
    if args.cluster == "this":  # measured: each layout on its own rate (calibrate.Machine)
        machine, cluster = cluster, cluster.cluster
        ok, refused = machine.search(args.gpus, args.batch, allowed)
        rows = [report.row(shape, machine.cluster_for(q.layout), args, q, band=False) for q in ok]
    else:
        flash = not args.no_flash
        picked = _picked(args)
        ok, refused = plan_search.search(
            shape,
            cluster,
            args.gpus,
            args.batch,
            None,
            flash,
            allowed,
            ends=args.ends,
            picked=picked,
            profile=profiles.PROFILES[args.framework or profiles.DEFAULT],
        )
        rows = [report.row(shape, cluster, args, q) for q in ok]
    reasons = [{"reason": why, "layouts": n} for why, n in report.reasons(refused).most_common()]
    if not ok:
        if args.json:
            got = {"model": asdict(shape), "cluster": cluster.name, "layouts": []}
            got["framework"] = report.framework(args)
            print(json.dumps(got | {"refused": reasons}))
        report.refuse_all(shape, cluster, args, refused)
        return 2
    measured = machine.measured() if machine else None  # --cluster this
    warnings = report.warnings(shape, ok, args.recompute is not None)
    if args.json:
        got = {"model": asdict(shape), "cluster": cluster.name, "layouts": rows}
        got["framework"] = report.framework(args)
        got["conventions"] = shapes.conventions(shape)
        got["warnings"] = warnings
        got["refused"] = reasons
        print(json.dumps(got | ({"measured": measured} if measured else {})))
    else:
        report.table(shape, cluster, args, rows[: args.top], refused)
        report.counted(shape)
        report.warn(warnings)
        report.band(rows[0])
        report.why(rows)
        if measured:
            rates = ", ".join(f"{k} {v:.1f}" for k, v in measured["gflop_s"].items())
            print(f"measured: a = {measured['latency_us']:.1f} us, B = ", end="")
            print(f"{measured['bandwidth_gb_s']:.2f} GB/s, copy {measured['copy_gb_s']:.1f} GB/s;")
            print(f"a core's GFLOP/s on the block: {rates}")
    if args.png:
        report.draw(rows[: args.top], args.png)
    return 0


if __name__ == "__main__":  # python -m minidist.cluster.cli ...
    parser = argparse.ArgumentParser(prog="minidist")
    add_parser(parser.add_subparsers(dest="command", required=True))
    sys.exit(main(parser.parse_args(["plan", *sys.argv[1:]])))
