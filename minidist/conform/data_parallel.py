"""Conformance checks of the capability "dp": a data-parallel wrapper, restated from
tests/test_data_parallel.py.

Equals: one process training on the whole batch (mean loss over it), when each rank takes an
equal share of every batch: after every step, every gradient (float64, rtol 1e-12, atol 1e-15:
the sum over the batch happens in another order, per rank and then across ranks) and every
parameter after the optimizer step (SGD with momentum or AdamW); the replicas bitwise equal to
each other. Ranks build their models from different seeds: the wrapper must make them equal
(rank 0's parameters and buffers, broadcast at wrap time, compared exactly). Inside no_sync,
each rank's gradient is its own share's, accumulated (nothing communicated). A parameter that no
rank used keeps .grad None; one used on some ranks only is averaged with zeros from the others.
Buckets (data_parallel_buckets, optional): the same for bucket sizes of 1 byte to 1 MiB.
Cases: world sizes 1..6 on threads (1..4 over processes), 1..4 rows per rank, 1..3 steps.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from minidist.conform.checks import Check, Problem, Unavailable, compare, detached

RTOL, ATOL = 1e-12, 1e-15  # float64; the reduction order differs from the single-process sum
F64 = torch.float64


class Net(nn.Module):
    """A small float64 MLP; kind "awkward" adds a tied weight (hidden used twice), a frozen bias,
    a 0-d and a zero-element parameter; kind "branch" a layer used only by samples with
    x[:, 0] > 1 (so unused on some ranks, or on all). A buffer holds the seed."""

    def __init__(self, d: int, h: int, seed: int, kind: str = "plain"):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(d, h, dtype=F64)
        self.hidden = nn.Linear(h, h, dtype=F64)
        self.out = nn.Linear(h, 1, dtype=F64)
        if kind == "awkward":
            self.inp.bias.requires_grad_(False)
            self.scale = nn.Parameter(torch.tensor(1.5, dtype=F64))  # 0-d
            self.empty = nn.Parameter(torch.zeros(0, dtype=F64))  # zero elements
        if kind == "branch":
            self.branch = nn.Linear(h, h, dtype=F64)
        self.register_buffer("seen", torch.full((1,), float(seed), dtype=F64))
        g = torch.Generator().manual_seed(seed)  # not torch.manual_seed: thread-ranks share it
        with torch.no_grad():
            for q in self.parameters():
                q.copy_(torch.randn(q.shape, generator=g, dtype=F64) * 0.5)

    def forward(self, x):  # x: (B, d)
        h = torch.tanh(self.hidden(torch.tanh(self.inp(x))))  # (B, h)
        if self.kind == "awkward":
            h = torch.tanh(self.hidden(h))  # the same weight again: its gradient sums both uses
        if self.kind == "branch":
            picked = x[:, 0] > 1.0  # (B,)
            if picked.any():
                h = h + picked[:, None] * self.branch(h)
        y = self.out(h)  # (B, 1)
        if self.kind == "awkward":
            y = y * self.scale + self.empty.sum()
        return y


def problem(case: dict) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The whole batch of every micro-step of every step, from the seed: [step][micro] = (x, y),
    x: (b p, d). For kind "branch": x[:, 0] <= 1 everywhere, except the first row when
    case["used"] (rank 0's): the branch is used on rank 0 alone, or nowhere."""
    g = torch.Generator().manual_seed(case["seed"])
    n = case["b"] * case["p"]
    steps = []
    for _ in range(case["steps"]):
        micro = []
        for _ in range(case["accum"]):
            x = torch.randn(n, case["d"], generator=g, dtype=F64)  # (n, d)
            if case["kind"] == "branch":
                x[:, 0] = -1.0
                x[0, 0] = 2.0 if case["used"] else -1.0  # rank 0's first row, or none
            micro.append((x, torch.randn(n, 1, generator=g, dtype=F64)))  # (n, 1)
        steps.append(micro)
    return steps


def optimizer(name: str, model: nn.Module):
    params = [q for q in model.parameters() if q.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def grads(model: nn.Module) -> dict:
    return {name: detached(q.grad) for name, q in model.named_parameters()}


def state(model: nn.Module) -> dict:
    return {name: detached(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}


def run_training(rank, case: dict) -> dict:
    """Train this rank's wrapped model on its rows; what it held after wrapping, and after each
    micro-step (inside no_sync), backward and optimizer step."""
    a = rank.adapter
    r = rank.rank
    b = case["b"]
    if case["accum"] > 1 and not hasattr(a, "dp_no_sync"):
        raise Unavailable("accumulation needs dp_no_sync(model)")
    local = Net(case["d"], case["h"], case["seed"] + 1000 * r, case["kind"])  # out of sync
    if "bucket" in case:
        model = a.data_parallel_buckets(rank.comm, local, case["bucket"])
    else:
        model = a.data_parallel(rank.comm, local)
    record = {"after_wrap": state(local), "steps": []}
    opt = optimizer(case["opt"], local)
    for micro_batches in problem(case):
        micro_grads = []
        for j, (x, y) in enumerate(micro_batches):
            last = j == len(micro_batches) - 1
            with contextlib.nullcontext() if last else a.dp_no_sync(model):
                F.mse_loss(model(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]).backward()
            if not last:
                micro_grads.append(grads(local))
        if hasattr(a, "dp_after_backward"):
            a.dp_after_backward(model)
        step = {"micro": micro_grads, "grads": grads(local)}
        opt.step()
        opt.zero_grad(set_to_none=True)
        step["params"] = state(local)
        record["steps"].append(step)
    return record


def reference(case: dict) -> dict:
    """The same training in one process on the whole batch; and each rank's own gradients
    inside no_sync (its rows, accumulated, from the same weights)."""
    p, b = case["p"], case["b"]
    ref = Net(case["d"], case["h"], case["seed"], case["kind"])
    out = {"init": state(ref), "steps": []}
    opt = optimizer(case["opt"], ref)
    for micro_batches in problem(case):
        local = []  # [micro][rank]: the accumulated gradients of rank r's rows alone
        mine = [Net(case["d"], case["h"], case["seed"], case["kind"]) for _ in range(p)]
        for model in mine:
            model.load_state_dict(ref.state_dict())
        for x, y in micro_batches:
            F.mse_loss(ref(x), y).backward()
            for r, model in enumerate(mine):
                F.mse_loss(model(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]).backward()
            local.append([grads(model) for model in mine])
        step = {"local": local, "grads": grads(ref)}
        opt.step()
        opt.zero_grad(set_to_none=True)
        step["params"] = state(ref)
        out["steps"].append(step)
    return out


def compare_named(what: str, got: dict, want: dict, rtol=RTOL, atol=ATOL) -> list[Problem]:
    """Every tensor of `want` by name (None must stay None, and only None may)."""
    problems = []
    for name, w in want.items():
        g = got.get(name)
        if (g is None) != (w is None):
            says = "None" if g is None else "a tensor"
            problems.append(Problem(f"{what} {name}: {says}, one process has {_kind(w)}"))
        elif w is not None:
            found = compare(f"{what} {name}", g, w, rtol, atol)
            problems += [found] if found else []
    return problems


def _kind(t) -> str:
    return "None" if t is None else "a tensor"


def judge_wrap(case: dict, outputs: list) -> list[Problem]:
    want = reference(case)["init"]  # rank 0's model: Net(seed)
    problems = []
    for r, o in enumerate(outputs):
        problems += compare_named(f"rank {r} after wrap:", o["after_wrap"], want, 0.0, 0.0)
    return problems


def judge_gradients(case: dict, outputs: list) -> list[Problem]:
    steps = reference(case)["steps"]
    problems = []
    for r, o in enumerate(outputs):
        for k, (got, want) in enumerate(zip(o["steps"], steps, strict=True)):
            problems += compare_named(f"rank {r} step {k} grad", got["grads"], want["grads"])
    return problems


def judge_training(case: dict, outputs: list) -> list[Problem]:
    steps = reference(case)["steps"]
    problems = []
    for r, o in enumerate(outputs):
        for k, (got, want) in enumerate(zip(o["steps"], steps, strict=True)):
            problems += compare_named(f"rank {r} step {k} grad", got["grads"], want["grads"])
            problems += compare_named(f"rank {r} after step {k}:", got["params"], want["params"])
            mine, first = got["params"], outputs[0]["steps"][k]["params"]
            differ = [n for n in mine if not torch.equal(mine[n], first[n])]
            if differ:
                problems.append(Problem(f"rank {r} after step {k}: {differ} differ from rank 0's"))
    return problems


def judge_no_sync(case: dict, outputs: list) -> list[Problem]:
    steps = reference(case)["steps"]
    problems = []
    for r, o in enumerate(outputs):
        for k, (got, want) in enumerate(zip(o["steps"], steps, strict=True)):
            for j, micro in enumerate(got["micro"]):
                what = f"rank {r} step {k} inside no_sync (micro-step {j}) grad"
                problems += compare_named(what, micro, want["local"][j][r])
            problems += compare_named(f"rank {r} step {k} grad", got["grads"], want["grads"])
    return problems


def cases_of(kind: str, steps=(1, 1), accum=(1, 1), opts=("sgd",), max_world: int = 6):
    def cases(max_p: int):
        return st.fixed_dictionaries(
            {
                "p": st.integers(1, min(max_p, max_world)),
                "d": st.integers(1, 5),
                "h": st.integers(1, 6),
                "b": st.integers(1, 4),
                "seed": st.integers(0, 10**6),
                "steps": st.integers(*steps),
                "accum": st.integers(*accum),
                "opt": st.sampled_from(opts),
                "kind": st.just(kind),
                **({"used": st.booleans()} if kind == "branch" else {}),
            }
        )

    return cases


def fixed(kind: str, **changes) -> tuple:
    """Hard cases: one rank, one row per rank, an odd world, four ranks."""
    base = {"d": 3, "h": 4, "b": 1, "seed": 5, "steps": 1, "accum": 1, "opt": "sgd"}
    worlds = [(1, 2), (2, 1), (3, 2), (4, 1)]
    return tuple(
        base
        | {"p": p, "b": b, "seed": 5 + i, "kind": kind}
        | ({"used": i % 2 == 0} if kind == "branch" else {})
        | changes
        for i, (p, b) in enumerate(worlds)
    )


def bucket_cases(max_p: int):
    """The awkward and branch models under buckets of 1 byte (one a parameter) to 1 MiB (one
    for all), so their edges fall between and around every kind of parameter."""
    sizes = st.sampled_from([1, 8, 24, 64, 200, 1 << 20])
    one_of = st.one_of(
        cases_of("awkward", steps=(1, 2), opts=("sgd", "adamw"))(max_p),
        cases_of("branch")(max_p),
    )
    return st.tuples(one_of, sizes).map(lambda c: c[0] | {"bucket": c[1]})


HARD_BUCKETS = [1, 24, 64, 1 << 20] * 2  # one per fixed case below: awkward's 4, branch's 4
BUCKETS = tuple(
    case | {"bucket": bucket}
    for case, bucket in zip(fixed("awkward", steps=2) + fixed("branch"), HARD_BUCKETS, strict=True)
)
NEEDS = ("data_parallel",)
CHECKS = [
    Check(
        "dp",
        "broadcast_at_wrap",
        "after data_parallel(): every rank holds rank 0's parameters and buffers, exactly",
        NEEDS,
        run_training,
        judge_wrap,
        cases_of("plain"),
        fixed("plain"),
    ),
    Check(
        "dp",
        "gradients",
        "after backward: every gradient equals one process on the whole batch (1e-12)",
        NEEDS,
        run_training,
        judge_gradients,
        cases_of("plain"),
        fixed("plain"),
    ),
    Check(
        "dp",
        "training",
        "1-3 steps of SGD or AdamW: gradients and parameters equal one process (1e-12), "
        "replicas bitwise equal",
        NEEDS,
        run_training,
        judge_training,
        cases_of("plain", steps=(1, 3), opts=("sgd", "adamw")),
        fixed("plain", steps=2, opt="adamw"),
    ),
    Check(
        "dp",
        "no_sync",
        "inside dp_no_sync each rank keeps its own accumulated gradient; the step that syncs "
        "equals one process on every micro-batch (1e-12)",
        (*NEEDS, "dp_no_sync"),
        run_training,
        judge_no_sync,
        cases_of("plain", steps=(1, 2), accum=(2, 3)),
        fixed("plain", accum=3),
    ),
    Check(
        "dp",
        "unused_parameters",
        "a parameter no rank used keeps grad None; one used on rank 0 only is averaged (1e-12)",
        NEEDS,
        run_training,
        judge_gradients,
        cases_of("branch"),
        fixed("branch"),
    ),
    Check(
        "dp",
        "awkward_parameters",
        "a tied weight, a frozen bias, a 0-d and an empty parameter: gradients and 2 steps as "
        "one process (1e-12)",
        NEEDS,
        run_training,
        judge_training,
        cases_of("awkward", steps=(1, 2), opts=("sgd", "adamw")),
        fixed("awkward", steps=2),
    ),
    Check(
        "dp",
        "bucket_sizes",
        "data_parallel_buckets with buckets of 1 byte to 1 MiB: the awkward and branch models' "
        "gradients and steps as one process (1e-12), replicas bitwise equal",
        ("data_parallel_buckets",),
        run_training,
        judge_training,
        bucket_cases,
        BUCKETS,
    ),
]
