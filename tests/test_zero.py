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

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minidist.comm.wrappers import Counter, ObservedComm
from minidist.testing import check_all, impl, rank_settings, run_ranks, run_threads, verdict

RTOL, ATOL = 1e-12, 1e-15  # float64; reduction order differs from the single-process sum
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


def reference_step(ref, ref_opt, micro, branch, clip) -> torch.Tensor | None:
    """One step of the single process on the whole batch; the gradient norm if clipping."""
    for x, y in micro:
        nn.functional.mse_loss(ref(x, branch), y).backward()
    norm = None
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(
            [q for q in ref.parameters() if q.requires_grad], clip
        )
    ref_opt.step()
    ref_opt.zero_grad()
    return norm


def train_step(z, ref, ref_opt, micro, case, step, r, b) -> dict:
    """One step of the ZeRO model and of the reference; the pairs to compare."""
    branch, pairs = branch_at(case, step), {}
    for x, y in micro:
        lo, hi = r * b, (r + 1) * b  # this rank's rows, sliced here, not by the module
        nn.functional.mse_loss(z(x[lo:hi], branch), y[lo:hi]).backward()
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
    zero_mod = impl("zero")
    d, h, b, seed = case["d"], case["h"], case["b"], case["seed"]
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
@pytest.mark.parametrize("clip", [None, 0.05])
def test_zero_small_threads(stage, clip):
    """One fixed case per stage (the quick probe the labs use)."""
    case = dict(SMALL, stage=stage, clip=clip)
    check_pieces_tile(case, run_threads(zero_matches_single_process, 3, case))


def zero_properties_in_ranks(comm, max_examples: int, max_checkpoints: int) -> list[int]:
    """Both properties (training, then checkpoints) in one launch: processes start slowly."""
    subs = {k: comm.split(int(comm.rank < k)) for k in range(1, comm.world_size + 1)}
    count = [0, 0]

    @rank_settings(max_examples)
    @given(st.integers(1, comm.world_size), cases)
    def prop(k, case):
        count[0] += 1
        if comm.rank < k:
            zero_matches_single_process(subs[k], case)
        comm.barrier()

    @rank_settings(max_checkpoints)
    @given(checkpoint_cases)
    def checkpoints(case):
        count[1] += 1
        checkpoint_reshards(comm, case)

    prop()
    checkpoints()
    return count


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_zero_processes(backend):
    assert run_ranks(zero_properties_in_ranks, 4, backend, 8, 4, timeout=240) == [[8, 4]] * 4


# ---- consolidation and re-sharding --------------------------------------------------------


def checkpoint_reshards(comm, case: dict) -> None:
    """Train in world A (ka ranks, stage sa), consolidate on rank 0 and check it against the
    reference; load it into world B (kb ranks, stage sb) and keep training: still equal."""
    zero_mod = impl("zero")
    ka, kb, k1, k2, b = case["ka"], case["kb"], case["k1"], case["k2"], case["b"]
    d, h, seed, r = case["d"], case["h"], case["seed"], comm.rank
    world_a, world_b = comm.split(int(r < ka)), comm.split(int(r < kb))  # both hold rank 0
    data = batches(d, [b * ka] * k1 + [b * kb] * k2, seed, 1)
    ref = Net(d, h, seed)
    opt_cls, kwargs = OPTIMIZERS[case["opt"]]
    ref_opt = opt_cls([q for q in ref.parameters() if q.requires_grad], **kwargs)
    run = dict(case, accum=1, clip=None, algorithm="library", bucket_bytes=40, units="modules")
    state = None
    if r < ka:
        za = zero_mod.wrap(Net(d, h, seed + 1000 * r), world_a, opt_cls, case["sa"], kwargs)
        for step in range(k1):
            train_step(za, ref, ref_opt, data[step], run, step, r, b)
        state = za.state_dict()
        verdict(world_a, (state is None) == (r != 0), "only rank 0 gets the state")
        pairs = {} if r != 0 else consolidated_pairs(state, ref, ref_opt)
        check_all(world_a, pairs, RTOL, ATOL, context=f"consolidated {case}")
    else:
        for step in range(k1):  # the reference alone
            reference_step(ref, ref_opt, data[step], branch_at(run, step), None)
    comm.barrier()
    if r < kb:
        zb = zero_mod.wrap(Net(d, h, seed + 77 + r), world_b, opt_cls, case["sb"], kwargs)
        zb.load_state_dict(state if r == 0 else None)
        for step in range(k1, k1 + k2):
            pairs = train_step(zb, ref, ref_opt, data[step], run, step, r, b)
            pairs |= parameter_pairs(zb, ref, step) | state_pairs(zb, ref, ref_opt, step)
            check_all(world_b, pairs, RTOL, ATOL, context=f"re-sharded {case}")
    comm.barrier()


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


def counted_memory(comm, stage: int) -> dict:
    """The peak of each kind of model state over a step, sampled between its phases; and for
    ZeRO-3 the most units whole at once during forward."""
    zero3 = impl("zero3")
    opts = {"bucket_bytes": 1} if stage == 2 else {}  # ZeRO-2: one unit per layer
    z = impl("zero").wrap(stack(), comm, torch.optim.Adam, stage, {"lr": 0.01}, **opts)
    peak, whole = {}, [0]

    def count_whole(module, args):  # whole, or arriving (a prefetch lands in a buffer of its own)
        now = sum(whole_now(u) or getattr(u, "landing", None) is not None for u in z.units)
        whole[0] = max(whole[0], now)

    for layer in z.module[::2]:  # pre-hooks registered after the wrapper's run after them
        layer.register_forward_pre_hook(count_whole)

    def sample():
        for kind, n in zero3.memory_nbytes(z).items():
            peak[kind] = max(peak.get(kind, 0), n)

    for _ in range(2):
        x = torch.randn(2, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        loss = z(x).square().sum()
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
    want = impl("zero3").model_state_nbytes(stage, LAYERS * WIDTH * WIDTH, p, 8, 2)  # Adam: k=2
    for got in run_threads(counted_memory, p, stage):
        assert {k: got[k] for k in want} == want, (got, want)
        if stage == 3:  # the layer being computed and the prefetched next one; none after
            assert got["whole_units"] == min(2, LAYERS) and got["whole_at_end"] == 0, got
        else:  # ZeRO-1/2: the parameters are always whole
            assert got["whole_units"] == got["whole_at_end"] == got["units"], got


def counted_step(comm, stage: int) -> int:
    """Bytes this rank sent in one training step, ring collectives only (every byte counted);
    stage 0 is data_parallel's bucketed all-reduce."""
    counter = Counter()
    c = ObservedComm(comm, counter)
    x = torch.randn(2, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if stage == 0:
        model = impl("data_parallel").DataParallelBucketed(stack(), c, 1 << 20, "ring")
        counter.reset()
        model(x).square().sum().backward()
        model.finish_gradient_sync()
    else:
        z = impl("zero").wrap(stack(), c, torch.optim.Adam, stage, {"lr": 0.1}, algorithm="ring")
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
    formula = impl("zero3").sent_nbytes
    for s in range(4):
        assert sent[s] - flags == p * formula(s, n, p, 8), (s, sent)


@pytest.mark.threads
def test_bench_zero_json_matches_the_formulas(capsys):
    """`minidist bench zero` on thread-ranks, tiny: the counted figures are the formulas."""
    import argparse

    from minidist import bench_zero

    parser = argparse.ArgumentParser()
    bench_zero.add_parser(parser.add_subparsers())  # as `minidist bench` adds it
    argv = "zero -n 2 --backend threads --layers 2 --width 8 --steps 1 --json".split()
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert [row["stage"] for row in result["rows"]] == [0, 1, 2, 3]
    for row in result["rows"]:
        want = bench_zero.formulas(row["stage"], 2 * 8 * 8, 2, 2)
        assert row["held"] == want["held"] and row["sent"] == want["sent"], (row, want)


# ---- pure: the plan, the buckets, the formulas, the refusals -----------------------------


@pytest.mark.pure
def test_partition_tiles_the_padded_buffer():
    zero_mod = impl("zero")

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
    zero_mod = impl("zero")
    params = [torch.zeros(n) for n in (3, 1, 4, 1, 5)] + [torch.zeros(2, dtype=torch.float64)]
    groups = zero_mod.group_by_bytes(params, 16)
    assert [[q.numel() for q in g] for g in groups] == [[3, 1], [4], [1, 5], [2]]
    assert len(zero_mod.group_by_bytes(params[:5], None)) == 1


@pytest.mark.pure
def test_formulas():
    zero3 = impl("zero3")
    mixed = [sum(zero3.model_state_nbytes(s, 1000, 8, 2, 6).values()) for s in range(4)]
    assert mixed == [16000, 4000 + 1500, 2000 + 250 + 1500, 2000]  # 2+2+12 bytes/element
    assert zero3.sent_nbytes(3, 1000, 4, 2) == 1.5 * zero3.sent_nbytes(1, 1000, 4, 2) == 4500


@pytest.mark.pure
def test_refusals():
    zero_mod = impl("zero")
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
        impl("zero3").unit_groups(mixed)


def two_backwards_without_finish(comm) -> str:
    z = impl("zero").wrap(stack(), comm, torch.optim.SGD, 2, {"lr": 0.1}, bucket_bytes=1)
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
