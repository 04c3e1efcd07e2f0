"""ZeRO-1/2/3 equal one process on the whole batch, on every rank, after every step; each rank's
optimizer state is the matching slice of that process's state; the bytes held and sent are the
paper's formulas; a consolidated state re-loads into another world size and stage.

The model has every awkward part at once: a frozen bias, a Linear used twice (a tied weight), a
branch unused on some steps (on every rank alike, or, for ZeRO-1/2, on some ranks only, chosen by
the data: ZeRO-3 needs every rank to run the same modules), a 0-d and a zero-element parameter,
a buffer, and sizes that rarely divide by p (uneven shards, boundaries inside parameters). Ranks
start out of sync: the wrapper must make them equal. Tolerance: float64, 1e-12 relative (the
batch is summed in another order: per rank, then across ranks).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minidist.comm.wrappers import Counter, ObservedComm
from minidist.mixed_precision.amp import BF16, FP16, FP32, LossScaler, Precision
from minidist.testing import check_all, impl, run_ranks, run_threads, verdict

RTOL, ATOL = 1e-12, 1e-15  # float64; reduction order differs from the single-process sum
F64 = Precision(torch.float64, torch.float64, torch.float64)  # mixed precision, exactly
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


class Net(nn.Module):
    def __init__(self, d: int, h: int, seed: int, device="cpu"):
        super().__init__()
        kw = {"dtype": torch.float64, "device": device}
        self.inp = nn.Linear(d, h, **kw)
        self.inp.bias.requires_grad_(False)  # frozen
        self.hidden = nn.Linear(h, h, **kw)  # used twice: a tied weight
        self.branch = nn.Linear(h, h, **kw)  # used on some steps / by some samples only
        self.out = nn.Linear(h, 1, **kw)
        self.scale = nn.Parameter(torch.tensor(1.5, **kw))  # 0-d
        self.empty = nn.Parameter(torch.zeros(0, **kw))  # zero elements
        self.register_buffer("seen", torch.full((1,), float(seed), **kw))
        g = torch.Generator().manual_seed(seed)  # not torch.manual_seed: threads share that RNG
        with torch.no_grad():
            for q in self.parameters():
                q.copy_(torch.randn(q.shape, generator=g, dtype=q.dtype) * 0.5)

    def forward(self, x, branch: bool | None):  # x: (B, d); branch None: by the data
        h = torch.tanh(self.hidden(torch.tanh(self.hidden(torch.tanh(self.inp(x))))))
        picked = x[:, 0] > 1.0 if branch is None else torch.full_like(x[:, 0], branch).bool()
        if picked.any():
            h = h + picked[:, None] * self.branch(h)
        return self.out(h) * self.scale + self.empty.sum()  # (B, 1)


def batches(d: int, sizes: list[int], seed: int, accum: int, device="cpu"):
    """The whole problem from one seed: per step, accum global micro-batches (x, y)."""
    g = torch.Generator().manual_seed(seed)

    def pair(n):
        x = torch.randn(n, d, generator=g, dtype=torch.float64)  # (n, d)
        return x.to(device), torch.randn(n, 1, generator=g, dtype=torch.float64).to(device)

    return [[pair(n) for _ in range(accum)] for n in sizes]


def options(case: dict, model: Net) -> dict:
    opts = {"algorithm": case["algorithm"]}
    if case["stage"] < 3:
        opts["bucket_bytes"] = case["bucket_bytes"]
    elif case["units"] == "blocks":
        opts["units"] = [model.hidden, model.out]  # the root takes the other parameters
    return opts


def branch_at(case: dict, step: int) -> bool | None:
    return None if case["branch"] == "data" else step % 2 == 0


def reference_step(ref, ref_opt, micro, branch, clip, skip=False) -> torch.Tensor | None:
    """One step of the single process on the whole batch (no update if skip); the gradient
    norm if clipping."""
    for x, y in micro:
        nn.functional.mse_loss(ref(x, branch), y).backward()
    norm = None
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(
            [q for q in ref.parameters() if q.requires_grad], clip
        )
    if not skip:
        ref_opt.step()
    ref_opt.zero_grad()
    return norm


def train_step(z, ref, ref_opt, micro, case, step, r, b) -> dict:
    """One step of the ZeRO model and of the reference; the pairs to compare."""
    branch, pairs = branch_at(case, step), {}
    for x, y in micro:
        lo, hi = r * b, (r + 1) * b  # this rank's rows, sliced here, not by the module
        loss = nn.functional.mse_loss(z(x[lo:hi], branch), y[lo:hi])
        if case.get("mixed"):
            z.backward(loss)  # the loss times the scale
        else:
            loss.backward()
        z.finish_gradient_sync()  # accumulation: the shards add up
    norm = z.clip_grad_norm_(case["clip"]) if case["clip"] is not None else None
    z.step()
    z.zero_grad()
    ref_norm = reference_step(ref, ref_opt, micro, branch, case["clip"])
    if norm is not None:
        pairs[f"step {step} norm"] = (norm, ref_norm)
    return pairs


def parameter_pairs(z, ref, step: int) -> dict:
    """Every parameter and buffer, whole (gathered for ZeRO-3), against the reference."""
    with z.gathered():
        mine = {n: t.detach().clone() for n, t in z.module.state_dict().items()}
    return {f"step {step} {n}": (mine[n], t) for n, t in ref.state_dict().items()}


def state_pairs(z, ref, ref_opt, step: int) -> dict:
    """This rank's optimizer state, piece by piece, against the slice of the reference's."""
    named, pairs = dict(ref.named_parameters()), {}
    for name, lo, hi, t in z.shard_pieces():
        mine, want = z.optimizer.state.get(t, {}), ref_opt.state.get(named[name], {})
        for key in set(mine) | set(want):
            got, exp = mine.get(key, torch.empty(0)), want.get(key, torch.empty(0))
            if key != "step" and key in want:  # elementwise: the slice this piece holds
                exp = exp.reshape(-1)[lo:hi]
            pairs[f"step {step} state[{name}][{key}][{lo}:{hi}]"] = (got, exp)
    return pairs


def check_replicas_identical(comm, z, step: int) -> None:
    """Every rank's whole parameters, bit for bit, equal rank 0's."""
    with z.gathered():
        flat = torch.cat([q.detach().reshape(-1) for q in z.module.parameters()])
    rows = torch.empty(comm.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
    comm.all_gather(rows, flat)
    rows = rows.view(comm.world_size, -1)
    differ = [q for q in range(comm.world_size) if not torch.equal(rows[q], rows[0])]
    verdict(comm, not differ, f"step {step}: ranks {differ} differ from rank 0 bitwise")


def zero_matches_single_process(comm, case: dict, device="cpu") -> list:
    """Train the reference and the ZeRO model side by side; check after every step."""
    zero_mod = impl("zero.stages")
    d = case["d"]
    h = case["h"]
    b = case["b"]
    seed = case["seed"]
    p, r = comm.world_size, comm.rank
    data = batches(d, [b * p] * case["steps"], seed, case["accum"], device)
    ref = Net(d, h, seed, device)
    opt_cls, kwargs = OPTIMIZERS[case["opt"]]
    ref_opt = opt_cls([q for q in ref.parameters() if q.requires_grad], **kwargs)
    local = Net(d, h, seed + 1000 * r, device)  # ranks start out of sync on purpose
    z = zero_mod.wrap(local, comm, opt_cls, case["stage"], kwargs, **options(case, local))
    for step in range(case["steps"]):
        pairs = train_step(z, ref, ref_opt, data[step], case, step, r, b)
        pairs |= parameter_pairs(z, ref, step) | state_pairs(z, ref, ref_opt, step)
        check_all(comm, pairs, RTOL, ATOL, context=str(case))
        check_replicas_identical(comm, z, step)
    return [(name, lo, hi) for name, lo, hi, _ in z.shard_pieces()]


cases = st.fixed_dictionaries(
    {
        "d": st.integers(1, 4),
        "h": st.integers(1, 5),
        "b": st.integers(1, 3),
        "seed": st.integers(0, 10**6),
        "steps": st.integers(1, 3),
        "accum": st.integers(1, 2),
        "stage": st.sampled_from([1, 2, 3]),
        "opt": st.sampled_from(list(OPTIMIZERS)),
        "algorithm": st.sampled_from(["library", "ring"]),
        # one unit, one parameter a unit, a few, and everything in one bucket
        "bucket_bytes": st.sampled_from([None, 1, 8 * 5, 1 << 20]),
        "units": st.sampled_from(["modules", "blocks"]),
        "branch": st.sampled_from(["data", "step"]),
        "clip": st.sampled_from([None, 0.05, 100.0]),  # clips hard, never clips
    }
).filter(lambda c: c["stage"] < 3 or c["branch"] == "step")  # ZeRO-3: same modules everywhere


def check_pieces_tile(case: dict, pieces_by_rank: list) -> None:
    """Across ranks, the pieces cover each trainable parameter's elements exactly once."""
    sizes = {n: q.numel() for n, q in Net(case["d"], case["h"], 0).named_parameters()}
    got: dict[str, list] = {}
    for pieces in pieces_by_rank:
        for name, lo, hi in pieces:
            got.setdefault(name, []).append((lo, hi))
    for name, ranges in got.items():
        ranges.sort()
        ends = [0] + [hi for _, hi in ranges]
        assert [lo for lo, _ in ranges] == ends[:-1] and ends[-1] == sizes[name], (name, ranges)
    assert set(got) == {n for n, s in sizes.items() if s > 0 and n != "inp.bias"}


@pytest.mark.threads
@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), cases)
def test_zero_threads(p, case):
    check_pieces_tile(case, run_threads(zero_matches_single_process, p, case))


SMALL = {"d": 3, "h": 4, "b": 2, "seed": 7, "steps": 2, "accum": 1, "opt": "adamw"}
SMALL |= {"algorithm": "library", "bucket_bytes": 8 * 5, "units": "modules", "branch": "step"}


@pytest.mark.threads
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_small_threads(stage):
    """One fixed case per stage (the quick probe the labs use)."""
    case = dict(SMALL, stage=stage, clip=None)
    check_pieces_tile(case, run_threads(zero_matches_single_process, 3, case))


@pytest.mark.threads
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_small_threads_clip_by_the_global_norm(stage):
    """The same with clipping that bites (lab 07.3): the norm over every rank's shard."""
    case = dict(SMALL, stage=stage, clip=0.05)
    check_pieces_tile(case, run_threads(zero_matches_single_process, 3, case))


# ---- mixed precision inside ZeRO ----------------------------------------------------------


def poisoned(case: dict, p: int) -> set[int]:
    """The step that case["inject"] = (step, rank, microbatch) poisons, if it hits one."""
    step, rank, micro = case["inject"]
    return {step} if step < case["steps"] and rank < p and micro < case["accum"] else set()


def mixed_step(z, ref, ref_opt, micro, case, step, comm, b) -> tuple[dict, bool]:
    """One step of mixed-precision ZeRO (the loss scaled; on the injected rank and microbatch,
    times inf) and of the reference, which skips the poisoned step; the pairs, and stepped."""
    branch, r = branch_at(case, step), comm.rank
    for i, (x, y) in enumerate(micro):
        loss = nn.functional.mse_loss(z(x[r * b : (r + 1) * b], branch), y[r * b : (r + 1) * b])
        poison = (step, r, i) == tuple(case["inject"])
        z.backward(loss * math.inf if poison else loss)  # inf/nan gradients on one rank
        z.finish_gradient_sync()
    norm = z.clip_grad_norm_(case["clip"]) if case["clip"] is not None else None
    stepped = z.step()
    z.zero_grad()
    skip = step in poisoned(case, comm.world_size)
    ref_norm = reference_step(ref, ref_opt, micro, branch, case["clip"], skip)
    pairs = {} if norm is None or skip else {f"step {step} norm": (norm, ref_norm)}
    return pairs, stepped


def next_scale(scale: float, clean: int, overflowed: bool, interval: int) -> tuple[float, int]:
    """The scale and the count of clean steps after a step: the schedule, written out."""
    if overflowed:
        return scale / 2, 0
    if clean + 1 == interval:
        return scale * 2, 0
    return scale, clean + 1


def master_pairs(z, ref, step: int) -> dict:
    """This rank's master pieces against the slice of the reference's parameters."""
    named = dict(ref.named_parameters())
    return {
        f"step {step} master {name}[{lo}:{hi}]": (t, named[name].detach().reshape(-1)[lo:hi])
        for name, lo, hi, t in z.shard_pieces()
    }


def zero_mixed_matches_single_process(comm, case: dict, device="cpu") -> list[int]:
    """Mixed precision inside ZeRO with every dtype float64 and a dynamic power-of-two loss
    scale equals plain float64 training on the whole batch that skips the same steps: every
    parameter, master, optimizer state and the scale, on every rank, after every step."""
    zero_mod = impl("zero.stages")
    d = case["d"]
    h = case["h"]
    b = case["b"]
    seed = case["seed"]
    p = comm.world_size
    r = comm.rank
    data = batches(d, [b * p] * case["steps"], seed, case["accum"], device)
    ref = Net(d, h, seed, device)
    opt_cls, kwargs = OPTIMIZERS[case["opt"]]
    ref_opt = opt_cls([q for q in ref.parameters() if q.requires_grad], **kwargs)
    local = Net(d, h, seed + 1000 * r, device)  # ranks start out of sync on purpose
    scale = 2.0 ** case["log_scale"]
    clean = 0
    skipped = poisoned(case, p)
    problems = []
    scaler = LossScaler(scale, growth_interval=case["interval"])
    opts = options(case, local) | {"scaler": scaler}
    opts |= {"precision": F64} if case["masters"] else {}  # else loss scaling alone
    z = zero_mod.wrap(local, comm, opt_cls, case["stage"], kwargs, **opts)
    for step in range(case["steps"]):
        pairs, stepped = mixed_step(z, ref, ref_opt, data[step], case, step, comm, b)
        pairs |= parameter_pairs(z, ref, step) | state_pairs(z, ref, ref_opt, step)
        check_all(comm, pairs | master_pairs(z, ref, step), RTOL, ATOL, context=str(case))
        check_replicas_identical(comm, z, step)
        scale, clean = next_scale(scale, clean, step in skipped, case["interval"])
        if (z.scaler.scale, stepped) != (scale, step not in skipped):
            problems.append(f"step {step}: scale {z.scaler.scale} (want {scale}), {stepped=}")
    if z.skipped != sorted(skipped):
        problems.append(f"skipped {z.skipped}, want {sorted(skipped)}")
    verdict(comm, not problems, f"{case}: " + "; ".join(problems))
    return z.skipped


mixed_cases = st.fixed_dictionaries(
    {
        "d": st.integers(1, 4),
        "h": st.integers(1, 5),
        "b": st.integers(1, 3),
        "seed": st.integers(0, 10**6),
        "steps": st.integers(1, 4),
        "accum": st.integers(1, 3),
        "stage": st.sampled_from([1, 2, 3]),
        "opt": st.sampled_from(list(OPTIMIZERS)),
        "algorithm": st.sampled_from(["library", "ring"]),
        "bucket_bytes": st.sampled_from([None, 1, 8 * 5]),
        "units": st.sampled_from(["modules", "blocks"]),
        "branch": st.sampled_from(["data", "step"]),
        "clip": st.sampled_from([None, 0.05]),
        "log_scale": st.integers(-3, 24),
        "interval": st.integers(1, 3),
        "inject": st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 2)),  # may miss
        "masters": st.booleans(),  # precision=F64 (master shards), or a scaler alone
    }
).filter(lambda c: c["stage"] < 3 or c["branch"] == "step")


@pytest.mark.threads
@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), mixed_cases)
def test_zero_mixed_precision_float64_equals_one_process_threads(p, case):
    skipped = run_threads(zero_mixed_matches_single_process, p, case)
    assert all(s == skipped[0] for s in skipped), skipped  # every rank skipped the same steps


MIXED_SMALL = dict(SMALL, accum=2, steps=4, clip=0.05, log_scale=10, interval=2, inject=(1, 2, 1))
MIXED_SMALL |= {"masters": True}


@pytest.mark.threads
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_mixed_precision_overflow_skips_on_every_rank_threads(stage):
    """Rank 2's second microbatch of step 1 overflows: all 3 ranks skip step 1, the scale
    halves (2^10 -> 2^9), then two clean steps double it back; training equals one process."""
    case = dict(MIXED_SMALL, stage=stage)
    assert run_threads(zero_mixed_matches_single_process, 3, case) == [[1]] * 3


def small_mlp(seed: int, steps: int) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """tests/test_amp.py's tolerance problem: a 16-32-32-1 MLP, float32, and per step a batch
    x: (steps, 32, 16), y: (steps, 32, 1)."""
    g = torch.Generator().manual_seed(seed)  # skip_init: no global RNG (threads share it)
    sizes = [(16, 32), (32, 32), (32, 1)]
    layers = [torch.nn.utils.skip_init(nn.Linear, i, o) for i, o in sizes]
    model = nn.Sequential(layers[0], nn.GELU(), layers[1], nn.GELU(), layers[2])
    with torch.no_grad():
        for q in model.parameters():
            q.copy_(torch.randn(q.shape, generator=g) * 0.3)
    x = torch.randn(steps, 32, 16, generator=g)  # (steps, B, d)
    return model, x, torch.sin(2 * x[..., :1]) + x[..., 1:2]  # y: (steps, B, 1)


LOW = {  # the precision, its loss scaler, and its unit roundoff u
    "fp32": (FP32, None, 2.0**-24),
    "bf16": (BF16, None, 2.0**-8),
    "fp16": (FP16, (2.0**10, 10**6), 2.0**-11),  # a scale that never overflows here
    "bf16-reduce": (Precision(torch.bfloat16, torch.float32, torch.bfloat16), None, 2.0**-8),
}


def zero_low_precision(comm, stage: int, name: str, seed: int, steps=30, device="cpu") -> dict:
    """ZeRO in a low precision on the small MLP, AdamW: the global loss of every step, and on
    rank 0 the final masters, consolidated; the model's dtype and the skipped steps."""
    precision, scale, _ = LOW[name]
    scaler = None if scale is None else LossScaler(scale[0], growth_interval=scale[1])
    model, x, y = small_mlp(seed, steps)
    n = x.shape[1] // comm.world_size  # rows per rank
    lo, hi = comm.rank * n, (comm.rank + 1) * n
    z = impl("zero.stages").wrap(
        model.to(device),
        comm,
        torch.optim.AdamW,
        stage,
        {"lr": 3e-3},
        precision=precision,
        scaler=scaler,
    )
    losses = []
    for step in range(steps):
        loss = nn.functional.mse_loss(
            z(x[step, lo:hi].to(device, precision.compute)).float(), y[step, lo:hi].to(device)
        )
        z.backward(loss)
        z.step()
        z.zero_grad()
        losses.append(comm.all_reduce(loss.detach().reshape(1), "sum").item() / comm.world_size)
    state = z.state_dict()
    check_replicas_identical(comm, z, steps)
    if state is None:
        return {}
    masters = [state["model"][n] for n, _ in model.named_parameters()]
    return {
        "losses": losses,
        "masters": torch.cat([t.reshape(-1) for t in masters]),
        "dtypes": {str(next(model.parameters()).dtype), *(str(t.dtype) for t in masters)},
        "skipped": z.skipped,
    }


def fp32_reference(seed: int, steps=30) -> tuple[list[float], torch.Tensor]:
    """One process, float32, the whole batch: the losses and the final weights."""
    model, x, y = small_mlp(seed, steps)
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    losses = []
    for step in range(steps):
        loss = nn.functional.mse_loss(model(x[step]), y[step])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, torch.cat([q.detach().reshape(-1) for q in model.parameters()])


@pytest.mark.threads
@pytest.mark.parametrize("stage,p", [(1, 4), (2, 2), (3, 4)])
def test_zero_bf16_and_fp16_stay_within_the_documented_tolerance_of_fp32(stage, p):
    """The tolerance tests/test_amp.py documents, u the unit roundoff: every step's loss within
    8u relative of one float32 process, the final masters within 4u (2-norm, relative).
    Measured (seeds 0-9, these stages and world sizes): at most 3.0u and 1.2u. The consolidated
    state holds float32 masters of a bfloat16 / float16 model; fp32 itself agrees to 1e-5."""
    want_losses, want_w = fp32_reference(0)
    for name, (precision, _, u) in LOW.items():
        (got, *_) = run_threads(zero_low_precision, p, stage, name, 0)
        worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want_losses, strict=True))
        drift = ((got["masters"] - want_w).norm() / want_w.norm()).item()
        bound = (1e-5, 1e-5) if name == "fp32" else (8 * u, 4 * u)
        assert worst <= bound[0], f"{name}: loss off by {worst:.3g} relative > {bound[0]:.3g}"
        assert drift <= bound[1], f"{name}: weights off by {drift:.3g} relative > {bound[1]:.3g}"
        assert got["skipped"] == [], got["skipped"]
        want_dtypes = {str(precision.compute), str(precision.master)}
        assert got["dtypes"] == want_dtypes, (name, got["dtypes"])


def counted_mixed_bytes(comm, stage: int, precision) -> dict:
    """Bytes this rank sends (ring collectives: every byte counted) in one step, split at the
    gradient sync: the float32 stack() model under `precision`."""
    counter = Counter()
    c = ObservedComm(comm, counter)
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(1))
    z = impl("zero.stages").wrap(
        stack().float(),
        c,
        torch.optim.Adam,
        stage,
        {"lr": 0.1},
        algorithm="ring",
        precision=precision,
    )
    counter.reset()
    z(x.to(precision.compute)).float().square().sum().backward()
    z.finish_gradient_sync()
    sync = counter.bytes_sent
    z.step()
    return {"sync": sync, "step": counter.bytes_sent - sync}


@pytest.mark.threads
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("p", [2, 4])
def test_mixed_precision_all_gathers_half_the_bytes(stage, p):
    """bfloat16 parameters: the all-gathers send half the bytes of float32; the reduce-scatter
    sends the reduce dtype's bytes (float32 or bfloat16); all as zero_cost.sent_nbytes says."""
    n, flags = LAYERS * WIDTH * WIDTH, 2 * (p - 1) * LAYERS * 4  # float32 flags, all ranks
    sent = {}
    for name, precision in {
        "fp32": FP32,
        "bf16": BF16,
        "bf16-reduce": LOW["bf16-reduce"][0],
    }.items():
        rows = run_threads(counted_mixed_bytes, p, stage, precision)
        sent[name] = {k: sum(row[k] for row in rows) for k in rows[0]}
        b, r = precision.compute.itemsize, precision.reduce.itemsize
        total = sent[name]["sync"] + sent[name]["step"]
        assert total - flags == p * impl("zero.cost").sent_nbytes(stage, n, p, b, r), (name, sent)
    if stage < 3:  # the all-gather is all step() sends
        assert 2 * sent["bf16"]["step"] == sent["fp32"]["step"] == (p - 1) * n * 4, sent
    assert sent["bf16-reduce"]["sync"] - flags == (sent["fp32"]["sync"] - flags) / 2, sent


def two_groups_one_overflow(comm, stage: int, agree_on_world: bool) -> list[int]:
    """Two dp groups, ranks {0, 1} and {2, 3}; rank 3's loss overflows at step 1. Returns the
    steps this rank skipped."""
    dp_comm = comm.split(comm.rank // 2)
    model, scaler = Net(2, 3, seed=comm.rank // 2), LossScaler(4.0)
    overflow_comm = comm if agree_on_world else None  # None: the dp group alone
    z = impl("zero.stages").wrap(
        model,
        dp_comm,
        torch.optim.SGD,
        stage,
        {"lr": 0.1},
        precision=F64,
        scaler=scaler,
        overflow_comm=overflow_comm,
    )
    g = torch.Generator().manual_seed(comm.rank)
    for step in range(3):
        loss = z(torch.randn(2, 2, generator=g, dtype=torch.float64), True).square().mean()
        z.backward(loss * math.inf if (step, comm.rank) == (1, 3) else loss)
        z.step()
        z.zero_grad()
    return z.skipped


@pytest.mark.threads
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overflow_comm_makes_every_group_skip_together(stage):
    """overflow_comm=the world: a 3D job's other stages skip with the group that overflowed;
    by default only that dp group skips."""
    assert run_threads(two_groups_one_overflow, 4, stage, True) == [[1]] * 4
    assert run_threads(two_groups_one_overflow, 4, stage, False) == [[], [], [1], [1]]


# the process tier's fixed cases (the threads tier draws the sweeps), (k, case) on k ranks:
# each stage, both algorithms, buckets of one parameter and of a few, clipping hard, AdamW and
# momentum, accumulation; re-sharding a checkpoint 4 -> 3 and 3 -> 4 ranks across stages;
# mixed precision with a poisoned step, with master shards and with a scaler alone
BASE = {"d": 4, "h": 5, "b": 3, "steps": 2, "units": "modules", "branch": "step"}
HARD = [
    (
        4,
        BASE
        | {
            "seed": 1,
            "accum": 2,
            "stage": 1,
            "opt": "adamw",
            "algorithm": "ring",
            "bucket_bytes": 1,
            "clip": 0.05,
        },
    ),
    (
        3,
        BASE
        | {
            "seed": 2,
            "accum": 1,
            "stage": 2,
            "opt": "momentum",
            "algorithm": "library",
            "bucket_bytes": 8 * 5,
            "clip": None,
            "branch": "data",
        },
    ),
    (
        4,
        BASE
        | {
            "seed": 3,
            "accum": 2,
            "stage": 3,
            "opt": "adam",
            "algorithm": "ring",
            "bucket_bytes": None,
            "clip": 100.0,
            "units": "blocks",
        },
    ),
]
CHECKPOINT_HARD = [
    {
        "ka": 4,
        "kb": 3,
        "sa": 3,
        "sb": 1,
        "k1": 2,
        "k2": 1,
        "d": 3,
        "h": 5,
        "b": 2,
        "seed": 4,
        "opt": "adamw",
        "branch": "step",
        "stage": 3,
    },
    {
        "ka": 3,
        "kb": 4,
        "sa": 2,
        "sb": 3,
        "k1": 1,
        "k2": 2,
        "d": 4,
        "h": 3,
        "b": 1,
        "seed": 5,
        "opt": "momentum",
        "branch": "step",
        "stage": 3,
    },
]
MIXED_HARD = [
    (4, BASE | {"seed": 6, "steps": 4, "accum": 2, "stage": 3, "opt": "adamw",
                "algorithm": "ring", "bucket_bytes": 1, "clip": 0.05, "log_scale": 24,
                "interval": 2, "inject": (1, 2, 1), "masters": True}),
    (3, BASE | {"seed": 7, "steps": 3, "accum": 1, "stage": 2, "opt": "sgd",
                "algorithm": "library", "bucket_bytes": None, "clip": None, "log_scale": -3,
                "interval": 1, "inject": (2, 0, 0), "masters": False}),
]  # fmt: skip


def zero_properties_in_ranks(comm) -> list[int]:
    """Every property (training, checkpoints, mixed precision) in one launch, on its fixed
    cases: processes start slowly."""
    subs = {k: comm.split(int(comm.rank < k)) for k in (3, 4)}
    count = [0, 0, 0]
    for i, (matches, hard) in enumerate(
        [(zero_matches_single_process, HARD), (zero_mixed_matches_single_process, MIXED_HARD)]
    ):
        for k, case in hard:
            count[2 * i] += 1
            if comm.rank < k:
                matches(subs[k], case)
            comm.barrier()
    for case in CHECKPOINT_HARD:
        count[1] += 1
        checkpoint_reshards(comm, case)
    # the other ZeRO test files' properties, in this launch too: processes start slowly
    from test_zero3_units import units_properties_in_ranks
    from test_zero_groups import groups_properties_in_ranks

    count += [units_properties_in_ranks(comm, 2), groups_properties_in_ranks(comm, 1)]
    # real bfloat16 reduce-scatters and all-gathers between processes (MPI has no bfloat16
    # sum: its backend reduces in torch); replicas stay bitwise identical
    got = zero_low_precision(comm, 3, "bf16-reduce", 0, steps=3)
    ok = comm.rank != 0 or (got["skipped"] == [] and all(map(math.isfinite, got["losses"])))
    verdict(comm, ok, f"bfloat16 ZeRO-3: {got}")
    return count


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_zero_processes(backend):
    """Every property of test_zero, test_zero3_units and test_zero_groups, started once."""
    got = run_ranks(zero_properties_in_ranks, 4, backend, timeout=300)
    assert got == [[len(HARD), len(CHECKPOINT_HARD), len(MIXED_HARD), 2, 1]] * 4


# ---- consolidation and re-sharding --------------------------------------------------------


def checkpoint_reshards(comm, case: dict) -> None:
    """Train in world A (ka ranks, stage sa), consolidate on rank 0 and check it against the
    reference; load it into world B (kb ranks, stage sb) and keep training: still equal."""
    zero_mod = impl("zero.stages")
    ka = case["ka"]
    kb = case["kb"]
    k1 = case["k1"]
    k2 = case["k2"]
    b = case["b"]
    d = case["d"]
    h = case["h"]
    seed = case["seed"]
    r = comm.rank
    world_a, world_b = comm.split(int(r < ka)), comm.split(int(r < kb))  # both hold rank 0
    data = batches(d, [b * ka] * k1 + [b * kb] * k2, seed, 1)
    ref = Net(d, h, seed)
    opt_cls, kwargs = OPTIMIZERS[case["opt"]]
    ref_opt = opt_cls([q for q in ref.parameters() if q.requires_grad], **kwargs)
    run = dict(case, accum=1, clip=None, algorithm="library", bucket_bytes=40, units="modules")
    state = None
    if r < ka:
        net, opts = Net(d, h, seed + 1000 * r), mixed_options(case, 8.0)
        za = zero_mod.wrap(net, world_a, opt_cls, case["sa"], kwargs, **opts)
        for step in range(k1):
            train_step(za, ref, ref_opt, data[step], run, step, r, b)
        state = za.state_dict()
        verdict(world_a, (state is None) == (r != 0), "only rank 0 gets the state")
        pairs = {} if r != 0 else consolidated_pairs(state, ref, ref_opt)
        if r == 0 and case.get("mixed"):  # the scale doubled after every step (interval 1)
            pairs["scaler"] = (torch.tensor(state["scaler"]["scale"]), torch.tensor(8.0 * 2**k1))
        check_all(world_a, pairs, RTOL, ATOL, context=f"consolidated {case}")
    else:
        for step in range(k1):  # the reference alone
            reference_step(ref, ref_opt, data[step], branch_at(run, step), None)
    comm.barrier()
    if r < kb:
        net, opts = Net(d, h, seed + 77 + r), mixed_options(case, 1.0)
        zb = zero_mod.wrap(net, world_b, opt_cls, case["sb"], kwargs, **opts)
        zb.load_state_dict(state if r == 0 else None)
        if case.get("mixed"):  # the loaded scale, not the new one's 1.0
            scale = torch.tensor(zb.scaler.scale)
            check_all(world_b, {"loaded scale": (scale, torch.tensor(8.0 * 2**k1))})
        for step in range(k1, k1 + k2):
            pairs = train_step(zb, ref, ref_opt, data[step], run, step, r, b)
            pairs |= parameter_pairs(zb, ref, step) | state_pairs(zb, ref, ref_opt, step)
            check_all(world_b, pairs, RTOL, ATOL, context=f"re-sharded {case}")
    comm.barrier()


def mixed_options(case: dict, init_scale: float) -> dict:
    """Mixed precision in the exact recipe (every dtype float64) with a scale that doubles after
    every step, or nothing."""
    if not case.get("mixed"):
        return {}
    return {"precision": F64, "scaler": LossScaler(init_scale, growth_interval=1)}


def consolidated_pairs(state: dict, ref, ref_opt) -> dict:
    pairs = {f"model {n}": (state["model"][n], t) for n, t in ref.state_dict().items()}
    for name, q in ref.named_parameters():
        if q.requires_grad and q.numel() > 0:  # nothing to step in a zero-element parameter
            want, mine = ref_opt.state.get(q, {}), state["optimizer"].get(name, {})
            for key in set(want) | set(mine):
                empty = torch.empty(0)
                pairs[f"optimizer {name} {key}"] = (mine.get(key, empty), want.get(key, empty))
    return pairs


checkpoint_cases = st.fixed_dictionaries(
    {
        "ka": st.integers(1, 4),
        "kb": st.integers(1, 4),
        "sa": st.sampled_from([1, 2, 3]),
        "sb": st.sampled_from([1, 2, 3]),
        "k1": st.integers(1, 2),
        "k2": st.integers(1, 2),
        "d": st.integers(1, 4),
        "h": st.integers(1, 5),
        "b": st.integers(1, 2),
        "seed": st.integers(0, 10**6),
        "opt": st.sampled_from(["momentum", "adamw"]),
        "branch": st.just("step"),
        "stage": st.just(3),  # for options(): the strictest rules
    }
)


@pytest.mark.threads
@settings(max_examples=10, deadline=None)
@given(checkpoint_cases)
def test_checkpoint_reshards_threads(case):
    run_threads(checkpoint_reshards, max(case["ka"], case["kb"]), case)


@pytest.mark.threads
@settings(max_examples=6, deadline=None)
@given(checkpoint_cases.map(lambda c: c | {"mixed": True}))
def test_checkpoint_carries_masters_and_scaler_threads(case):
    """Mixed precision: the consolidated state holds the masters and the scaler's state; both
    load into another world size and stage, and training goes on equal to one process."""
    run_threads(checkpoint_reshards, max(case["ka"], case["kb"]), case)


# ---- accounting: bytes held and bytes sent ------------------------------------------------

LAYERS, WIDTH = 3, 4  # three 4x4 Linear layers without bias: 48 elements, 16 a unit


def stack() -> nn.Sequential:
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = nn.Linear(WIDTH, WIDTH, bias=False, dtype=torch.float64)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g, dtype=torch.float64))
        layers += [layer, nn.Tanh()]
    return nn.Sequential(*layers)


def whole_now(unit) -> bool:
    return unit.flat.untyped_storage().nbytes() > 0  # ZeRO-3 frees it between uses


def counted_memory(comm, stage: int, precision=None) -> dict:
    """The peak of each kind of model state over a step, sampled between its phases; and for
    ZeRO-3 the most units whole at once during forward. precision: mixed, or None."""
    cost = impl("zero.cost")
    opts = {"bucket_bytes": 1} if stage == 2 else {}  # ZeRO-2: one unit per layer
    opts |= {} if precision is None else {"precision": precision}
    z = impl("zero.stages").wrap(stack(), comm, torch.optim.Adam, stage, {"lr": 0.01}, **opts)
    peak, whole = {}, [0]

    def count_whole(module, args):  # whole, or arriving (a prefetch lands in a buffer of its own)
        now = sum(whole_now(u) or getattr(u, "landing", None) is not None for u in z.units)
        whole[0] = max(whole[0], now)

    for layer in z.module[::2]:  # pre-hooks registered after the wrapper's run after them
        layer.register_forward_pre_hook(count_whole)

    def sample():
        for kind, n in cost.memory_nbytes(z).items():
            peak[kind] = max(peak.get(kind, 0), n)

    for _ in range(2):
        x = torch.randn(2, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        loss = z(x if precision is None else x.to(precision.compute)).square().sum()
        sample()
        loss.backward()
        sample()
        z.finish_gradient_sync()
        sample()
        z.step()
        sample()
        z.zero_grad()
    whole_at_end = sum(whole_now(u) for u in z.units)
    return dict(peak, whole_units=whole[0], whole_at_end=whole_at_end, units=len(z.units))


@pytest.mark.threads
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_bytes_held_are_the_papers_formulas(stage, p):
    want = impl("zero.cost").model_state_nbytes(stage, LAYERS * WIDTH * WIDTH, p, 8, 2)  # Adam: k=2
    for got in run_threads(counted_memory, p, stage):
        assert {k: got[k] for k in want} == want, (got, want)
        if stage == 3:  # the layer being computed and the prefetched next one; none after
            assert got["whole_units"] == min(2, LAYERS) and got["whole_at_end"] == 0, got
        else:  # ZeRO-1/2: the parameters are always whole
            assert got["whole_units"] == got["whole_at_end"] == got["units"], got


@pytest.mark.threads
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_bytes_held_with_mixed_precision_are_the_formulas(stage, p):
    """bfloat16 model, float32 master shard and Adam state and gradient shard: 2 + 2 + 12/p
    bytes per element (ZeRO-1), 2 + 16/p (ZeRO-2), 18/p (ZeRO-3); ZeRO-1's gradients are the
    model's bfloat16 ones until the sync, then the float32 shard (the larger counts)."""
    want = impl("zero.cost").model_state_nbytes(stage, LAYERS * WIDTH * WIDTH, p, 2, 2, m=4)
    for got in run_threads(counted_memory, p, stage, BF16):
        assert {k: got[k] for k in want} == want, (got, want)


def counted_step(comm, stage: int) -> int:
    """Bytes this rank sent in one training step, ring collectives only (every byte counted);
    stage 0 is data_parallel's bucketed all-reduce."""
    counter = Counter()
    c = ObservedComm(comm, counter)
    x = torch.randn(2, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if stage == 0:
        model = impl("data_parallel.wrappers").DataParallelBucketed(stack(), c, 1 << 20, "ring")
        counter.reset()
        model(x).square().sum().backward()
        model.finish_gradient_sync()
    else:
        z = impl("zero.stages").wrap(
            stack(), c, torch.optim.Adam, stage, {"lr": 0.1}, algorithm="ring"
        )
        counter.reset()
        z(x).square().sum().backward()
        z.step()
    return counter.bytes_sent


@pytest.mark.threads
@pytest.mark.parametrize("p", [2, 4])
def test_bytes_sent_equal_data_parallel_and_one_and_a_half_times_for_zero3(p):
    n, flags = LAYERS * WIDTH * WIDTH, 2 * (p - 1) * LAYERS * 8  # flags: one per parameter
    sent = {s: sum(run_threads(counted_step, p, s)) for s in range(4)}
    assert sent[1] == sent[2] == sent[0], sent  # the same P flags ride along in every stage
    assert sent[3] - flags == 1.5 * (sent[0] - flags), sent
    formula = impl("zero.cost").sent_nbytes
    for s in range(4):
        assert sent[s] - flags == p * formula(s, n, p, 8), (s, sent)


@pytest.mark.threads
def test_bench_zero_json_matches_the_formulas(capsys):
    """`minidist bench zero` on thread-ranks, tiny: the counted figures are the formulas, in
    float32 and in bfloat16 mixed precision."""
    import argparse

    from minidist.zero import bench as bench_zero

    parser = argparse.ArgumentParser()
    bench_zero.ZERO.add_parser(parser.add_subparsers())  # as `minidist bench` adds it
    argv = "zero -n 2 --backend threads --layers 2 --width 8 --steps 1 --json".split()
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    rows = [(row["stage"], row["precision"]) for row in result["rows"]]
    assert rows == [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32")] + [
        (s, "bf16") for s in (1, 2, 3)
    ]
    for row in result["rows"]:
        want = bench_zero.formulas(row["stage"], 2 * 8 * 8, 2, 2, row["precision"])
        assert row["held"] == want["held"] and row["sent"] == want["sent"], (row, want)


# ---- pure: the plan, the buckets, the formulas, the refusals -----------------------------


@pytest.mark.pure
def test_partition_tiles_the_padded_buffer():
    zero_mod = impl("zero.stages")

    @settings(max_examples=150, deadline=None)
    @given(st.lists(st.integers(0, 20), max_size=8), st.integers(1, 9))
    def prop(numels, p):
        plan = zero_mod.partition(numels, p)
        S = -(-sum(numels) // p)
        assert plan.shard_numel == S and plan.padded_numel == p * S  # padding < p elements
        starts = [sum(numels[:i]) for i in range(len(numels))]  # independent of the module
        owner = {}  # (tensor, element) -> (rank, place in the shard)
        for r in range(p):
            places = []
            for c in plan.pieces(r):
                assert 0 <= c.lo < c.hi <= numels[c.index], c
                for e in range(c.lo, c.hi):
                    assert (c.index, e) not in owner, ("twice", c)
                    owner[c.index, e] = (r, c.at + e - c.lo)
                    places.append(c.at + e - c.lo)
            assert places == sorted(set(places)) and all(0 <= a < S for a in places), places
        for i, n in enumerate(numels):
            for e in range(n):  # element e of tensor i sits at flat position starts[i] + e
                assert owner.pop((i, e)) == divmod(starts[i] + e, S), (i, e)
        assert not owner

    prop()


@pytest.mark.pure
def test_group_by_bytes_fills_buckets_in_order_and_splits_dtypes():
    zero_mod = impl("zero.stages")
    params = [torch.zeros(n) for n in (3, 1, 4, 1, 5)] + [torch.zeros(2, dtype=torch.float64)]
    groups = zero_mod.group_by_bytes(params, 16)
    assert [[q.numel() for q in g] for g in groups] == [[3, 1], [4], [1, 5], [2]]
    assert len(zero_mod.group_by_bytes(params[:5], None)) == 1


@pytest.mark.pure
def test_formulas():
    cost = impl("zero.cost")
    mixed = [sum(cost.model_state_nbytes(s, 1000, 8, 2, 6).values()) for s in range(4)]
    assert mixed == [16000, 4000 + 1500, 2000 + 250 + 1500, 2000]  # 2+2+12 bytes/element
    assert cost.sent_nbytes(3, 1000, 4, 2) == 1.5 * cost.sent_nbytes(1, 1000, 4, 2) == 4500
    # mixed precision as held here: 2-byte model, 4-byte masters, Adam, gradient shards
    ours = [sum(cost.model_state_nbytes(s, 1000, 8, 2, 2, m=4).values()) for s in range(4)]
    assert ours == [2000 + 6000 + 12000, 4000 + 1500, 2000 + 500 + 1500, 250 + 500 + 1500]
    assert cost.sent_nbytes(1, 1000, 4, 2, 4) == 750 * (2 + 4)  # gather bf16, reduce fp32
    assert cost.sent_nbytes(0, 1000, 4, 2, 4) == 2 * 750 * 4  # an all-reduce of the reduce


@pytest.mark.pure
def test_refusals():
    zero_mod = impl("zero.stages")
    comm = type("C", (), {"rank": 0, "world_size": 1})()
    with pytest.raises(ValueError, match="stage=0 is not 1, 2 or 3"):
        zero_mod.wrap(stack(), comm, torch.optim.SGD, 0, {"lr": 0.1})
    with pytest.raises(ValueError, match="algorithm='tree' is not 'library' or 'ring'"):
        zero_mod.wrap(stack(), comm, torch.optim.SGD, 1, {"lr": 0.1}, algorithm="tree")
    with pytest.raises(ValueError, match="sizes >= 0"):
        zero_mod.partition([3], 0)
    mixed = torch.nn.utils.skip_init(nn.Linear, 2, 2)  # no initialisation: no global RNG
    mixed.bias.data = mixed.bias.data.double()
    with pytest.raises(ValueError, match="mixes dtypes"):
        impl("zero.gatherer").unit_groups(mixed)


def two_backwards_without_finish(comm) -> str:
    z = impl("zero.stages").wrap(stack(), comm, torch.optim.SGD, 2, {"lr": 0.1}, bucket_bytes=1)
    x = torch.ones(1, WIDTH, dtype=torch.float64)
    z(x).sum().backward()
    try:
        z(x).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.threads
def test_zero2_refuses_a_second_backward_before_the_first_is_finished():
    for message in run_threads(two_backwards_without_finish, 1):
        assert "after its unit was reduce-scattered" in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_threads_with_cuda_tensors(stage):
    case = dict(SMALL, stage=stage, clip=0.05)
    run_threads(zero_matches_single_process, 3, case, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_mixed_precision_with_cuda_tensors(stage):
    """The exact recipe with an overflow, then real bfloat16 (CUDA kernels) within tolerance."""
    case = dict(MIXED_SMALL, stage=stage)
    assert run_threads(zero_mixed_matches_single_process, 3, case, "cuda") == [[1]] * 3
    want_losses, want_w = fp32_reference(0)
    (got, *_) = run_threads(zero_low_precision, 2, stage, "bf16", 0, 30, "cuda")
    worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want_losses, strict=True))
    drift = ((got["masters"] - want_w).norm() / want_w.norm()).item()
    assert worst <= 8 * 2.0**-8 and drift <= 4 * 2.0**-8, (worst, drift)
