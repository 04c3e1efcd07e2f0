"""Data parallelism equals one process on the whole batch, on every rank, after every step.

The model has every awkward part at once: a tied weight (one Linear used twice), a frozen bias,
a branch used only by some samples (so unused on some ranks, or on all), a zero-element and a
0-d parameter, and a buffer. Ranks are seeded differently before wrapping: the wrapper must
make them equal. Tolerance: float64, 1e-12 relative (the sum over the batch happens in another
order: per rank, then across ranks); replicas must be bitwise identical to each other.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minidist.comm.wrappers import Counter, ObservedComm
from minidist.testing import check_all, impl, in_subworlds, run_ranks, run_threads, verdict

RTOL, ATOL = 1e-12, 1e-15  # float64; reduction order differs from the single-process sum


class Net(nn.Module):
    def __init__(self, d: int, h: int, seed: int):
        super().__init__()
        self.inp = nn.Linear(d, h, dtype=torch.float64)
        self.inp.bias.requires_grad_(False)  # frozen bias
        self.hidden = nn.Linear(h, h, dtype=torch.float64)  # used twice: a tied weight
        self.branch = nn.Linear(h, h, dtype=torch.float64)  # only for samples with x[:, 0] > 1
        self.out = nn.Linear(h, 1, dtype=torch.float64)
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))  # 0-d
        self.empty = nn.Parameter(torch.zeros(0, dtype=torch.float64))  # zero elements
        self.register_buffer("seen", torch.full((1,), float(seed)))
        g = torch.Generator().manual_seed(seed)  # not torch.manual_seed: threads share that RNG
        with torch.no_grad():
            for q in self.parameters():
                q.copy_(torch.randn(q.shape, generator=g, dtype=q.dtype) * 0.5)

    def forward(self, x):  # x: (B, d)
        h = torch.tanh(self.hidden(torch.tanh(self.hidden(torch.tanh(self.inp(x))))))
        picked = x[:, 0] > 1.0
        if picked.any():
            h = h + picked[:, None] * self.branch(h)
        return self.out(h) * self.scale + self.empty.sum()  # (B, 1)


def problem(d, h, n, seed, steps):
    """The whole problem from one seed: per step, the global micro-batches (x, y)."""
    g = torch.Generator().manual_seed(seed)

    def pair():
        x = torch.randn(n, d, generator=g, dtype=torch.float64)  # (n, d)
        return x, torch.randn(n, 1, generator=g, dtype=torch.float64)  # (n, 1)

    data = [[pair() for _ in range(steps[1])] for _ in range(steps[0])]
    return data


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def dp_matches_single_process(comm, case: dict) -> dict:
    """Train the reference and the data-parallel model side by side; check after every step."""
    dp_mod = impl("data_parallel.wrappers")
    d = case["d"]
    h = case["h"]
    b = case["b"]
    seed = case["seed"]
    p, r = comm.world_size, comm.rank
    steps, accum = case["steps"], case["accum"]
    data = problem(d, h, b * p, seed, (steps, accum))
    ref = Net(d, h, seed)
    ref_opt = make_optimizer(case["opt"], [q for q in ref.parameters() if q.requires_grad])
    local = Net(d, h, seed + 1000 * r)  # ranks start out of sync on purpose
    if case["variant"] == "naive":
        model = dp_mod.DataParallelNaive(local, comm, case["algorithm"])
    else:
        model = dp_mod.DataParallelBucketed(
            local, comm, case["bucket_bytes"], case["algorithm"], case["views"]
        )
    opt = make_optimizer(case["opt"], [q for q in local.parameters() if q.requires_grad])
    for step in range(steps):
        for j, (x, y) in enumerate(data[step]):
            ref_loss = nn.functional.mse_loss(ref(x), y)
            ref_loss.backward()
            lo, hi = r * b, (r + 1) * b  # this rank's rows, sliced here, not by the module
            last = j == accum - 1
            if case["variant"] == "bucketed" and not last:
                with model.no_sync():
                    nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
            else:
                nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        model.finish_gradient_sync()
        pairs = {}
        for (name, q), (_, q_ref) in zip(
            local.named_parameters(), ref.named_parameters(), strict=True
        ):
            if (q.grad is None) != (q_ref.grad is None):
                verdict(
                    comm, False, f"step {step}: {name}.grad None-ness differs from the reference"
                )
            elif q.grad is not None:
                pairs[f"step {step} {name}.grad"] = (q.grad, q_ref.grad)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=case["set_to_none"])
        ref_opt.zero_grad(set_to_none=case["set_to_none"])
        for (name, q), (_, q_ref) in zip(
            local.named_parameters(), ref.named_parameters(), strict=True
        ):
            pairs[f"step {step} {name}"] = (q.detach(), q_ref.detach())
        check_all(comm, pairs, RTOL, ATOL, context=str(case))
        check_replicas_identical(comm, local, step)
    return {"buffer": local.seen.item()}


def check_replicas_identical(comm, model: nn.Module, step: int) -> None:
    """Every rank's parameters, bit for bit, equal rank 0's."""
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    rows = torch.empty(comm.world_size * flat.numel(), dtype=flat.dtype)
    comm.all_gather(rows, flat)
    rows = rows.view(comm.world_size, -1)
    differ = [q for q in range(comm.world_size) if not torch.equal(rows[q], rows[0])]
    verdict(comm, not differ, f"step {step}: ranks {differ} differ from rank 0 bitwise")


cases = st.fixed_dictionaries(
    {
        "d": st.integers(1, 5),
        "h": st.integers(1, 6),
        "b": st.integers(1, 4),
        "seed": st.integers(0, 10**6),
        "steps": st.integers(1, 3),
        "accum": st.integers(1, 3),
        "opt": st.sampled_from(["sgd", "adamw"]),
        "variant": st.sampled_from(["naive", "bucketed"]),
        "algorithm": st.sampled_from(["library", "ring"]),
        "views": st.booleans(),
        "set_to_none": st.booleans(),
        # below, at and just above one float64 parameter, and everything in one bucket
        "bucket_bytes": st.sampled_from([1, 8, 9, 8 * 6, 8 * 6 + 1, 1 << 20]),
    }
).filter(lambda c: c["variant"] == "bucketed" or c["accum"] == 1)  # naive has no no_sync


@pytest.mark.threads
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), cases)
def test_data_parallel_threads(p, case):
    buffers = run_threads(dp_matches_single_process, p, case)
    assert [x["buffer"] for x in buffers] == [case["seed"]] * p  # rank 0's buffer everywhere


# the process tier's fixed cases (test_data_parallel_threads draws the sweep), on 4 ranks and
# the last on 3 (a ring over an odd world): each variant and algorithm, buckets split inside a
# parameter and everything in one, accumulation
HARD = [
    {"d": 5, "h": 6, "b": 3, "seed": 7, "steps": 2, "accum": 1, "opt": "adamw",
     "variant": "naive", "algorithm": "library", "views": False, "set_to_none": True,
     "bucket_bytes": 1 << 20},
    {"d": 5, "h": 6, "b": 3, "seed": 8, "steps": 2, "accum": 2, "opt": "sgd",
     "variant": "bucketed", "algorithm": "ring", "views": True, "set_to_none": False,
     "bucket_bytes": 8 * 6 + 1},
    {"d": 4, "h": 5, "b": 2, "seed": 9, "steps": 3, "accum": 3, "opt": "adamw",
     "variant": "bucketed", "algorithm": "library", "views": False, "set_to_none": True,
     "bucket_bytes": 9},
]  # fmt: skip


def dp_properties_in_ranks(comm, max_examples: int) -> int:
    explicit = [(min(comm.world_size, 4 - i // 2), case) for i, case in enumerate(HARD)]
    return in_subworlds(comm, dp_matches_single_process, cases, max_examples, None, explicit)


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_data_parallel_processes(backend):
    expected = [len(HARD)] * 4  # and none drawn
    assert run_ranks(dp_properties_in_ranks, 4, backend, 0, timeout=240) == expected


def counted_step(comm, variant: str, algorithm: str, bucket_bytes: int) -> dict:
    counter = Counter()
    c = ObservedComm(comm, counter)
    dp_mod = impl("data_parallel.wrappers")
    local = Net(3, 4, 0)
    if variant == "naive":
        model = dp_mod.DataParallelNaive(local, c, algorithm)
    else:
        model = dp_mod.DataParallelBucketed(local, c, bucket_bytes, algorithm)
    x = torch.randn(2, 3, dtype=torch.float64) + 2  # x[:, 0] > 1: the branch is used
    counter.reset()
    nn.functional.mse_loss(model(x), x[:, :1]).backward()
    model.finish_gradient_sync()
    n_buckets = len(model.buckets) if variant == "bucketed" else None
    return {"summary": counter.summary(), "buckets": n_buckets}


def _grad_elements() -> tuple[int, int]:
    params = [q for q in Net(3, 4, 0).parameters() if q.requires_grad]
    return sum(q.numel() for q in params), len(params)


@pytest.mark.threads
@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_bytes_per_step_are_2_p_minus_1_over_p_of_the_gradient(p):
    n, n_params = _grad_elements()
    for variant in ("naive", "bucketed"):
        got = run_threads(counted_step, p, variant, "ring", 64)
        sent = sum(sum(g["summary"]["sent_to"].values()) for g in got)
        # over all ranks the ring sends 2 (p-1) N b for any N; the P flags ride along (naive:
        # as one vector of P, bucketed: inside each bucket)
        assert sent == 2 * (p - 1) * (n + n_params) * 8, (variant, sent)
        for r, g in enumerate(got):  # the ring talks only to the right neighbour
            assert set(g["summary"]["sent_to"]) == {(r + 1) % p}, g["summary"]["sent_to"]


@pytest.mark.threads
@pytest.mark.parametrize("bucket_bytes", [1, 40, 1 << 20])
def test_one_collective_per_bucket(bucket_bytes):
    got = run_threads(counted_step, 2, "bucketed", "library", bucket_bytes)
    for g in got:
        # one all-reduce per bucket, and the buffer's broadcast from rank 0 before forward
        assert g["summary"]["calls"] == {"all_reduce": g["buckets"], "broadcast": 1}
    n, n_params = _grad_elements()
    assert sum(g["summary"]["nbytes"]["all_reduce"] for g in got[:1]) == (n + n_params) * 8


def accumulation_disagrees_then_agrees(comm) -> list[bool]:
    model = impl("data_parallel.wrappers").DataParallelBucketed(Net(2, 3, 0), comm, 16)
    g = torch.Generator().manual_seed(comm.rank)  # different data on each rank
    agree = []
    for micro in range(3):
        x = torch.randn(4, 2, generator=g, dtype=torch.float64)
        context = model.no_sync() if micro < 2 else _nothing()
        with context:
            model(x).sum().backward()
        if micro == 2:
            model.finish_gradient_sync()
        w = model.module.out.weight.grad.reshape(-1)
        rows = torch.empty(comm.world_size * w.numel(), dtype=w.dtype)
        comm.all_gather(rows, w)
        rows = rows.view(comm.world_size, -1)
        agree.append(all(torch.equal(rows[q], rows[0]) for q in range(comm.world_size)))
    return agree


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.threads
def test_accumulation_gradients_differ_until_the_last_micro_step():
    assert run_threads(accumulation_disagrees_then_agrees, 3) == [[False, False, True]] * 3


class RecordingLauncher:
    """Stands in for a Launcher: notes which bucket each all-reduce is for, reduces nothing."""

    def __init__(self, buckets: list):
        self.buckets, self.launched = buckets, []

    def all_reduce(self, flat: torch.Tensor):
        self.launched.append(next(i for i, b in enumerate(self.buckets) if b.flat is flat))
        return type("Done", (), {"wait": lambda self: None, "is_completed": lambda self: True})()


@pytest.mark.pure
def test_buckets_launch_in_bucket_order_once_full():
    """Lab 04.2 alone: four buckets of one parameter each (made here, not by assign_buckets),
    made ready out of order. Bucket 0 holds the others back; once it is full, every full
    bucket after it goes, in order; the end launches what is left, each bucket once."""
    dp_mod = impl("data_parallel.wrappers")
    buckets = [dp_mod._Bucket([nn.Parameter(torch.zeros(2))], 1) for _ in range(4)]
    model = types.SimpleNamespace(buckets=buckets, next_launch=0)
    model.launcher = RecordingLauncher(buckets)
    seen = []
    for ready, at_end in [(1, False), (2, False), (0, False), (3, False), (None, True)]:
        if ready is not None:
            buckets[ready].ready = [True]
        dp_mod.DataParallelBucketed._launch_ready(model, all_remaining=at_end)
        seen.append(list(model.launcher.launched))
    assert seen == [[], [], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3]], seen


@pytest.mark.pure
def test_gradients_enter_the_bucket_divided_by_p():
    """Before the all-reduce (lab 04.3 alone): each gradient is copied into its bucket view
    divided by p, in one pass, leaving .grad as it was; None puts zeros there (over what the
    view held); a .grad that is the view itself is divided in place."""
    into = impl("data_parallel.wrappers")._into_bucket
    q = nn.Parameter(torch.zeros(2, 1))
    q.grad = torch.tensor([[4.0], [8.0]])
    view = torch.full((2,), 9.0)
    into(q, view, 4)
    assert view.tolist() == [1.0, 2.0] and q.grad.tolist() == [[4.0], [8.0]], (view, q.grad)
    q.grad = None
    into(q, view, 4)
    assert view.tolist() == [0.0, 0.0], "a rank without a gradient adds zeros"
    flat = torch.tensor([6.0, 3.0])
    q.grad = flat.view(2, 1)  # the bucket's view, kept from the last step and accumulated into
    into(q, flat, 3)
    assert flat.tolist() == [2.0, 1.0] and q.grad.data_ptr() == flat.data_ptr(), flat


@pytest.mark.pure
def test_used_gradients_become_views_and_unused_ones_stay_none():
    """After the all-reduce (lab 04.4 alone): the flat buffer [grads..., flags...] holds the
    averages and, per parameter, how many ranks had a gradient; each used .grad becomes its
    view of the bucket (the default: nothing copied out)."""
    params = [
        nn.Parameter(torch.zeros(2, 1)),
        nn.Parameter(torch.zeros(3)),
        nn.Parameter(torch.zeros(())),
    ]
    flat = torch.tensor([1.0, 2.0, 1.0, 2.0, 3.0, 1.5, 3.0, 0.0, 1.0])  # 6 averages, 3 flags
    views = list(flat[:6].split([2, 3, 1]))
    impl("data_parallel.wrappers")._keep_used(flat, params, views)
    assert torch.equal(params[0].grad, torch.tensor([[1.0], [2.0]])), params[0].grad
    assert params[1].grad is None, "no rank had a gradient: it stays None"
    assert torch.equal(params[2].grad, torch.tensor(1.5)), params[2].grad
    assert params[0].grad.data_ptr() == flat.data_ptr(), "the gradient is a view of the bucket"


@pytest.mark.pure
def test_averages_are_copied_into_each_gradients_own_memory_when_views_are_not_asked_for():
    """as_views=False (torch DDP's default): a .grad that exists receives the average in place;
    one that is None gets a new tensor; neither aliases the bucket, so the next step's copy
    into it cannot change them."""
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))]
    params[0].grad = torch.full((2,), 7.0)  # this rank's own gradient, already in the bucket
    own = params[0].grad
    flat = torch.tensor([1.0, 2.0, 1.5, 2.0, 1.0])  # 3 averages, then 2 flags
    views = list(flat[:3].split([2, 1]))
    impl("data_parallel.wrappers")._keep_used(flat, params, views, as_views=False)
    assert params[0].grad is own and torch.equal(own, torch.tensor([1.0, 2.0])), own
    assert torch.equal(params[1].grad, torch.tensor([1.5])), params[1].grad
    assert torch.equal(flat, torch.tensor([1.0, 2.0, 1.5, 2.0, 1.0])), "the bucket is unchanged"
    flat.zero_()
    assert own.tolist() == [1.0, 2.0] and params[1].grad.tolist() == [1.5]


@pytest.mark.pure
def test_assign_buckets_tiles_in_order():
    dp_mod = impl("data_parallel.wrappers")

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.integers(0, 50), max_size=12), st.integers(1, 120))
    def prop(nbytes, limit):
        buckets = dp_mod.assign_buckets(nbytes, limit)
        assert [i for b in buckets for i in b] == list(range(len(nbytes)))
        for b in buckets[:-1]:  # every bucket but the last is full, and closed just so
            assert sum(nbytes[i] for i in b) >= limit
            assert sum(nbytes[i] for i in b[:-1]) < limit

    prop()


@pytest.mark.pure
def test_uneven_shares_and_bad_settings_are_refused():
    dp_mod = impl("data_parallel.wrappers")
    comm = type("C", (), {"rank": 0, "world_size": 4})()
    with pytest.raises(ValueError, match="batch=10 is not divisible by the data-parallel size p=4"):
        dp_mod.shard(torch.zeros(10, 3), comm)
    with pytest.raises(ValueError, match="bucket_bytes=0 must be at least 1"):
        dp_mod.assign_buckets([4], 0)
