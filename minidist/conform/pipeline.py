"""Conformance checks of the capability "pp": pipeline schedules as data (GPipe, 1F1B) and a
pipelined training step, restated from tests/test_schedules.py and tests/test_pipeline.py.

Schedules (pipeline_schedule): every stage's compute actions in order, ("F", i) and ("B", i),
judged as data in the kit's own process, exactly (they are integers). Every stage runs the
forward and the backward of every microbatch once, the forward first. Run in order with the
pipeline's dependencies (F i on stage s after F i on s-1; B i after F i on s and B i on s+1),
no stage may wait for an action that never comes (a deadlock, named). With t_F = 1, t_B = 2 and
messages taking no time, the run takes (m+p-1)(t_F+t_B) time units: the bubble (idle / total)
is (p-1)/(m+p-1), for both schedules. GPipe: all m forwards, in microbatch order, before the
first backward. 1F1B: stage s stores at most p - s microbatches' activations at once; its
warm-up is min(p-1-s, m) forwards, then one forward and one backward while forwards remain,
then the backwards left; forwards and backwards each in microbatch order. Cases: 1..8 stages,
1..12 microbatches (m not a multiple of p; 1F1B's m < p in checks of their own, as some
implementations refuse it), on one rank (a schedule is data: no comm).

Step (pipeline_step): a float64 stack of Linear + Tanh layers (the second Linear's bias frozen)
that the kit cuts into p contiguous non-empty parts at random points (not the adapter's
partitioner), part r to rank r (a part may hold only a Tanh: a stage without weights); a batch
of m equal microbatches; the loss mse, each microbatch's mean. Equals: the whole model in one
process on the whole batch with the mean loss: every rank's parameter gradients (the frozen
bias's stays None) and the last rank's m microbatch losses, float64 rtol 1e-12, atol 1e-15 (the
samples are summed per microbatch, then over the microbatches: another order than one batch).
Cases: world sizes 1..8 on threads (1..4 over processes), 1..8 microbatches (1F1B's m < p
apart, as above), both schedules.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from minidist.conform.checks import Check, Problem, compare, detached

RTOL, ATOL = 1e-12, 1e-15  # float64: see the module docstring
F64 = torch.float64
COST = {"F": 1, "B": 2}  # time units: a backward costs two forwards, as in the papers' figures

# ---- schedules as data -----------------------------------------------------------------------


def run_schedule(rank, case: dict) -> list:
    """The adapter's programs, as plain lists of (letter, microbatch)."""
    programs = rank.adapter.pipeline_schedule(case["kind"], case["stages"], case["m"])
    return [[(str(letter), int(i)) for letter, i in ops] for ops in programs]


def needs(stage: int, letter: str, i: int, n_stages: int) -> list[tuple[int, str, int]]:
    """The actions (stage, letter, microbatch) that must end before this one can start."""
    if letter == "F":
        return [(stage - 1, "F", i)] if stage > 0 else []
    later = [(stage + 1, "B", i)] if stage < n_stages - 1 else []
    return [(stage, "F", i), *later]


def execute(programs: list) -> tuple[int, list[str]]:
    """Run every stage's actions in order, each once its stage is free and what it needs has
    ended (messages take no time); (the time the last one ends, the stuck stages in words)."""
    p = len(programs)
    end: dict[tuple[int, str, int], int] = {}  # (stage, letter, microbatch) -> when it ended
    pc = [0] * p
    clock = [0] * p
    moved = True
    while moved:  # sweep the stages, each as far as it can go, until none moves
        moved = False
        for s, ops in enumerate(programs):
            while pc[s] < len(ops):
                letter, i = ops[pc[s]]
                before = needs(s, letter, i, p)
                if any(d not in end for d in before):
                    break
                clock[s] = max([clock[s], *(end[d] for d in before)]) + COST[letter]
                end[s, letter, i] = clock[s]
                pc[s] += 1
                moved = True
    stuck = []
    for s, ops in enumerate(programs):
        if pc[s] < len(ops):
            letter, i = ops[pc[s]]
            missing = [d for d in needs(s, letter, i, p) if d not in end]
            waits = ", ".join(f"{x}{j} on stage {t}" for t, x, j in missing)
            stuck.append(f"stage {s} at {letter}{i} waits for {waits}")
    return max(clock, default=0), stuck


def well_formed(programs: list, p: int, m: int) -> list[Problem]:
    """Problems of shape: p programs, each one F and one B of every microbatch, F first."""
    if len(programs) != p:
        return [Problem(f"{len(programs)} programs for {p} stages")]
    problems = []
    want = sorted((letter, i) for letter in COST for i in range(m))
    for s, ops in enumerate(programs):
        if sorted(ops) != want:
            odd = sorted(set(ops) ^ set(want)) or "an action twice"
            problems.append(Problem(f"stage {s}: not one F and one B of each of m={m}: {odd}"))
            continue
        early = [i for i in range(m) if ops.index(("B", i)) < ops.index(("F", i))]
        if early:
            problems.append(Problem(f"stage {s}: B{early[0]} before F{early[0]}"))
    return problems


def stored(ops: list) -> int:
    """The most microbatches whose activations a stage holds at once (F stores, B frees)."""
    return max(itertools.accumulate((x == "F") - (x == "B") for x, _ in ops), default=0)


def first_difference(s: int, ops: list, want: list, name: str) -> list[Problem]:
    """[] if ops == want, else the first action that differs, in words."""
    if ops == want:
        return []
    t = next(t for t, (a, b) in enumerate(zip(ops, want, strict=True)) if a != b)
    got, its = "".join(map(str, ops[t])), "".join(map(str, want[t]))
    return [Problem(f"stage {s}: action {t} is {got}; {name} has {its}")]


def order_gpipe(s: int, ops: list, p: int, m: int) -> list[Problem]:
    """All forwards first, in microbatch order (the backwards' order: the bubble judges it)."""
    return first_difference(s, ops[:m], [("F", i) for i in range(m)], "GPipe")


def order_1f1b(s: int, ops: list, p: int, m: int) -> list[Problem]:
    """At most p - s stored; warm-up, steady one forward one backward, cooldown."""
    if stored(ops) > p - s:
        text = f"stage {s} stores {stored(ops)} microbatches at once; 1F1B's bound p - stage = "
        return [Problem(text + str(p - s))]
    warmup = min(p - 1 - s, m)
    want = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady: forward warmup + i, backward i
        want += [("F", warmup + i), ("B", i)]
    want += [("B", i) for i in range(m - warmup, m)]  # cooldown
    first_backward = next(t for t, (x, _) in enumerate(ops) if x == "B")
    if first_backward != min(p - s, m):
        text = (
            f"stage {s}: {first_backward} forwards before the first backward; want the warm-up "
            f"min(p-1-stage, m) = {warmup}, then one more: {min(p - s, m)}"
        )
        return [Problem(text)]
    return first_difference(s, ops, want, "1F1B")


ORDER = {"gpipe": order_gpipe, "1f1b": order_1f1b}


def judge_schedule(case: dict, outputs: list) -> list[Problem]:
    programs = outputs[0]
    p = case["stages"]
    m = case["m"]
    problems = well_formed(programs, p, m)
    if problems:
        return problems
    makespan, stuck = execute(programs)
    if stuck:
        return [Problem("deadlock: " + "; ".join(stuck))]
    for s, ops in enumerate(programs):
        problems += ORDER[case["kind"]](s, ops, p, m)
    ideal = (m + p - 1) * (COST["F"] + COST["B"])
    if not problems and makespan != ideal:
        bubble = 1 - m * (COST["F"] + COST["B"]) / makespan  # idle / total over the p stages
        text = (
            f"the run takes {makespan} time units (t_F=1, t_B=2), want (m+p-1)(t_F+t_B) = "
            f"{ideal}: bubble {bubble:.3f}, want (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.3f}"
        )
        problems.append(Problem(text, float(makespan - ideal)))
    return problems


# ---- a pipelined step ------------------------------------------------------------------------


def widths_of(case: dict) -> list[int]:
    """The drawn widths, lengthened (cycling) until every stage can have a layer."""
    widths = list(case["widths"])
    while 2 * (len(widths) - 1) < case["p"]:
        widths.append(widths[len(widths) % len(case["widths"])])
    return widths


def make_layers(case: dict) -> list[nn.Module]:
    """Linear(w[k], w[k+1]) + Tanh for each k, float64, from the seed; layer 2's bias frozen."""
    g = torch.Generator().manual_seed(case["seed"])  # not torch.manual_seed: thread-ranks share it
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths_of(case)):
        linear = nn.utils.skip_init(nn.Linear, a, b, dtype=F64)
        with torch.no_grad():
            for q in linear.parameters():
                q.copy_(torch.randn(q.shape, generator=g, dtype=F64) * 0.7)
        layers += [linear, nn.Tanh()]
    if len(layers) > 2:
        layers[2].bias.requires_grad_(False)
    return layers


def cut(case: dict, n_layers: int) -> list[tuple[int, int]]:
    """p contiguous non-empty runs (lo, hi) of range(n_layers), at random cut points."""
    g = torch.Generator().manual_seed(case["seed"] + 2)
    inner = sorted((torch.randperm(n_layers - 1, generator=g)[: case["p"] - 1] + 1).tolist())
    return list(itertools.pairwise([0, *inner, n_layers]))


def batch(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch x (rows m, d_in) and its targets y (rows m, d_out), from the seed."""
    widths = widths_of(case)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    n = case["rows"] * case["m"]
    x = torch.randn(n, widths[0], generator=g, dtype=F64)
    y = torch.randn(n, widths[-1], generator=g, dtype=F64)
    return x, y


def layer_grads(layers: list[nn.Module], lo: int, hi: int) -> dict:
    """{"layer k name.grad": the gradient or None} of layers lo..hi."""
    return {
        f"layer {k} {name}.grad": detached(q.grad)
        for k in range(lo, hi)
        for name, q in layers[k].named_parameters()
    }


def run_step(rank, case: dict) -> dict:
    """One pipelined step on this rank's part; its layers' gradients (and the losses, last)."""
    p = rank.world_size
    r = rank.rank
    layers = make_layers(case)
    lo, hi = cut(case, len(layers))[r]
    x, y = batch(case)
    xs = list(x.split(case["rows"])) if r == 0 else None  # the microbatches, sliced here
    ys = list(y.split(case["rows"])) if r == p - 1 else None
    stage = nn.Sequential(*layers[lo:hi])
    a = rank.adapter
    losses = a.pipeline_step(rank.comm, case["kind"], stage, case["m"], xs, ys, F.mse_loss)
    out = {"grads": layer_grads(layers, lo, hi)}
    if r == p - 1:
        out["losses"] = None if losses is None else [detached(t) for t in losses]
    return out


def compare_grads(r: int, got: dict, want: dict) -> list[Problem]:
    """Every gradient of want by name: None must stay None, and only None may."""
    problems = []
    for name, w in want.items():
        g = got.get(name)
        if (g is None) != (w is None):
            says, has = ("None", "a tensor") if g is None else ("a tensor", "None")
            problems.append(Problem(f"rank {r} {name}: {says}, one process has {has}"))
        elif w is not None:
            found = compare(f"rank {r} {name}", g, w, RTOL, ATOL)
            problems += [found] if found else []
    return problems


def judge_step(case: dict, outputs: list) -> list[Problem]:
    layers = make_layers(case)
    x, y = batch(case)
    rows = case["rows"]
    out = nn.Sequential(*layers)(x)  # (rows m, d_out): the whole batch at once
    pairs = zip(out.split(rows), y.split(rows), strict=True)  # the microbatches, sliced here
    want_losses = [F.mse_loss(a, b).detach() for a, b in pairs]
    F.mse_loss(out, y).backward()  # the mean loss over the whole batch
    problems = []
    for r, (lo, hi) in enumerate(cut(case, len(layers))):
        problems += compare_grads(r, outputs[r]["grads"], layer_grads(layers, lo, hi))
    last = case["p"] - 1
    losses = outputs[last].get("losses")
    if losses is None or len(losses) != case["m"]:
        n = None if losses is None else len(losses)
        text = f"rank {last} (the last stage) returned {n} losses, want one per microbatch: "
        return problems + [Problem(text + str(case["m"]))]
    for i, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
        found = compare(f"rank {last} loss of microbatch {i}", got, want, RTOL, ATOL)
        problems += [found] if found else []
    return problems


# ---- cases and checks ------------------------------------------------------------------------

# (stages, microbatches) of the hard cases, run first: one stage; m < p; m not a multiple of p;
# m = p; m > p. "1f1b" takes m >= p, and "1f1b.few_microbatches" m < p (the stages s <= p-1-m
# all warm-up), which some implementations refuse: a check of its own, so a refusal skips it alone.
HARD_SCHEDULES = {
    "gpipe": [(1, 1), (1, 4), (2, 1), (4, 2), (3, 5), (4, 4), (4, 8), (8, 3), (8, 12)],
    "1f1b": [(1, 1), (1, 4), (2, 2), (3, 5), (4, 4), (4, 8), (8, 8), (8, 12)],
    "1f1b.few_microbatches": [(2, 1), (4, 1), (4, 2), (4, 3), (8, 3), (8, 7)],
}
HARD_STEPS = {
    "gpipe": [(1, 1), (1, 3), (4, 1), (3, 5), (4, 6), (8, 3)],
    "1f1b": [(1, 1), (1, 3), (2, 2), (3, 5), (4, 6), (8, 8)],
    "1f1b.few_microbatches": [(2, 1), (4, 1), (4, 3), (8, 3)],
}


def microbatches(variant: str, p: int, most: int):
    """The microbatch counts drawn for p stages: 1..most (GPipe), p..most (1F1B), 1..p-1."""
    if variant == "1f1b.few_microbatches":
        return st.integers(1, p - 1)
    return st.integers(p if variant == "1f1b" else 1, max(p, most))


def schedule_cases(variant: str):
    def cases(max_p: int):  # max_p unused: a schedule is data, judged on one rank
        def of(p: int):
            return st.fixed_dictionaries(
                {
                    "p": st.just(1),
                    "stages": st.just(p),
                    "m": microbatches(variant, p, 12),
                    "kind": st.just(variant.split(".")[0]),
                }
            )

        return st.integers(2 if "few" in variant else 1, 8).flatmap(of)

    return cases


def step_cases(variant: str):
    def cases(max_p: int):
        def of(p: int):
            return st.fixed_dictionaries(
                {
                    "p": st.just(p),
                    "m": microbatches(variant, p, 8),
                    "widths": st.lists(st.integers(1, 5), min_size=2, max_size=5).map(tuple),
                    "rows": st.integers(1, 3),
                    "seed": st.integers(0, 10**6),
                    "kind": st.just(variant.split(".")[0]),
                }
            )

        return st.integers(2 if "few" in variant else 1, max_p).flatmap(of)

    return cases


def schedule_check(variant: str, about: str) -> Check:
    kind = variant.split(".")[0]
    hard = tuple({"p": 1, "stages": p, "m": m, "kind": kind} for p, m in HARD_SCHEDULES[variant])
    return Check(
        "pp",
        f"schedule.{variant}",
        about,
        ("pipeline_schedule",),
        run_schedule,
        judge_schedule,
        schedule_cases(variant),
        hard,
    )


def step_check(variant: str, about: str) -> Check:
    kind = variant.split(".")[0]
    hard = tuple(
        {"p": p, "m": m, "widths": (3, 5, 4, 2), "rows": 2, "seed": 40 + k, "kind": kind}
        for k, (p, m) in enumerate(HARD_STEPS[variant])
    )
    return Check(
        "pp",
        f"step.{variant}",
        about,
        ("pipeline_step",),
        run_step,
        judge_step,
        step_cases(variant),
        hard,
    )


CHECKS = [
    schedule_check(
        "gpipe",
        "as data: each F and B once per stage, no deadlock, all m forwards first, bubble "
        "(p-1)/(m+p-1) (exact); m any",
    ),
    schedule_check(
        "1f1b",
        "as data: each F and B once per stage, no deadlock, warm-up min(p-1-s, m) then F B "
        "pairs, at most p - s stored, bubble (p-1)/(m+p-1) (exact); m >= p",
    ),
    schedule_check(
        "1f1b.few_microbatches",
        "1F1B as data with m < p (stage s <= p-1-m: all forwards first): as schedule.1f1b",
    ),
    step_check(
        "gpipe",
        "one GPipe step: every stage's gradients and the m losses equal one process on the "
        "whole batch, mean loss (1e-12); m any",
    ),
    step_check(
        "1f1b",
        "one 1F1B step: every stage's gradients and the m losses equal one process on the "
        "whole batch, mean loss (1e-12); m >= p",
    ),
    step_check(
        "1f1b.few_microbatches",
        "one 1F1B step with m < p: gradients and losses as one process (1e-12)",
    ),
]
