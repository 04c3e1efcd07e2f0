"""What `minidist plan` prints: each layout's row (time by part, memory, MFU and HFU, days,
energy, cost, its error band), the table, why the best wins, why nothing runs, the picture.

Equals: nothing to match; the numbers are cluster/plan.py's, arranged. tests/test_plan.py and
tests/test_plan_input.py read them back from the command's text and JSON.
Ladder: row (one layout's numbers) -> table, band, why (the text) -> draw (the picture).
Lesson: lessons/13_beyond_one_machine/.   Run: minidist plan --model llama-7b --gpus 64
"""

from __future__ import annotations

import sys
import textwrap
from collections import Counter
from dataclasses import asdict

from minidist.cluster import hardware as clusters
from minidist.cluster import plan, profiles, shapes
from minidist.cluster.search import LONG

PARTS = ("compute", "bubble", "tp", "cp", "ep", "pp", "dp", "optimizer")
SOMETIMES = ("cp", "ep")  # parts shown only where a shown layout has them


def refuse_all(shape, cluster, args, refused) -> None:
    """No layout runs: say so, and what the leanest one would need."""
    say = lambda line: print(f"minidist plan: {line}", file=sys.stderr)  # noqa: E731
    say(f"no layout of {shape.name} runs on {args.gpus} GPUs of {cluster.name}")
    if not refused:  # every layout was filtered out before it was priced
        say("no layout has the recompute, ZeRO stage and sequence parallelism asked for")
    sized = [q for q in refused if q.memory]
    if sized:
        lean = min(sized, key=lambda q: sum(q.memory.values()))
        say(f"the leanest, {name(asdict(lean.layout))}: {lean.why_not[0]}")
    for reason, n in reasons(refused).most_common(3):
        say(f"{n} layouts: {reason}")
    if len(reasons(refused)) > 3:
        say(f"and {len(reasons(refused)) - 3} other reasons (--json lists them all)")


def reasons(refused) -> Counter:
    """How many layouts each kind of reason refused (the numbers in it stripped)."""
    kinds = Counter()
    for q in refused:
        for why in q.why_not:
            kinds[why.split(";")[0] if why.startswith("needs") else why] += 1
    return kinds


def row(shape, cluster, args, q: plan.Plan, band: bool = True) -> dict:
    """One layout's numbers; band: its step time's and days' error band (plan.error_band),
    for the presets (None for this machine, which the published runs do not validate)."""
    tokens_per_s = args.batch * shape.seq / q.seconds
    days = args.tokens / tokens_per_s / 86400
    gpu_hours = days * 24 * args.gpus
    watts = cluster.node_watts / cluster.gpus_per_node * args.gpus * cluster.pue
    low, high = plan.error_band(q.seconds) if band else (None, None)
    return {
        "layout": asdict(q.layout),
        "seconds": q.seconds,
        "seconds_band": [low, high] if band else None,
        "days_band": [days * low / q.seconds, days * high / q.seconds] if band else None,
        "parts": q.parts,
        "memory_gb": {k: v / 1e9 for k, v in q.memory.items()},
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(shape, cluster, args.gpus, args.batch, q.seconds),
        "hfu": mfu(shape, cluster, args.gpus, args.batch, q.seconds, q.layout.recompute),
        "days": days,
        "mwh": watts * days * 24 / 1e6,
        "usd": gpu_hours * cluster.usd_per_gpu_hour,
    }


def mfu(
    shape: plan.Shape,
    cluster: clusters.Cluster,
    gpus: int,
    batch: int,
    seconds: float,
    recompute: str | None = None,
) -> float:
    """Model FLOPs utilisation: 3 x the forward FLOPs of the batch (no recompute counted)
    over what the GPUs could do in that time at peak (Chowdhery et al., PaLM, appendix B);
    with recompute, hardware FLOPs utilisation instead, recompute counted as the papers count
    it (shapes.Shape.hardware_flops_per_token)."""
    per_token = (
        shape.model_flops_per_token()
        if recompute is None
        else shape.hardware_flops_per_token(recompute)
    )
    return per_token * batch * shape.seq / (seconds * gpus * cluster.gpu.peak_flops)


def name(layout: dict) -> str:
    x = layout
    sp = (" sp" if x["sp"] else "") + (" ends" if x.get("ends") else "")
    more = "".join(f" {k}{x[k]}" for k in ("cp", "ep") if x.get(k, 1) > 1)
    more += f" etp{x['etp']}" if x.get("etp") else ""  # fewer tp ranks cut the experts
    more += " fp8" if x.get("fp8") else ""
    return (
        f"dp{x['dp']} pp{x['pp']} tp{x['tp']} v{x['v']} z{x['zero']} b{x['b']} {x['recompute']}"
        f"{sp}{more}"
    )


def parts_shown(rows) -> list[str]:
    """The parts to show: PARTS, less cp and ep where no row has them."""
    return [p for p in PARTS if p not in SOMETIMES or any(r["parts"][p] for r in rows)]


def count(n: float) -> str:
    """A parameter count as people write it: 175.0B, 124.4M, 12.3K."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def framework(args) -> str:
    """The profile the plan was priced with (cluster/profiles.py)."""
    return "minidist" if args.cluster == "this" else args.framework or profiles.DEFAULT


def table(shape, cluster, args, rows, refused) -> None:
    print(f"{shape.name} ({count(shape.params())}) on {args.gpus} x {cluster.gpu.name},")
    print(f"batch {args.batch} x {shape.seq} tokens; {args.tokens:.3g} tokens to train")
    profile = profiles.PROFILES[framework(args)]
    print(f"framework {profile.name}: {profile.source}; ranks {profile.order}, innermost first")
    if profile.compute != 1:  # a share fitted on the framework's runs (DeepSpeed, llm-foundry)
        fitted = "fitted on one of its runs: cluster/evidence.py"
        print(f"its matmuls at {profile.compute:.1%} of the calibrated rate ({fitted})")
    unit, scale = ("s", 1) if rows[0]["seconds"] >= 1 else ("ms", 1e3)  # a toy's step: ms
    shown = parts_shown(rows)
    head = f"{'layout':38} {'step ' + unit:>7} " + " ".join(f"{p:>6}" for p in shown)
    print(head + f" {'GB':>5} {'MFU':>5} {'days':>6} {'MWh':>7} {'M$':>6}")
    for r in rows:
        parts = " ".join(f"{r['parts'][p] * scale:6.2f}" for p in shown)
        gb, step = sum(r["memory_gb"].values()), r["seconds"] * scale
        money = f"{r['days']:6.1f} {r['mwh']:7.1f} {r['usd'] / 1e6:6.2f}"
        print(f"{name(r['layout']):38} {step:7.2f} {parts} {gb:5.1f} {r['mfu']:5.2f} {money}")
    memory = [q for q in refused if q.why_not[0].startswith("needs")]
    print(f"refused: {len(memory)} layouts do not fit in memory, {len(refused) - len(memory)} do")
    print("not divide the model, the batch or the GPUs")


def band(best: dict) -> None:
    """The best layout's error band, and how it is drawn (nothing for this machine)."""
    if best["seconds_band"] is None:
        return
    errors = plan.error_deciles()
    (low, high), (dlow, dhigh) = best["seconds_band"], best["days_band"]
    unit, scale = ("s", 1) if best["seconds"] >= 1 else ("ms", 1e3)
    print(
        f"band: the best step {low * scale:.2f} to {high * scale:.2f} {unit}, {dlow:.1f} to ",
        end="",
    )
    print(f"{dhigh:.1f} days: the middle 80% of the planner's errors on")
    print(f"{len(plan.VALIDATION_ERRORS)} published runs ({errors[0]:+.1%} to {errors[-1]:+.1%})")


def why(rows) -> None:
    """Why the best wins: against the best layout on another dp x pp x tp grid."""
    grid = lambda r: (r["layout"]["dp"], r["layout"]["pp"], r["layout"]["tp"])  # noqa: E731
    other = next((r for r in rows if grid(r) != grid(rows[0])), None)
    if other is None:
        return
    best = rows[0]
    gap = {p: other["parts"][p] - best["parts"][p] for p in PARTS}
    part = max(gap, key=gap.get)
    ahead = other["seconds"] / best["seconds"] - 1
    print(f"why the best wins: {ahead:.1%} faster than the best on another grid")
    unit, scale = ("s", 1) if best["seconds"] >= 1 else ("ms", 1e3)
    ours, theirs = best["parts"][part] * scale, other["parts"][part] * scale
    print(f"({name(other['layout'])}), most of it in {part}: {ours:.2f} {unit} against")
    print(f"{theirs:.2f} {unit}")


def draw(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.5))
    names = [name(r["layout"]) for r in rows][::-1]
    left = [0.0] * len(rows)
    for p in parts_shown(rows):
        widths = [r["parts"][p] for r in rows][::-1]
        ax.barh(names, widths, left=left, label=p)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("seconds per step (formulas)")
    ax.legend(title="part of the step", loc="lower right")
    fig.tight_layout()
    fig.savefig(path)


def counted(shape: plan.Shape) -> None:
    """The counting conventions of the numbers above (shapes.conventions), in a paragraph."""
    said = shapes.conventions(shape)
    line = f"counted: parameters, {said['parameters']}; MFU, {said['mfu']}; HFU (--json), "
    print(textwrap.fill(line + said["hfu"], 100))


def warnings(shape: plan.Shape, ok: list, recompute_asked: bool) -> list[str]:
    """What the best layout (ok[0]) needs and lacks, in words, with the numbers: a long
    sequence (search.LONG tokens and more) without context parallelism, and a model that fits
    only with activation recompute (no feasible layout without it; unless --recompute chose)."""
    found = []
    best = ok[0].layout
    if best.cp == 1 and shape.seq >= LONG:
        scores = 4 * shape.seq * shape.q_width()
        share = scores / (2 * shape.active_layer_params() + scores)
        kept = plan.layer_activation_bytes(shape, best) / 1e9
        found.append(
            f"seq={shape.seq} without context parallelism: attention is {share:.0%} of a "
            f"layer's FLOPs and a layer keeps {kept:.1f} GB a microbatch; Llama 3 ran cp 16 at "
            "131,072 tokens (Dubey et al., 2024, table 4): try --cp"
        )
    if best.recompute != "none" and not recompute_asked:
        if all(q.layout.recompute != "none" for q in ok):
            found.append(
                f"fits only with activation recompute: no layout without it fits ({best.recompute}"
                " recompute costs the best one a forward again, or part of one)"
            )
    return found


def warn(lines: list[str]) -> None:
    """Each warning, wrapped at 100 columns."""
    for line in lines:
        print(textwrap.fill(f"warning: {line}", 100, subsequent_indent="  "))
