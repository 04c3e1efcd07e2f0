"""Pipeline parallelism equals one process on the whole batch, for every schedule, every step.

The model is a list of layers of different widths (so every stage boundary has its own shape):
Linear + Tanh pairs, one Linear with a frozen bias. The test cuts it into p*v contiguous parts
itself (random cut points, not minidist.pipeline.partition's plan), gives part c*p + r to rank r as
chunk c, and compares on every rank: the per-microbatch losses (last stage), every parameter's
gradient and, after an optimizer step, every parameter, against the unpartitioned model trained
on the whole batch with the mean loss. Tolerance: float64, 1e-12 relative (the sum over samples
happens per microbatch, then over microbatches). Partition plans are checked as data (pure).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minidist.comm.wrappers import ObservedComm, Tracer
from minidist.pipeline.draw import add_schedule_command, draw_timeline
from minidist.pipeline.schedules import COMPUTE, bubble_fraction, build_schedules, peak_activations
from minidist.testing import (
    check_all,
    compare,
    impl,
    in_subworlds,
    run_ranks,
    run_threads,
    verdict,
)

RTOL, ATOL = 1e-12, 1e-15  # float64; the sum over the batch happens in another order
NAMES = ("gpipe", "1f1b", "interleaved", "zb")


class Wrapped(nn.Module):
    """A chunk that is not an nn.Sequential: ZB's B/W split treats it as one layer."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def make_layers(widths: list[int], seed: int, device: str = "cpu") -> list[nn.Module]:
    """Linear(widths[k], widths[k+1]) + Tanh for each k; the second Linear's bias is frozen."""
    g = torch.Generator().manual_seed(seed)  # not torch.manual_seed: threads share that RNG
    layers = []
    for a, b in itertools.pairwise(widths):
        linear = nn.Linear(a, b, dtype=torch.float64)
        with torch.no_grad():
            for q in linear.parameters():
                q.copy_(torch.randn(q.shape, generator=g, dtype=q.dtype) * 0.7)
        layers += [linear.to(device), nn.Tanh()]
    if len(layers) > 2:
        layers[2].bias.requires_grad_(False)
    return layers


def cut(n_layers: int, n_parts: int, seed: int) -> list[tuple[int, int]]:
    """n_parts contiguous non-empty runs of range(n_layers), at random cut points."""
    g = torch.Generator().manual_seed(seed)
    inner = sorted((torch.randperm(n_layers - 1, generator=g)[: n_parts - 1] + 1).tolist())
    edges = [0, *inner, n_layers]
    return list(itertools.pairwise(edges))


def make_optimizer(name: str, params: list):
    if not params:  # a stage of only Tanh layers
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def case_widths(case: dict, n_parts: int) -> list[int]:
    """The drawn widths, lengthened (cycling) until there is a layer for every part."""
    widths = list(case["widths"])
    while 2 * (len(widths) - 1) < n_parts:
        widths.append(widths[len(widths) % len(case["widths"])])
    return widths


def same_tensors(step: int, mine: list[int], layers, ref_layers, grads: bool) -> dict:
    """{name: (this rank's tensor, the reference's)}: the gradients or the parameters of the
    layers `mine`; a gradient None on one side only is a problem (a string)."""
    pairs = {}
    for k in mine:
        named = zip(layers[k].named_parameters(), ref_layers[k].parameters(), strict=True)
        for (name, q), q_ref in named:
            key = f"step {step} layer {k} {name}" + (".grad" if grads else "")
            if not grads:
                pairs[key] = (q.detach(), q_ref.detach())
            elif (q.grad is None) != (q_ref.grad is None):
                pairs[key] = f"{key} is None on one side only"
            elif q.grad is not None:
                pairs[key] = (q.grad, q_ref.grad)
    return pairs


def pipeline_matches_single_process(comm, case: dict) -> None:
    """Train the reference and this rank's stage side by side; check after every step."""
    pipe = impl("pipeline.stage")
    name = case["schedule"]
    m = case["m"]
    p = comm.world_size
    r = comm.rank
    v = case["v"] if name == "interleaved" else 1
    try:
        program = build_schedules(name, p, m, v)[r]
    except ValueError as e:  # interleaved needs m a multiple of p: a clear error, no hang
        refused = name == "interleaved" and m % p and f"n_microbatches={m}" in str(e)
        return verdict(comm, bool(refused), f"{case}: refused: {e}")
    widths, device = case_widths(case, p * v), case.get("device", "cpu")  # cuda: the gpu tier
    ref_layers = make_layers(widths, case["seed"], device)
    ref = nn.Sequential(*ref_layers)
    ref_opt = make_optimizer(case["opt"], [q for q in ref.parameters() if q.requires_grad])
    layers = make_layers(widths, case["seed"], device)  # the same weights, a separate copy
    bounds = cut(len(layers), p * v, case["seed"])
    mine = [k for c in range(v) for k in range(*bounds[c * p + r])]  # this rank's layer indices
    parts = [nn.Sequential(*layers[slice(*bounds[c * p + r])]) for c in range(v)]
    chunks = [Wrapped(list(part)) for part in parts] if case["wrap"] else parts
    stage = pipe.PipelineStage(chunks, comm, nn.functional.mse_loss, device=device)
    opt = make_optimizer(
        case["opt"], [q for c in chunks for q in c.parameters() if q.requires_grad]
    )
    g, rows = torch.Generator().manual_seed(case["seed"] + 1), case["rows"]
    for step in range(case["steps"]):
        x = torch.randn(rows * m, widths[0], generator=g, dtype=torch.float64).to(device)
        y = torch.randn(rows * m, widths[-1], generator=g, dtype=torch.float64).to(device)
        out = ref(x)  # (B, d_out), B = rows * m
        ref_losses = list(map(nn.functional.mse_loss, out.split(rows), y.split(rows)))
        nn.functional.mse_loss(out, y).backward()  # the whole batch, the mean loss
        xs, ys = list(x.split(rows)), list(y.split(rows))  # the microbatches, sliced here
        losses = stage.run(program, xs if r == 0 else None, ys if r == p - 1 else None)
        pairs = {
            f"step {step} loss {i}": (a, b.detach())
            for i, (a, b) in enumerate(zip(losses, ref_losses, strict=False))
        }
        pairs |= same_tensors(step, mine, layers, ref_layers, grads=True)
        for optimizer in (opt, ref_opt):
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()
        pairs |= same_tensors(step, mine, layers, ref_layers, grads=False)
        problems = [pair for pair in pairs.values() if isinstance(pair, str)]
        if len(losses) != (m if r == p - 1 else 0):
            problems.append(f"step {step}: {len(losses)} losses on stage {r}")
        verdict(comm, not problems, f"{case}: {problems}")
        tensors = {key: pair for key, pair in pairs.items() if not isinstance(pair, str)}
        check_all(comm, tensors, RTOL, ATOL, context=str(case))


cases = st.fixed_dictionaries(
    {
        "schedule": st.sampled_from(NAMES),
        "m": st.integers(1, 6),
        "v": st.integers(1, 3),
        "widths": st.lists(st.integers(1, 5), min_size=2, max_size=5),
        "rows": st.integers(1, 3),
        "seed": st.integers(0, 10**6),
        "steps": st.integers(1, 3),
        "opt": st.sampled_from(["sgd", "adamw"]),
        "wrap": st.booleans(),
    }
)


@pytest.mark.threads
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), cases)
def test_pipeline_threads(p, case):
    run_threads(pipeline_matches_single_process, p, case)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@settings(max_examples=15, deadline=None)
@given(st.integers(1, 4), cases)
def test_pipeline_threads_cuda(p, case):
    """The threads tier with every tensor on cuda:0 (messages, headers, timeline gathers)."""
    run_threads(pipeline_matches_single_process, p, dict(case, device="cuda"))


def timeline_and_memory(comm, name: str, m: int, v: int) -> dict:
    """One traced step: the gathered timeline, and the measured activation memory."""
    pipe = impl("pipeline.stage")
    p = comm.world_size
    r = comm.rank
    layers = make_layers([3, 4, 5, 4, 3, 4, 2, 3, 2, 4, 3, 2, 1], 0)
    bounds = cut(len(layers), p * v, 0)
    chunks = [nn.Sequential(*layers[slice(*bounds[c * p + r])]) for c in range(v)]
    tracer = Tracer()
    traced = ObservedComm(comm, tracer)  # sends and receives on the trace too
    stage = pipe.PipelineStage(chunks, traced, nn.functional.mse_loss, tracer)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 3, generator=g, dtype=torch.float64) for _ in range(m)]
    ys = [torch.randn(2, 1, generator=g, dtype=torch.float64) for _ in range(m)]
    program = build_schedules(name, p, m, v)[r]
    stage.run(program, xs, ys)
    rows = pipe.measured_timeline(stage)
    return {
        "rows": rows,
        "program": program,
        "peak": stage.memory.peak,
        "bytes_of": set(stage.memory.bytes_of.values()),
        "comm_events": sum(e["tid"] == 0 for e in tracer.events),
    }


def check_timeline(got: list[dict], name: str, m: int, v: int) -> None:
    p = len(got)
    for r, result in enumerate(got):
        assert result["rows"] == got[0]["rows"], f"rank {r} gathered another timeline"
        mine = sorted((row for row in result["rows"] if row[0] == r), key=lambda row: row[1])
        compute = [op for op in result["program"] if op.kind in COMPUTE]
        labels = [
            f"{'FBBW'[COMPUTE.index(op.kind)]}{op.microbatch}" + (f".{op.chunk}" if v > 1 else "")
            for op in compute
        ]
        assert [row[3] for row in mine] == labels, f"stage {r}: spans not in program order"
        assert all(0 <= a <= b for _, a, b, _ in mine)
        sends = sum(op.kind.startswith(("send", "recv")) for op in result["program"])
        assert result["comm_events"] >= sends + 2, "the comm ops are not on the trace"
    assert 0 <= bubble_fraction(got[0]["rows"]) < 1
    if p > 1:
        assert min(row[1] for row in got[0]["rows"]) == 0.0


@pytest.mark.threads
@pytest.mark.parametrize(
    "name, p, m, v",
    [("1f1b", 3, 4, 1), ("interleaved", 2, 4, 2), ("zb", 4, 5, 1), ("gpipe", 1, 2, 1)],
)
def test_measured_timeline_threads(name, p, m, v, tmp_path):
    got = run_threads(timeline_and_memory, p, name, m, v)
    check_timeline(got, name, m, v)
    draw_timeline(got[0]["rows"], str(tmp_path / "measured.png"), name)
    assert (tmp_path / "measured.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.threads
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("p, m", [(1, 3), (3, 2), (3, 5), (4, 6)])
def test_activation_memory_is_the_schedules_count(name, p, m):
    """Measured peak bytes = peak_activations(program) x the bytes of one microbatch: GPipe m,
    1F1B min(p - s, m), ZB-H1 min(p, m) (its B keeps the graph until W)."""
    for r, result in enumerate(run_threads(timeline_and_memory, p, name, m, 1)):
        (per_microbatch,) = result["bytes_of"]  # every microbatch holds the same bytes
        count = peak_activations(result["program"], until_weight=name == "zb")
        assert result["peak"] == count * per_microbatch, (name, p, m, r, result["peak"])


def b_then_w(comm, wrap: bool) -> list[str]:
    """ZB's split on one stage: F then B leave every weight's .grad None; W fills them in."""
    pipe, sch = impl("pipeline.stage"), impl("pipeline.schedules")
    layers, ref = make_layers([3, 4, 2, 2], 0), nn.Sequential(*make_layers([3, 4, 2, 2], 0))
    chunk = Wrapped(layers) if wrap else nn.Sequential(*layers)
    stage = pipe.PipelineStage(chunk, comm, nn.functional.mse_loss)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, generator=g, dtype=torch.float64), torch.zeros(4, 2).double()
    nn.functional.mse_loss(ref(x), y).backward()
    stage.run([sch.Op(sch.FORWARD, 0), sch.Op(sch.BACKWARD_INPUT, 0)], [x], [y])
    problems = [
        f"{name}.grad after B" for name, q in chunk.named_parameters() if q.grad is not None
    ]
    stage.backward_weight(sch.Op(sch.BACKWARD_WEIGHT, 0))
    for (name, q), q_ref in zip(chunk.named_parameters(), ref.parameters(), strict=True):
        problems.append(
            compare(name, q.grad, q_ref.grad, RTOL, ATOL) if q_ref.grad is not None else ""
        )
    return [p for p in problems if p]


@pytest.mark.threads
@pytest.mark.parametrize("wrap", [False, True])
def test_zero_bubble_b_leaves_weights_to_w(wrap):
    assert run_threads(b_then_w, 1, wrap) == [[]]


def bad_run(comm, what: str) -> None:
    pipe = impl("pipeline.stage")
    p = comm.world_size
    r = comm.rank
    layers = make_layers([2, 3, 2], 0)
    chunks = [nn.Sequential(layers[r])] * (2 if what == "chunks" else 1)
    stage = pipe.PipelineStage(chunks, comm, nn.functional.mse_loss)
    xs = [torch.zeros(k + 1 if what == "shapes" else 1, 2, dtype=torch.float64) for k in range(2)]
    ys = [torch.zeros(len(x), 3, dtype=torch.float64) for x in xs]
    program = build_schedules("1f1b", p, 2)[r]
    if what == "op":
        program = [*program, type(program[0])("jump", 0)]  # no kind of the schedules module
    stage.run(program, None if what == "inputs" else xs, ys)


@pytest.mark.threads
@pytest.mark.parametrize(
    "what, error",
    [
        ("inputs", "stage 0 needs the inputs of m=2 microbatches, got None"),
        ("chunks", "the program runs v=1 chunks per stage; this stage has 2"),
        ("shapes", r"microbatch 1 of chunk 0 has output \(2, 3\).*microbatch 0 had \(\(1, 3\)"),
        ("op", r"the program has ops of kinds \['jump'\]; known: \['forward', "),
    ],
)
def test_mistakes_fail_clearly_not_hang(what, error):
    with pytest.raises(AssertionError, match=error):
        run_threads(bad_run, 2, what, timeout=30)


@pytest.mark.pure
def test_fewer_microbatches_than_stages():
    """m < p: GPipe, 1F1B, ZB-H1 run (the threads property tests draw such cases); interleaved
    refuses before any message, naming the numbers."""
    with pytest.raises(ValueError, match="n_microbatches=2 is not a multiple of n_stages=4"):
        build_schedules("interleaved", 4, 2, 2)
    pipe = impl("pipeline.stage")
    with pytest.raises(ValueError, match="batch=10 does not split into n_microbatches=4"):
        pipe.split_microbatches(torch.zeros(10, 3), 4)
    assert [t.shape[0] for t in pipe.split_microbatches(torch.zeros(12, 3), 4)] == [3] * 4


@pytest.mark.pure
def test_lesson_grids_are_the_commands_output():
    """Every `$ minidist schedule ...` block of the lesson's README is that command's output."""
    import argparse
    import contextlib
    import io
    import os
    import re

    readme = os.path.join(os.path.dirname(__file__), "..", "lessons", "06_pipeline", "README.md")
    blocks = re.findall(r"```\n\$ minidist schedule ([^\n]*)\n(.*?)```", open(readme).read(), re.S)
    assert len(blocks) >= 4, "the README lost its schedule grids"
    for argv, shown in blocks:
        parser = argparse.ArgumentParser(prog="minidist")
        add_schedule_command(parser.add_subparsers(dest="command"), impl("pipeline.schedules"))
        args = parser.parse_args(["schedule", *argv.split()])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert args.func(args) == 0
        assert out.getvalue() == shown, f"README block `minidist schedule {argv}` is stale"


# ---- partition plans (pure) -------------------------------------------------------------


def brute_force_best(costs: list[int], k: int) -> int:
    n = len(costs)
    return min(
        max(sum(costs[a:b]) for a, b in itertools.pairwise([0, *cuts, n]))
        for cuts in itertools.combinations(range(1, n), k - 1)
    )


@pytest.mark.pure
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=9), st.data())
def test_balance_is_contiguous_and_optimal(costs, data):
    part = impl("pipeline.partition")
    k = data.draw(st.integers(1, len(costs)))
    bounds = part.balance(costs, k)
    assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == len(costs)
    assert all(lo < hi for lo, hi in bounds), bounds  # none empty
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds)), bounds  # contiguous
    assert max(sum(costs[lo:hi]) for lo, hi in bounds) == brute_force_best(costs, k)


@pytest.mark.pure
def test_partition_plan_by_parameters():
    part = impl("pipeline.partition")
    layers = make_layers([4, 8, 8, 2, 2], 0)  # Linear 40, Tanh, Linear 72, Tanh, 18, -, 6, -
    counts = part.param_counts(layers)
    assert counts == [40, 0, 72, 0, 18, 0, 6, 0]
    plan = part.partition(counts, 2)
    assert plan.bounds == ((0, 1), (1, 8)) and plan.costs == (40.0, 96.0)  # ties: earliest cut
    assert plan.imbalance == 96 / 68
    assert "imbalance (max / mean cost): 1.412" in plan.table()
    interleaved = part.partition(counts, 2, n_chunks=2)  # 4 parts: chunk c of stage s = c*2 + s
    chunks = part.stage_chunks(layers, interleaved, 1, 2)
    lo, hi = interleaved.bounds[1]
    assert len(chunks) == 2 and list(chunks[0]) == layers[lo:hi]
    lo, hi = interleaved.bounds[3]
    assert list(chunks[1]) == layers[lo:hi]
    assert part.partition([0, 0], 2).imbalance == 1.0


@pytest.mark.pure
def test_partition_refuses_impossible_plans():
    part = impl("pipeline.partition")
    with pytest.raises(ValueError, match="3 layers cannot fill 4 parts"):
        part.balance([1, 2, 3], 4)
    with pytest.raises(ValueError, match="non-negative"):
        part.balance([1, -2], 1)
    with pytest.raises(ValueError, match="stage=2 of n_stages=2 does not fit a plan of 4 parts"):
        part.stage_chunks([nn.Identity()] * 4, part.partition([1] * 4, 4), 2, 2)


# ---- processes --------------------------------------------------------------------------


def hard_cases(world: int) -> list[tuple[int, dict]]:
    """The process tier's fixed cases (test_pipeline_threads draws the sweep): each schedule on
    every rank, 5 microbatches (interleaved: 8, a multiple of the stages it needs), uneven
    layers, 2 steps, SGD and AdamW in turn; then 1f1b on 3 stages with fewer microbatches."""
    case = {"v": 2, "widths": [3, 5, 2, 4, 1], "rows": 2, "seed": 11, "steps": 2}
    every = []
    for k, name in enumerate(NAMES):
        m, opt = 8 if name == "interleaved" else 5, ["adamw", "sgd"][k % 2]
        every.append((world, case | {"schedule": name, "m": m, "opt": opt, "wrap": k % 2 == 0}))
    few = case | {"schedule": "1f1b", "m": 2, "opt": "adamw", "wrap": True}
    return [*every, (min(world, 3), few)]


def pipeline_properties_in_ranks(comm, max_examples: int) -> int:
    explicit = hard_cases(comm.world_size)
    count = in_subworlds(comm, pipeline_matches_single_process, cases, max_examples, None, explicit)
    for name in NAMES:  # every schedule once at full size, traced: all_gather works here too
        check_timeline(
            run_in(comm, timeline_and_memory, name, 8, 2),
            name,
            8,
            2 if name == "interleaved" else 1,
        )
    return count


def run_in(comm, fn, name, m, v):
    """fn on every rank of comm, each rank's result gathered to all (as run_threads returns)."""
    v = v if name == "interleaved" else 1
    result = fn(comm, name, m, v)
    return gather_objects(comm, result)


def gather_objects(comm, obj) -> list:
    import pickle

    raw = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = torch.empty(comm.world_size, dtype=torch.int64)
    comm.all_gather(sizes, torch.tensor([raw.numel()]))
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[: raw.numel()] = raw
    every = torch.empty(comm.world_size, int(sizes.max()), dtype=torch.uint8)
    comm.all_gather(every, padded)
    return [pickle.loads(bytes(every[r, : sizes[r]].tolist())) for r in range(comm.world_size)]


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_pipeline_processes(backend):
    cases = len(hard_cases(4))  # and none drawn
    assert run_ranks(pipeline_properties_in_ranks, 4, backend, 0, timeout=240) == [cases] * 4
