"""Parameter groups through ZeRO-1/2/3 (and mixed precision): each group's options (lr,
weight_decay, momentum...) apply to every rank's pieces of its parameters, so training equals
the torch optimizer built with the same groups in one process (float64, 1e-12 relative: the
batch is summed in another order), on every rank, after every step. The consolidated state
names each group's parameters and carries its options (a scheduler's lr too); loaded into
another world size and stage it restores them, and training goes on equal to that process.

The model is test_zero's Net (a frozen bias, a tied weight, a branch, a 0-d and a zero-element
parameter); groups are drawn over its trainable parameters, given by name or by object.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_zero import (
    ATOL,
    F64,
    OPTIMIZERS,
    RTOL,
    Net,
    batches,
    branch_at,
    check_replicas_identical,
    parameter_pairs,
    reference_step,
    state_pairs,
    train_step,
)
from torch import nn

from minidist.mixed_precision.amp import LossScaler
from minidist.testing import check_all, impl, rank_settings, run_threads, verdict

TRAINABLE = [n for n, q in Net(1, 1, 0).named_parameters() if q.requires_grad]  # 9 names
GROUP_OPTIONS = [{}, {"lr": 0.03, "weight_decay": 0.0}, {"lr": 0.2, "weight_decay": 0.3}]


def param_groups(model: nn.Module, case: dict, by: str) -> list[dict]:
    """The drawn groups over model: case["assign"][i] is TRAINABLE[i]'s group; by name or by
    Parameter object (torch's own convention); a frozen parameter listed too (it is skipped)."""
    named = dict(model.named_parameters())
    groups = [dict(GROUP_OPTIONS[g], params=[]) for g in range(max(case["assign"]) + 1)]
    for name, g in zip(TRAINABLE, case["assign"], strict=True):
        groups[g]["params"].append(name if by == "name" else named[name])
    groups[0]["params"].append("inp.bias" if by == "name" else named["inp.bias"])  # frozen
    return [g for g in groups if g["params"]]


def zero_with_groups(model, comm, case: dict, stage: int, scale: float):
    opt_cls, kwargs = OPTIMIZERS[case["opt"]]
    opts = {"param_groups": param_groups(model, case, case["by"])}
    if case["mixed"]:  # the exact recipe: every dtype float64, a power-of-two scale
        opts |= {"precision": F64, "scaler": LossScaler(scale, growth_interval=1)}
    return impl("zero.stages").wrap(model, comm, opt_cls, stage, kwargs, **opts)


def groups_match_single_process(comm, case: dict) -> None:
    """Train with groups in world A (ka ranks, stage sa), compare every step with one process;
    halve group 0's lr (as a scheduler would) on both; consolidate and check the groups; load
    into world B (kb ranks, stage sb, built with the old lr) and train on: still equal."""
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
    ref_opt = opt_cls(param_groups(ref, case, "param"), **kwargs)  # torch's own groups
    run = dict(case, accum=1, clip=None, branch="step", mixed=case["mixed"])
    state = None
    if r < ka:
        za = zero_with_groups(Net(d, h, seed + 1000 * r), world_a, case, case["sa"], 4.0)
        for step in range(k1):
            pairs = train_step(za, ref, ref_opt, data[step], run, step, r, b)
            pairs |= parameter_pairs(za, ref, step) | state_pairs(za, ref, ref_opt, step)
            check_all(world_a, pairs, RTOL, ATOL, context=f"groups {case}")
            check_replicas_identical(world_a, za, step)
        for zg, rg in zip(za.optimizer.param_groups, ref_opt.param_groups, strict=True):
            verdict(world_a, zg["lr"] == rg["lr"], f"lr {zg['lr']} != {rg['lr']}")
        za.optimizer.param_groups[0]["lr"] /= 2  # a scheduler's change must survive re-sharding
        ref_opt.param_groups[0]["lr"] /= 2
        state = za.state_dict()
        verdict(world_a, r != 0 or saved_groups_ok(state, ref, ref_opt), f"groups in {state}")
    else:
        for step in range(k1):  # the reference alone
            reference_step(ref, ref_opt, data[step], branch_at(run, step), None)
        ref_opt.param_groups[0]["lr"] /= 2
    comm.barrier()
    if r < kb:
        zb = zero_with_groups(Net(d, h, seed + 77 + r), world_b, case, case["sb"], 4.0 * 2**k1)
        zb.load_state_dict(state if r == 0 else None)
        for step in range(k1, k1 + k2):
            pairs = train_step(zb, ref, ref_opt, data[step], run, step, r, b)
            pairs |= parameter_pairs(zb, ref, step) | state_pairs(zb, ref, ref_opt, step)
            check_all(world_b, pairs, RTOL, ATOL, context=f"re-sharded groups {case}")
    comm.barrier()


def saved_groups_ok(state: dict, ref, ref_opt) -> bool:
    """The consolidated groups: torch's param_groups (every option), but naming parameters."""
    names = {id(q): n for n, q in ref.named_parameters()}
    want = [
        dict(g, params=sorted(names[id(q)] for q in g["params"] if q.requires_grad))
        for g in ref_opt.param_groups
    ]
    got = [dict(g, params=sorted(g["params"])) for g in state["param_groups"]]
    return got == want


group_cases = st.fixed_dictionaries(
    {
        "ka": st.integers(1, 4),
        "kb": st.integers(1, 4),
        "sa": st.sampled_from([1, 2, 3]),
        "sb": st.sampled_from([1, 2, 3]),
        "k1": st.integers(1, 2),
        "k2": st.integers(1, 2),
        "d": st.integers(1, 3),
        "h": st.integers(1, 4),
        "b": st.integers(1, 2),
        "seed": st.integers(0, 10**6),
        "opt": st.sampled_from(["momentum", "adamw"]),
        "assign": st.lists(st.integers(0, 2), min_size=len(TRAINABLE), max_size=len(TRAINABLE)),
        "by": st.sampled_from(["name", "param"]),
        "mixed": st.booleans(),
        "algorithm": st.just("library"),
        "bucket_bytes": st.just(40),
        "units": st.just("modules"),
        "stage": st.just(3),  # for test_zero.options(): the strictest rules
    }
)


@pytest.mark.threads
@settings(max_examples=12, deadline=None)
@given(group_cases)
def test_param_groups_equal_torch_groups_and_survive_resharding_threads(case):
    run_threads(groups_match_single_process, max(case["ka"], case["kb"]), case)


# ---- refusals: named, and on every rank alike (no rank left waiting) ------------------------


@pytest.mark.pure
def test_groups_that_do_not_cover_the_parameters_are_refused_by_name():
    comm = type("C", (), {"rank": 0, "world_size": 1, "broadcast": lambda *a: None})()
    wrap = impl("zero.stages").wrap
    for groups, message in (
        (
            [{"params": ["hidden.weight"]}],
            "in no param group: \\['scale', 'empty', 'inp.weight', 'hidden.bias'",
        ),
        (
            [{"params": TRAINABLE}, {"params": ["out.bias"]}],
            "'out.bias' is in param groups 0 and 1",
        ),
        ([{"params": [*TRAINABLE, "nope"]}], "param group 0 lists 'nope': not a parameter"),
        ([{"lr": 0.1}], "param group 0 is not a dict with 'params'"),
    ):
        with pytest.raises(ValueError, match=message):
            wrap(Net(2, 2, 0), comm, torch.optim.SGD, 1, {"lr": 0.1}, param_groups=groups)


def load_other_groups(comm, stage: int) -> str:
    """A state whose groups name other parameters: every rank raises the same error."""
    one = [{"params": TRAINABLE}]
    two = [{"params": TRAINABLE[:3]}, {"params": TRAINABLE[3:], "lr": 0.5}]
    za = impl("zero.stages").wrap(
        Net(2, 2, 0), comm, torch.optim.SGD, stage, {"lr": 0.1}, param_groups=one
    )
    state = za.state_dict()
    zb = impl("zero.stages").wrap(
        Net(2, 2, 0), comm, torch.optim.SGD, stage, {"lr": 0.1}, param_groups=two
    )
    try:
        zb.load_state_dict(state)
    except ValueError as e:
        return str(e)
    return "loaded"


@pytest.mark.threads
@pytest.mark.parametrize("stage", [1, 3])
def test_loading_a_state_with_other_groups_fails_on_every_rank(stage):
    want = "cannot load this state: the state has 1 param groups, this optimizer 2"
    assert run_threads(load_other_groups, 3, stage) == [want] * 3


def groups_properties_in_ranks(comm, max_examples: int) -> int:
    """The groups property with hypothesis inside every rank (test_zero_processes runs it)."""
    count = [0]

    @rank_settings(max_examples)
    @given(group_cases.filter(lambda c: max(c["ka"], c["kb"]) <= comm.world_size))
    def prop(case):
        count[0] += 1
        groups_match_single_process(comm, case)

    prop()
    return count[0]
