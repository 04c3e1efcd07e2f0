"""Conformance checks of the capability "zero": ZeRO stages 1, 2 and 3 with AdamW, restated from
tests/test_zero.py.

Equals: one process training the same module on the whole batch with torch.optim.AdamW (the
loss a mean over the batch, each rank's the mean over its equal share, so the gradient is the
average of the ranks' gradients): after each of 1-3 steps, every rank's whole parameters
(float64, rtol 1e-12, atol 1e-15: the batch is summed in another order, per rank and then
across ranks), bitwise equal across ranks; each rank's averaged gradient and AdamW state
(exp_avg, exp_avg_sq), piece by piece, against the slice of that process's (the kit slices;
1e-12 again). Ranks build the module from different seeds: rank 0's values must win.
Sharding: the pieces of optimizer state (every stage), and of the gradient (stages 2 and 3),
cover each parameter's elements exactly once across the ranks; where each rank's shard lies is
the implementation's own choice (a flat buffer cut in p, whole parameters, rows of dim 0).
Memory: the most bytes a rank holds, sampled after each backward and after each step, is at
most the paper's formula (section 5, figure 1; minidist/zero/cost.py, restated here) for
Psi trainable elements of b = 8 bytes and AdamW's K = 2 b bytes of state per element:
    stage 1: params Psi b, grads Psi b, optimizer K Psi / p
    stage 2: params Psi b, grads Psi b / p, optimizer K Psi / p
    stage 3: params Psi b / p, grads Psi b / p, optimizer K Psi / p
on a stack of layers whose every size divides by p (p or 2 p layers of (m p, m p) weights):
the formula is exact only there (elsewhere each implementation pads its shards its own way),
and sampling outside forward and backward leaves out the whole units ZeRO-3 holds in use.
The model of the other checks is a 3-layer tanh MLP whose sizes rarely divide by p, with a
parameter of one element (the output bias, fewer elements than ranks); on 8 ranks some shards
hold only padding. Cases: world sizes 1..8 on threads (1..4 over processes), 1-3 steps; each
stage its own checks, so an adapter that offers only some stages (NotImplementedError) has
the others skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from minidist.conform.checks import (
    Check,
    Problem,
    compare_all,
    detached,
    same_on_every_rank,
)

RTOL, ATOL = 1e-12, 1e-15  # float64; the batch is summed in another order than one process's
F64 = torch.float64
B = 8  # bytes per float64 element
ADAMW = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
STATE = ("exp_avg", "exp_avg_sq")  # AdamW's elementwise state, by torch's names
KINDS = ("params", "grads", "optimizer")
HELD = {  # the formula, in words, by stage
    1: "params Psi b, grads Psi b, optimizer 2 Psi b/p",
    2: "params Psi b, grads Psi b/p, optimizer 2 Psi b/p",
    3: "params, grads Psi b/p, optimizer 2 Psi b/p",
}


def build(case: dict, seed: int) -> nn.Module:
    """The case's module, its values drawn from seed (not the global generator: thread-ranks
    share it). kind "mlp": d -> h -> h -> 1 with tanh; "even": layers (w, w) without bias."""
    if case["model"] == "mlp":
        d, h = case["d"], case["h"]
        layers = [nn.Linear(d, h, dtype=F64), nn.Tanh(), nn.Linear(h, h, dtype=F64), nn.Tanh()]
        module = nn.Sequential(*layers, nn.Linear(h, 1, dtype=F64))
    else:
        w = case["w"]
        layers = [[nn.Linear(w, w, bias=False, dtype=F64), nn.Tanh()] for _ in range(case["L"])]
        module = nn.Sequential(*[m for pair in layers for m in pair])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in module.parameters():
            q.copy_(torch.randn(q.shape, generator=g, dtype=F64) * 0.5)
    return module


def problem(case: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's whole batch (x, y) from the seed: x (b p, d), y (b p, 1) (or (b p, w))."""
    g = torch.Generator().manual_seed(case["seed"] + 1)
    n = case["b"] * case["p"]
    d, o = (case["d"], 1) if case["model"] == "mlp" else (case["w"], case["w"])
    return [
        (torch.randn(n, d, generator=g, dtype=F64), torch.randn(n, o, generator=g, dtype=F64))
        for _ in range(case["steps"])
    ]


def pieces(found) -> list[tuple[str, int, int, object]]:
    """The adapter's pieces (name, lo, hi, tensor or {key: tensor}) made plain: tensors
    detached and flattened (a piece may come in any shape of hi - lo elements)."""

    def flat(t):
        return t if t is None else detached(t).reshape(-1)

    plain = []
    for name, lo, hi, value in found:
        value = {k: flat(v) for k, v in value.items()} if isinstance(value, dict) else flat(value)
        plain.append((str(name), int(lo), int(hi), value))
    return plain


def run_for(*records: str):
    """run(rank, case) for a check that reads `records` of the adapter's: "parameters",
    "gradients", "state", "memory" (the adapter's other optional functions are not called)."""

    def run(rank, case: dict) -> dict:
        a = rank.adapter
        r = rank.rank
        b = case["b"]
        module = build(case, case["seed"] + 1000 * r)  # out of sync: rank 0's values must win
        model = a.zero(rank.comm, module, case["stage"], **ADAMW)
        steps = []
        for x, y in problem(case):
            F.mse_loss(model(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]).backward()
            step = {}
            if "memory" in records:  # before the gradients are asked for: ZeRO-1's peak
                step["memory after backward"] = bytes_held(a, model)
            if "gradients" in records:
                step["gradients"] = pieces(a.zero_gradients(model))
            a.zero_step(model)
            if "memory" in records:
                step["memory after step"] = bytes_held(a, model)
            if "parameters" in records:
                step["parameters"] = whole_parameters(a, model, module)
            if "state" in records:
                step["state"] = pieces(a.zero_optimizer_state(model))
            steps.append(step)
        return {"steps": steps}

    return run


def whole_parameters(a, model, module: nn.Module) -> dict:
    """{name: tensor} of every parameter, whole: the adapter's zero_parameters, or else the
    module's own (stages 1 and 2 keep them whole)."""
    if hasattr(a, "zero_parameters"):
        found = a.zero_parameters(model)
    else:
        found = dict(module.named_parameters())
    return {str(n): detached(t) for n, t in found.items()}


def bytes_held(a, model) -> dict:
    return {k: int(v) for k, v in a.zero_memory(model).items() if k in KINDS}


def reference(case: dict) -> list[dict]:
    """One process, the whole batch, torch.optim.AdamW: per step the flattened gradients, then
    the parameters and the flattened state after the step."""
    module = build(case, case["seed"])
    opt = torch.optim.AdamW(module.parameters(), **ADAMW)
    named = dict(module.named_parameters())
    out = []
    for x, y in problem(case):
        F.mse_loss(module(x), y).backward()
        grads = {n: detached(q.grad).reshape(-1) for n, q in named.items()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = {
            n: {k: detached(opt.state[q][k]).reshape(-1) for k in STATE} for n, q in named.items()
        }
        out.append(
            {
                "grads": grads,
                "parameters": {n: detached(q) for n, q in named.items()},
                "state": state,
            }
        )
    return out


def judge_parameters(case: dict, outputs: list) -> list[Problem]:
    problems = []
    for k, want in enumerate(reference(case)):
        for r, o in enumerate(outputs):
            got = o["steps"][k]["parameters"]
            pairs = {
                f"rank {r} after step {k}: {name}": (got.get(name), w)
                for name, w in want["parameters"].items()
            }
            problems += compare_all(pairs, RTOL, ATOL)
        for name in want["parameters"]:
            tensors = [o["steps"][k]["parameters"].get(name) for o in outputs]
            problems += same_on_every_rank(f"after step {k}: {name}", tensors)
    return problems


def judge_gradients(case: dict, outputs: list) -> list[Problem]:
    """Each piece against the averaged gradient's slice; stages 2-3: each element on one rank."""
    problems = []
    for k, want in enumerate(reference(case)):
        held = [o["steps"][k]["gradients"] for o in outputs]
        what = f"step {k} gradient"
        problems += coverage(what, held, want["grads"], exactly_once=case["stage"] >= 2)
        for r, found in enumerate(held):
            problems += compare_pieces(f"rank {r} {what}", found, want["grads"])
    return problems


def judge_state(case: dict, outputs: list) -> list[Problem]:
    """Each piece's exp_avg and exp_avg_sq against the slice of one process's; each element's
    state on exactly one rank."""
    problems = []
    for k, want in enumerate(reference(case)):
        held = [o["steps"][k]["state"] for o in outputs]
        problems += coverage(f"after step {k} optimizer state of", held, want["grads"], True)
        for r, found in enumerate(held):
            for key in STATE:
                values = [(name, lo, hi, state.get(key)) for name, lo, hi, state in found]
                wanted = {name: state[key] for name, state in want["state"].items()}
                problems += compare_pieces(f"rank {r} after step {k} {key}", values, wanted)
    return problems


def compare_pieces(label: str, found: list, want: dict) -> list[Problem]:
    """Each piece (name, lo, hi, values) against want[name][lo:hi] (want: name -> flattened
    tensor); a piece of no parameter, or outside it, is coverage()'s to report."""
    pairs = {
        f"{label} {name}[{lo}:{hi}]": (values, want[name][lo:hi])
        for name, lo, hi, values in found
        if name in want and 0 <= lo <= hi <= want[name].numel()
    }
    return compare_all(pairs, RTOL, ATOL)


def coverage(what: str, held: list, sizes: dict, exactly_once: bool) -> list[Problem]:
    """[] if the ranks' pieces (held[r]: (name, lo, hi, _)) cover every element of every
    parameter (sizes: name -> flattened tensor) exactly once (else: at least once)."""
    problems = []
    owners = {name: [[] for _ in range(t.numel())] for name, t in sizes.items()}
    for r, found in enumerate(held):
        for name, lo, hi, _ in found:
            if name not in owners:
                problems.append(Problem(f"rank {r} {what} {name!r}: no such parameter"))
            elif not 0 <= lo <= hi <= len(owners[name]):
                n = len(owners[name])
                problems.append(Problem(f"rank {r} {what} {name}[{lo}:{hi}]: outside 0..{n}"))
            else:
                for e in range(lo, hi):
                    owners[name][e].append(r)
    for name, by_element in owners.items():
        for e, ranks in enumerate(by_element):
            if not ranks or (exactly_once and len(ranks) > 1):
                once = "exactly one rank" if exactly_once else "some rank"
                text = f"{what} {name}: element {e} is held by ranks {ranks}, not by {once}"
                problems.append(Problem(text))
                break  # one element a parameter says enough
    return problems


def formula(stage: int, numel: int, p: int) -> dict[str, float]:
    """The paper's bytes per rank for numel float64 elements and AdamW (K = 2 b)."""
    full = numel * B
    shard = full / p
    return {
        "params": shard if stage >= 3 else full,
        "grads": shard if stage >= 2 else full,
        "optimizer": 2 * shard,
    }


def judge_memory(case: dict, outputs: list) -> list[Problem]:
    numel = sum(q.numel() for q in build(case, 0).parameters())
    allowed = formula(case["stage"], numel, case["p"])
    problems = []
    for r, o in enumerate(outputs):
        samples = [s for step in o["steps"] for s in step.values()]
        for kind in KINDS:
            if any(kind not in s for s in samples):
                problems.append(Problem(f"rank {r} {kind}: zero_memory did not say"))
                continue
            most = max(s[kind] for s in samples)
            if most > allowed[kind]:
                text = (
                    f"rank {r} {kind}: {most} bytes held, the formula allows "
                    f"{allowed[kind]:g} (stage {case['stage']}, Psi={numel}, p={case['p']})"
                )
                problems.append(Problem(text, most - allowed[kind]))
    return problems


def mlp_cases(stage: int):
    def cases(max_p: int):
        return st.fixed_dictionaries(
            {
                "p": st.integers(1, max_p),
                "d": st.integers(1, 5),
                "h": st.integers(1, 6),
                "b": st.integers(1, 3),
                "steps": st.integers(1, 3),
                "seed": st.integers(0, 10**6),
                "stage": st.just(stage),
                "model": st.just("mlp"),
            }
        )

    return cases


def mlp_hard(stage: int) -> tuple:
    """One rank; three ranks and sizes that do not divide by 3; eight ranks and a model of 6
    elements (some shards all padding)."""
    base = {"b": 2, "steps": 3, "stage": stage, "model": "mlp"}
    return (
        base | {"p": 1, "d": 3, "h": 4, "seed": 11},
        base | {"p": 3, "d": 2, "h": 5, "seed": 12},
        base | {"p": 8, "d": 1, "h": 1, "b": 1, "seed": 13},
    )


def even_cases(stage: int):
    def cases(max_p: int):
        return st.integers(1, max_p).flatmap(
            lambda p: st.fixed_dictionaries(
                {
                    "p": st.just(p),
                    "w": st.sampled_from([p, 2 * p]),
                    "L": st.sampled_from([p, 2 * p]),
                    "b": st.integers(1, 2),
                    "steps": st.just(2),
                    "seed": st.integers(0, 10**6),
                    "stage": st.just(stage),
                    "model": st.just("even"),
                }
            )
        )

    return cases


def even_hard(stage: int) -> tuple:
    base = {"b": 1, "steps": 2, "stage": stage, "model": "even"}
    # (p, w, L): one rank and two 1-element layers; 3 layers of (3, 3); 4 layers of (8, 8)
    sizes = [(1, 1, 2), (3, 3, 3), (4, 8, 4)]
    return tuple(base | {"p": p, "w": w, "L": L, "seed": 20 + p} for p, w, L in sizes)


def stage_checks(stage: int) -> list[Check]:
    s = f"stage{stage}"
    sharded = "pieces cover each element once" if stage >= 2 else "every element covered"
    return [
        Check(
            "zero",
            f"{s}.parameters",
            f"ZeRO-{stage}, 1-3 AdamW steps: every rank's whole parameters equal one process "
            "(1e-12), bitwise alike on every rank",
            ("zero", "zero_step"),
            run_for("parameters"),
            judge_parameters,
            mlp_cases(stage),
            mlp_hard(stage),
        ),
        Check(
            "zero",
            f"{s}.gradients",
            f"ZeRO-{stage}: each rank's gradient pieces equal the averaged gradient's slice "
            f"(1e-12); {sharded}",
            ("zero", "zero_step", "zero_gradients"),
            run_for("gradients"),
            judge_gradients,
            mlp_cases(stage),
            mlp_hard(stage),
        ),
        Check(
            "zero",
            f"{s}.optimizer_state",
            f"ZeRO-{stage}: each rank's exp_avg, exp_avg_sq pieces equal one process's slice "
            "(1e-12); every element's state on exactly one rank",
            ("zero", "zero_step", "zero_optimizer_state"),
            run_for("state"),
            judge_state,
            mlp_cases(stage),
            mlp_hard(stage),
        ),
        Check(
            "zero",
            f"{s}.memory",
            f"ZeRO-{stage}: bytes held at most the paper's formula ({HELD[stage]})",
            ("zero", "zero_step", "zero_memory"),
            run_for("memory"),
            judge_memory,
            even_cases(stage),
            even_hard(stage),
        ),
    ]


CHECKS = [check for stage in (1, 2, 3) for check in stage_checks(stage)]
