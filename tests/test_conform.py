"""The conformance kit (minidist/conform/), a small fast slice: minidist's own adapter passes every
check of every capability on threads (and the worked example's from-scratch DDP over gloo
processes), planted bugs are caught, the cases are the same on every run, and `minidist conform`
exits 0 / 1 / 2 with a table, JSON and JUnit XML that parse. The whole mutant set and its
score: `python -m minidist.conform.mutants` (lessons/appendix_conformance/README.md).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from xml.etree import ElementTree as ET

import pytest

from minidist import cli
from minidist.conform import mutants, ours, registry, runner
from minidist.conform.checks import draw
from minidist.context_parallel import ring_attention as ring

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "lessons", "appendix_conformance", "adapter.py")


def check(full_name: str):
    return registry.checks_by_name()[full_name]


@pytest.mark.threads
@pytest.mark.parametrize("capability", list(registry.CAPABILITIES))
def test_minidist_passes_every_check_on_threads(capability):
    results = runner.conform("minidist", registry.CAPABILITIES[capability], ["threads"], 2)
    bad = [f"{r.full_name}: {r.status} {r.problem}" for r in results if r.status != "passed"]
    assert not bad, "\n".join(bad)
    assert all(r.examples >= 3 for r in results)  # the fixed hard cases, then the drawn ones


@pytest.mark.processes
def test_the_worked_example_ddp_passes_over_gloo_processes():
    """COMM = "torch": the from-scratch DDP gets a torch.distributed group, on sub-worlds of
    1..4 of one job of 4 gloo processes."""
    results = runner.conform(EXAMPLE, registry.CAPABILITIES["dp"], ["gloo"], 0)
    status = {r.check: r.status for r in results}
    skipped = {r.check: r.problem for r in results if r.status == "skipped"}
    assert skipped == {"bucket_sizes": "the adapter has no data_parallel_buckets"}, skipped
    assert set(status.values()) == {"passed", "skipped"}, [r.problem for r in results]
    assert {r.backend for r in results} == {"gloo"}


CAUGHT_BY = {  # a few mutants: a check that fails each, and words its report must hold
    "avg_as_sum": ("collectives.all_reduce.avg", "rank 0's result: max |difference| 6"),
    "blocking_ring": ("collectives.all_reduce.sum", "Deadlock: deadlock: all 3 live ranks wait"),
    "all_to_all_counts_transposed": ("collectives.all_to_all", "Deadlock: "),
    "dp_unused_zero_grad": ("dp.unused_parameters", "rank 0 step 0 grad branch.weight: a tensor"),
    "dp_no_broadcast_at_wrap": ("dp.broadcast_at_wrap", "rank 1 after wrap: inp.weight: max |d"),
    "tp_row_bias_every_rank": ("tp.row_parallel_linear", "rank 0 y: max |difference|"),
    "pp_stash_as_stack": ("pp.step.1f1b", "rank 0 layer 0 weight.grad: max |difference|"),
    "moe_arrival_order_lost": ("moe.top1", "rank 0 y: max |difference|"),
    "moe_experts_summed_over_ep": ("moe.top2", "rank 0 expert 0 dL/dfc1.weight: max |d"),
    "cp_causal_mask_local": ("cp.causal", "rank 0 out: max |difference|"),
    "cp_ring_backwards": ("cp.bytes", "rank 0 sent {2: 336} B, the ring sends {1: 336} B"),
    "zero2_gradient_not_reduced": ("zero.stage2.gradients", "rank 0 step 0 gradient 4.bias[0:1]"),
    "zero1_state_not_sharded": ("zero.stage1.memory", "rank 0 optimizer: 432 bytes held, the"),
}


@pytest.mark.threads
@pytest.mark.parametrize("name", list(CAUGHT_BY))
def test_planted_bugs_are_caught_naming_the_case(name):
    full_name, words = CAUGHT_BY[name]
    result = runner.run_threads(mutants.MUTANTS[name][2], check(full_name), 2)
    assert result.status == "failed", result
    assert result.world_size > 1 and result.example, result  # the first failing case
    assert result.problem.startswith(words), result.problem
    assert result.seconds < 10, result  # a deadlock is named at once, not at a timeout


@pytest.mark.threads
def test_missing_functions_other_comms_and_not_implemented_are_skipped_with_the_reason():
    only_sum = SimpleNamespace(COMM="minidist", all_reduce=_sum_only)
    results = runner.conform_adapter(only_sum, registry.CAPABILITIES["collectives"], ["threads"], 1)
    status = {r.check: (r.status, r.problem) for r in results}
    assert status["all_reduce.sum"][0] == "passed"
    assert status["all_reduce.max"] == ("skipped", "NotImplementedError: only op='sum'")
    assert status["broadcast"] == ("skipped", "the adapter has no broadcast")
    assert "does not claim 'all_reduce': 'ring'" in status["all_reduce.bytes"][1]
    torch_only = SimpleNamespace(COMM="torch", data_parallel=ours.data_parallel)
    result = runner.run_threads(torch_only, check("dp.gradients"), 1)
    assert result.status == "skipped" and "--backend gloo" in result.problem, result


def _sum_only(comm, tensor, op):
    if op != "sum":
        raise NotImplementedError("only op='sum'")
    return ours.all_reduce(comm, tensor, op)


@pytest.mark.threads
def test_an_adapter_that_declares_the_zigzag_layout_gets_chunks_r_and_2p_1_r():
    zigzag = SimpleNamespace(COMM="minidist", CP_LAYOUT="zigzag", ring_attention=_zigzag_ring)
    result = runner.run_threads(zigzag, check("cp.causal"), 1)
    assert result.status == "passed", result
    undeclared = SimpleNamespace(COMM="minidist", ring_attention=_zigzag_ring)
    assert runner.run_threads(undeclared, check("cp.causal"), 1).status == "failed"


def _zigzag_ring(comm, q, k, v, causal):
    return ring.ring_attention(q, k, v, comm, "zigzag", causal=causal)


@pytest.mark.pure
def test_cases_are_drawn_the_same_on_every_run_hard_ones_first():
    c = check("collectives.all_to_all")
    first, second = draw(c, 8, 20), draw(c, 8, 20)
    assert first == second
    assert first[: len(c.explicit)] == list(c.explicit)
    assert max(case["p"] for case in draw(c, 4, 20)) <= 4


def run_command(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(["conform", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.threads
def test_the_command_exits_0_writes_json_and_junit(tmp_path, capsys):
    json_path, junit_path = tmp_path / "r.json", tmp_path / "r.xml"
    argv = ["minidist", "--only", "tp", "--examples", "1", "--json", str(json_path)]
    code, out, _ = run_command([*argv, "--junit", str(junit_path)], capsys)
    assert code == 0, out
    assert "tp  (threads)" in out and "5 passed, 0 failed, 0 skipped" in out, out
    report = json.loads(json_path.read_text())
    assert report["summary"]["passed"] == 5 and report["summary"]["failed"] == 0
    assert {r["check"] for r in report["results"]} == {c.name for c in registry.CAPABILITIES["tp"]}
    suite = ET.parse(junit_path).getroot().find("testsuite")
    assert suite.get("name") == "tp" and suite.get("tests") == "5" and suite.get("failures") == "0"


@pytest.mark.threads
def test_the_command_exits_1_on_a_failure_naming_check_world_example_difference(tmp_path, capsys):
    junit_path = tmp_path / "r.xml"
    argv = ["minidist.conform.mutants:tp_row_bias_every_rank", "--only", "tp", "--examples", "1"]
    code, out, _ = run_command([*argv, "--junit", str(junit_path)], capsys)
    assert code == 1, out
    line = next(x for x in out.splitlines() if "FAILED tp.row_parallel_linear threads" in x)
    assert " p=" in line and "seed=" in line and "max |difference|" in line, line
    failures = ET.parse(junit_path).getroot().iter("failure")
    assert any("row_parallel_linear" in f.get("message") for f in failures)


@pytest.mark.pure
def test_the_commands_help_names_every_capability_of_the_registry():
    from minidist.conform import command

    assert command.CAPABILITIES == tuple(registry.CAPABILITIES)


@pytest.mark.pure
def test_the_command_exits_2_naming_what_it_cannot_use(capsys):
    code, _, err = run_command(["no/such/adapter.py"], capsys)
    assert code == 2 and "no such adapter file" in err, err
    code, _, err = run_command(["minidist", "--only", "pipeline,dp"], capsys)
    assert code == 2 and "--only pipeline" in err and "'collectives'" in err, err
    code, _, err = run_command(["minidist", "--backend", "nccl"], capsys)
    assert code == 2 and "--backend nccl" in err, err
