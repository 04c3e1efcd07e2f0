"""The planner (minidist/cluster/plan.py, `minidist plan`): its formulas, its search, its command.

Tier 0 checks each formula as its docstring states it, and the one place where the plan and
minidist's code describe the same thing: the tensor-parallel bytes per layer, counted on a real
ParallelTransformerBlock (tier 1). The published runs are checked in test_published_runs.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from minidist.cluster import calibrate, evidence, network, plan, profiles, report
from minidist.cluster import cli as plan_cli
from minidist.cluster import hardware as cluster
from minidist.cluster import search as plan_search
from minidist.comm.wrappers import Counter, ObservedComm
from minidist.tensor_parallel.blocks import ParallelTransformerBlock
from minidist.testing import run_threads

A100 = cluster.preset("dgx-a100")
GPT3 = plan.SHAPES["gpt3-175b"]


@pytest.mark.pure
@pytest.mark.parametrize(
    "name,billions",
    [("gpt3-175b", 175), ("llama-70b", 69), ("llama-7b", 6.7), ("llama3-405b", 406)],
)
def test_parameter_counts_match_the_names(name, billions):
    assert plan.SHAPES[name].params() / 1e9 == pytest.approx(billions, rel=0.02)


@pytest.mark.pure
@pytest.mark.parametrize("L,h", [(24, 2304), (40, 6144), (80, 12288), (96, 12288), (128, 25600)])
def test_a_tied_output_layer_is_counted_once_as_narayanans_equation_counts_it(L, h):
    # Narayanan et al. (SC 2021), section 5.1: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)),
    # the output layer the embedding's matrix; the plan leaves out biases, norms and positions
    V = 51200
    s = 2048
    narayanan = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
    tied = plan.Shape("", L, h, h // 128, 4 * h, V, s, tied=True)
    assert tied.params() == pytest.approx(narayanan, rel=0.005)
    untied = replace(tied, tied=False)
    assert untied.params() - tied.params() == V * h  # counted apart: another V x h


@pytest.mark.pure
@pytest.mark.parametrize(
    "L,h,a,gpus,batch,seconds,mfu,hfu",
    [
        (48, 6144, 64, 8, 4, 1.10, 41.5, 43.7),
        (96, 12288, 96, 64, 64, 13.75, 51.4, 52.8),
        (105, 20480, 128, 280, 280, 37.83, 56.0, 57.0),
        (128, 25600, 160, 512, 512, 71.49, 56.3, 57.0),
    ],
)
def test_mfu_and_hfu_are_korthikantis_table_5(L, h, a, gpus, batch, seconds, mfu, hfu):
    # table 5, selective recompute and sequence parallelism: the step's seconds give their MFU
    # (model FLOPs) and HFU (recompute counted as 12 s h a layer, not the 4 s h it runs)
    shape = plan.Shape("", L, h, a, 4 * h, 51200, 2048, tied=True)
    got = report.mfu(shape, A100, gpus, batch, seconds)
    assert got * 100 == pytest.approx(mfu, abs=0.2)
    got = report.mfu(shape, A100, gpus, batch, seconds, "selective")
    assert got * 100 == pytest.approx(hfu, abs=0.2)
    executed = shape.step_flops_per_token("selective") - shape.model_flops_per_token()
    assert executed == 4 * 2048 * h * L  # what runs: the attention core's forward again


@pytest.mark.pure
def test_flops_per_token_is_megatrons_formula():
    s = GPT3.seq
    h = GPT3.hidden
    L = GPT3.layers
    V = GPT3.vocab
    # Narayanan et al. (SC 2021): 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) per step, B = 1, s tokens
    megatron = 72 * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert 3 * GPT3.forward_flops_per_token() * s == pytest.approx(megatron, rel=1e-12)


@pytest.mark.pure
# ZeRO-1/2/3: Rajbhandari et al.'s; without ZeRO, Megatron-LM's 20 (its docs' table of bytes a
# parameter: fp16 parameters and gradients, the optimizer's float32 copies of both, Adam's two)
@pytest.mark.parametrize("zero,per_param", [(0, 20), (1, 4 + 12 / 4), (2, 2 + 14 / 4), (3, 16 / 4)])
def test_model_state_is_the_zero_papers(zero, per_param):
    x = plan.Layout(dp=4, pp=2, tp=2, zero=zero)
    psi = (GPT3.layers // 2 * GPT3.layer_params() + GPT3.vocab * GPT3.hidden) / 2
    got = plan.memory_bytes(GPT3, x, batch=8)["model state"]
    assert got == pytest.approx(psi * per_param, rel=1e-12)


@pytest.mark.pure
@pytest.mark.parametrize(
    "recompute,sp,constant",
    [("none", False, 10 + 24 / 8), ("none", True, 34 / 8), ("selective", True, 34 / 8)],
)
def test_activations_are_korthikantis_table_2(recompute, sp, constant):
    s = GPT3.seq
    h = GPT3.hidden
    a = GPT3.heads
    t = 8
    x = plan.Layout(dp=1, pp=4, tp=t, b=2, recompute=recompute, sp=sp)
    attention = 0 if recompute == "selective" else 5 * a * s / (h * t)
    per_layer = s * 2 * h * (constant + attention)
    got = plan.memory_bytes(GPT3, x, 16, flash=False)["activations"]  # m = 8 >= pp: pp in flight
    assert got == pytest.approx(per_layer * GPT3.layers / 4 * 4, rel=1e-12)
    full = plan.Layout(dp=1, pp=4, tp=t, b=2, recompute="full", sp=True)
    want_full = 2 * s * 2 * h / t * GPT3.layers
    assert plan.memory_bytes(GPT3, full, 16, flash=False)["activations"] == pytest.approx(want_full)
    # flash attention never stores the s x s scores: the 5 a s/h term goes, as with selective
    flash = plan.memory_bytes(GPT3, x, 16, flash=True)["activations"]
    assert flash == pytest.approx(got - attention * s * 2 * h * GPT3.layers)


@pytest.mark.pure
@pytest.mark.parametrize("pp,v,m", [(1, 1, 4), (4, 1, 8), (4, 2, 8), (8, 4, 16)])
def test_bubble_is_p_minus_1_over_v_slots(pp, v, m):
    x = plan.Layout(dp=1, pp=pp, tp=1, v=v)
    # no fused attention kernel: attention's FLOPs at the matmul rate too
    parts = plan.step(GPT3, x, A100, batch=m, eff=plan.Efficiency(compute=0.5), flash=False)
    rate = A100.gpu.peak_flops * 0.5 * plan.matmul_share(GPT3, x, A100.gpu)
    s = GPT3.seq
    h = GPT3.hidden
    # the roofline's other side
    memory = plan.elementwise_nbytes(GPT3, x, flash=False) / A100.gpu.memory_bw
    layers = 3 * (2 * GPT3.layer_params() + 4 * s * h) * GPT3.layers // pp  # a stage's, a token
    head = 3 * 2 * GPT3.vocab * h  # on the last stage, which sets the pace
    assert parts["compute"] == pytest.approx(m * ((layers + head) * s / rate + memory), rel=1e-12)
    fill = layers * s / rate + memory if pp > 1 else 0  # the other stages fill and drain the pipe
    assert parts["bubble"] == pytest.approx((pp - 1) / v * fill, rel=1e-12)


def layer_ms(shape: plan.Shape, recompute: str, sp: bool, b: int) -> float:
    """One layer's forward and backward on tp 8 of a DGX A100, ms: the step's compute and tp
    parts with the layer, less without it (one microbatch, no dp)."""
    x = plan.Layout(1, 1, 8, b=b, recompute=recompute, sp=sp)
    eff = plan.calibrated(A100)

    def seconds(layers: int) -> float:
        parts = plan.step(replace(shape, layers=layers), x, A100, b, eff, flash=False)
        return parts["compute"] + parts["tp"]

    return (seconds(shape.layers) - seconds(shape.layers - 1)) * 1e3


# Korthikanti et al. (2022): table 3's 22B (tp 8, microbatch 4), 530B and 1T (microbatch 1)
KORTHIKANTI = {
    "22B": plan.Shape("22B", 48, 6144, 64, 4 * 6144, 51200, 2048),
    "530B": plan.Shape("530B", 105, 20480, 128, 4 * 20480, 51200, 2048),
    "1T": plan.Shape("1T", 128, 25600, 160, 4 * 25600, 51200, 2048),
}
RECOMPUTES = ("none", "selective", "full")


@pytest.mark.pure
def test_recompute_costs_about_what_korthikanti_measured():
    # table 4, one 22B layer forward and backward: 19.6 ms, with selective recompute 20.9
    # (+6.6%: the attention core's forward again, its matmuls and its s x s elementwise
    # bytes), with full recompute 27.2 (+38.8%); the plan: 20.9, 21.9 (+4.7%), 28.5 (+36%)
    shape = KORTHIKANTI["22B"]
    none, selective, full = (layer_ms(shape, r, False, 4) for r in RECOMPUTES)
    assert none == pytest.approx(19.6, rel=0.08)
    assert 0.04 < selective / none - 1 < 0.09, selective / none
    assert 0.30 < full / none - 1 < 0.45, full / none
    # figure 8: at 530B and 1T selective recompute (with sp) costs about 2%, full about 36%
    for name in ("530B", "1T"):
        none, selective, full = (layer_ms(KORTHIKANTI[name], r, True, 1) for r in RECOMPUTES)
        assert 0.005 < selective / none - 1 < 0.03, (name, selective / none)
        assert 0.30 < full / none - 1 < 0.42, (name, full / none)


@pytest.mark.pure
def test_the_time_outside_the_layers_is_what_korthikantis_22b_step_leaves():
    # table 5's 22B step with full recompute, 1.42 s, less 48 of table 4's 27.2 ms layers:
    # 0.114 s outside the layers (embedding, head, loss, optimizer); the plan's step less 48 of
    # its own layers leaves its head, the ends' all-reduces and the optimizer's 54 bytes a
    # parameter (profiles.OPTIMIZER_BYTES): 0.084 s (the optimizer at 32 bytes left 0.055)
    shape = KORTHIKANTI["22B"]
    x = plan.Layout(1, 1, 8, b=4, recompute="full")
    step = sum(plan.step(shape, x, A100, 4, plan.calibrated(A100), flash=False).values())
    outside = step - 48 * layer_ms(shape, "full", False, 4) / 1e3
    assert 0.6 < outside / (1.42 - 48 * 0.0272) < 1.4, outside


@pytest.mark.pure
def test_each_profile_hides_what_its_framework_overlaps():
    t = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}
    megatron, ddp, mcore, deepspeed, fsdp = (
        profiles.PROFILES[k] for k in ("megatron", "ddp", "megatron-core", "deepspeed", "fsdp")
    )
    exposed = profiles.exposed_dp_seconds
    f = 0.5
    b = 1.5
    # after the flush (Megatron-LM's own DDP, DeepSpeed's pipeline engine): all of it
    assert exposed(megatron, 0, t, 4, f, b, 10) == 2.0
    assert exposed(deepspeed, 1, t, 4, f, b, 10) == 2.0
    # buckets during the last microbatch's backward: what is longer than it
    assert exposed(ddp, 0, t, 4, f, b, 10) == pytest.approx(0.5)
    assert exposed(ddp, 1, t, 4, f, b, 10) == pytest.approx(1.0)  # the gather after the step
    assert exposed(mcore, 1, t, 4, f, b, 10) == pytest.approx(0.5)  # ... during the forward
    assert exposed(ddp, 2, t, 4, 0.5, 0.75, 10) == pytest.approx(4 * 0.25 + 1.0)  # a round each
    # ZeRO-3, one piece ahead: a + r + m (U max(0, a - F/U) + U max(0, a + r - B/U))
    a = r = 0.1  # 1 s over U = 10 pieces
    want = a + r + 4 * (10 * max(0, a - f / 10) + 10 * max(0, a + r - b / 10))
    assert exposed(fsdp, 3, t, 4, f, b, 10) == pytest.approx(want)  # 4.2 s
    assert exposed(fsdp, 3, t, 4, 10 * f, 10 * b, 10) == pytest.approx(a + r)  # compute hides it
    # by module (DeepSpeed: 4 a layer), the first gather and the last reduce-scatter are smaller
    assert exposed(deepspeed, 3, t, 4, 10 * f, 10 * b, 10) == pytest.approx((a + r) / 4)


@pytest.mark.pure
def test_tensor_parallel_traffic_hides_behind_the_matmuls_only_where_the_framework_overlaps_it():
    mcore, overlap = (profiles.PROFILES[k] for k in ("megatron-core", "megatron-core-tp-overlap"))
    assert profiles.exposed_tp_seconds(mcore, 2.0, 5.0) == 2.0
    assert profiles.exposed_tp_seconds(overlap, 2.0, 5.0) == 0.0
    assert profiles.exposed_tp_seconds(overlap, 2.0, 1.5) == pytest.approx(0.5)
    # in a step: each layer's 4 all-reduces behind its linear matmuls (2 x the layer's
    # parameters a token, forward and backward, on 1/tp of them), the embedding's and the
    # head's not (pp = 1: both)
    x = plan.Layout(dp=1, pp=1, tp=8, b=1, sp=True)
    eff = plan.calibrated(A100)
    plain = plan.step(GPT3, x, A100, 8, eff, profile=mcore)
    hidden = plan.step(GPT3, x, A100, 8, eff, profile=overlap)
    act = 2 * GPT3.seq * GPT3.hidden
    tp_ar = network.collective_seconds(A100, "all_reduce", network.Group(8, 1), act, 0.91)[0]
    assert plain["tp"] == pytest.approx(8 * (96 * 4 + 2) * tp_ar)
    rate = A100.gpu.peak_flops * eff.compute * plan.matmul_share(GPT3, x, A100.gpu)
    gemm = 3 * 2 * GPT3.active_layer_params(capacity=True) * GPT3.seq / 8 / rate
    assert 4 * tp_ar < gemm  # so the matmuls cover it all
    assert hidden["tp"] == pytest.approx(8 * 2 * tp_ar)
    assert all(plain[k] == hidden[k] for k in plain if k not in ("tp", "bubble"))


@pytest.mark.pure
def test_deepspeed_runs_its_matmuls_at_its_fitted_share_of_the_calibrated_rate():
    deepspeed = profiles.PROFILES["deepspeed"]
    assert deepspeed.compute == evidence.FRAMEWORK_COMPUTE["deepspeed"] < 1
    fitted = evidence.FRAMEWORK_COMPUTE  # llm-foundry's too, above 1
    assert all(p.compute == fitted.get(name, 1.0) for name, p in profiles.PROFILES.items())
    # the same layout under the same traffic rules at the full rate: only the matmuls slow
    # down, the elementwise bytes stay at the memory's bandwidth (on A100s, without flash
    # attention, every FLOP is a matmul's); m = 64 / (dp 4 x b 1) = 16 microbatches
    at_full_rate = replace(deepspeed, compute=1.0)
    x = plan.Layout(dp=4, pp=4, tp=8, b=1, recompute="full")
    eff = plan.calibrated(A100)
    slow = plan.step(GPT3, x, A100, 64, eff, flash=False, profile=deepspeed)
    fast = plan.step(GPT3, x, A100, 64, eff, flash=False, profile=at_full_rate)
    elementwise = 16 * plan.elementwise_nbytes(GPT3, x, flash=False) / A100.gpu.memory_bw
    matmuls = fast["compute"] - elementwise
    assert slow["compute"] - elementwise == pytest.approx(matmuls / deepspeed.compute)
    assert slow["tp"] == fast["tp"] and slow["pp"] == fast["pp"]
    # and its pipeline engine runs plain 1F1B: an interleaved layout is refused, with why
    interleaved = replace(x, v=2)
    why = plan.evaluate(GPT3, interleaved, A100, 128, 64, eff, profile=deepspeed).why_not
    assert why[0] == "v=2: deepspeed's pipeline does not interleave (v=1 only)"
    why = plan.evaluate(GPT3, interleaved, A100, 128, 64, eff).why_not  # megatron-core's
    assert not any("interleave" in line for line in why)


@pytest.mark.pure
def test_elementwise_bytes_are_5_passes_over_what_each_layer_keeps():
    x = plan.Layout(dp=1, pp=4, tp=8, b=2)  # 24 layers a stage, m = 8: 4 microbatches in flight
    kept = plan.memory_bytes(GPT3, x, 8, flash=False)["activations"] / (24 * 4)  # one layer's
    assert plan.elementwise_nbytes(GPT3, x, flash=False) == pytest.approx(5 * kept * 24)
    full = plan.Layout(dp=1, pp=4, tp=8, b=2, recompute="full")  # the forward runs twice
    assert plan.elementwise_nbytes(GPT3, full, flash=False) == pytest.approx(7 * kept * 24)


@pytest.mark.pure
def test_problems_name_the_numbers():
    x = plan.Layout(dp=3, pp=5, tp=16, v=2, zero=2, b=4, sp=True)
    found = plan.problems(GPT3, x, gpus=256, batch=100)
    assert "dp=3 x pp=5 x tp=16 != 256 GPUs" in found
    assert not any(line.startswith("layers") for line in found)  # uneven stages are allowed
    few = plan.problems(GPT3, plan.Layout(dp=1, pp=64, tp=4, v=2), gpus=256, batch=64)
    assert few == ["layers=96 are fewer than pp=64 x v=2 stages"]
    assert "batch=100 is not divisible by dp=3 x b=4" in found
    assert not any("ZeRO" in line for line in found)  # ZeRO-2/3 with a pipeline are planned


@pytest.mark.pure
def test_ends_give_the_embedding_and_the_head_a_layer_slot_each():
    # Llama 3 405B as Dubey et al. (section 3.3.2) cut it: 126 layers + 2 ends on 16 x 8 chunks
    llama = plan.SHAPES["llama3-405b"]
    x = plan.Layout(dp=64, pp=16, tp=8, v=8, zero=2, b=1, sp=True, ends=True)
    assert plan.stage_layers(llama, x) == 8  # a middle stage: 8 chunks of 1 layer
    eight, ten = (plan.Shape(name, n, 64, 4, 256, 100, 32) for name, n in (("8", 8), ("10", 10)))
    assert plan.stage_layers(eight, plan.Layout(1, 4, 1)) == 2
    assert plan.stage_layers(eight, plan.Layout(1, 4, 1, ends=True)) == 3  # 10 slots: 3 3 2 2
    assert plan.stage_layers(ten, plan.Layout(1, 2, 1, ends=True)) == 5  # 12 slots: 6 6, one an end
    # memory: the second stage (8 layers, no embedding, Megatron-LM's interleaved warm-up of
    # 2 (pp - 2) + (v - 1) pp + 1 = 141 chunks of one layer) outweighs the first (7 layers + the
    # embedding, 143 chunks of 7/8 of a layer)
    per_layer = plan.layer_activation_bytes(llama, x)
    per_param = 2 + 14 / 64
    first = (7 * llama.layer_params() + llama.vocab * llama.hidden) / 8 * per_param
    second = 8 * llama.layer_params() / 8 * per_param
    assert second + 141 * per_layer > first + 7 * 143 / 8 * per_layer
    got = plan.memory_bytes(llama, x, batch=2048)
    assert got == pytest.approx({"model state": second, "activations": 141 * per_layer})
    # time: the last stage runs 7 layers and the head; the fullest stage 8 layers
    head = 3 * 2 * llama.vocab * llama.hidden
    layer = (llama.step_flops_per_token("none") - head) / llama.layers
    slowest, fullest = plan.stage_flops_per_token(llama, x)
    assert (slowest, fullest) == pytest.approx((max(8 * layer, 7 * layer + head), 8 * layer))
    few = plan.problems(llama, replace(x, pp=32, dp=32, v=8), gpus=8192, batch=2048)
    assert few == ["layers=126 + 2 ends are fewer than pp=32 x v=8 stages"]
    alone = plan.problems(llama, plan.Layout(1024, 1, 8, ends=True), gpus=8192, batch=2048)
    assert alone == ["the embedding and the head as stages (ends) need pp > 1"]


@pytest.mark.pure
def test_cli_ends_names_its_layouts_and_is_refused_on_this_machine(capsys):
    args = ("--model", "llama-7b", "--gpus", "64", "--json", "--ends")
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    layouts = [row["layout"] for row in json.loads(out)["layouts"]]
    assert layouts and all(x["ends"] == (x["pp"] > 1) for x in layouts)
    code, out, err = run_cli(capsys, "--model", "llama-7b", "--gpus", "64", "--ends", "--pp", "2")
    assert code == 0 and " ends " in out, err
    code, _, err = run_cli(capsys, "--cluster", "this", "--ends", "--gpus", "2", "--batch", "16")
    assert code == 2 and "--ends: minidist train's pipeline gives the embedding" in err, err


@pytest.mark.pure
def test_search_ranks_the_feasible_and_explains_the_rest():
    shape = plan.SHAPES["llama-7b"]
    ok, refused = plan_search.search(shape, A100, 64, 512)
    assert ok and all(not q.why_not for q in ok)
    assert [q.seconds for q in ok] == sorted(q.seconds for q in ok)
    assert any(q.why_not[0].startswith("needs") for q in refused)
    # a model that cannot fit anywhere: every layout refused, the memory ones with numbers
    ok, refused = plan_search.search(GPT3, A100, 8, 8)
    assert not ok and any("GB a GPU" in q.why_not[0] for q in refused)


def tp_bytes(comm, b: int, s: int, d: int) -> int:
    block = ParallelTransformerBlock(d, 4, 4 * d, ObservedComm(comm, counter := Counter()), seed=1)
    x = torch.randn(b, s, d, generator=torch.Generator().manual_seed(0))
    block(x).sum().backward()
    return counter.nbytes["all_reduce"]


@pytest.mark.threads
def test_tensor_parallel_bytes_per_layer_are_the_plans():
    # the plan: 4 all-reduces of b s h values per layer (2 forward, 2 backward), float32 here
    b = 2
    s = 8
    d = 32
    for got in run_threads(tp_bytes, 2, b, s, d):
        assert got == 4 * b * s * d * 4


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """`minidist plan args` in this process: (exit code, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="minidist")
    plan_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    code = plan_cli.main(parser.parse_args(["plan", *args]))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.pure
def test_cli_table_json_and_png(tmp_path, capsys):
    png = tmp_path / "plan.png"
    code, out, err = run_cli(capsys, "--model", "llama-7b", "--gpus", "64", "--png", str(png))
    assert code == 0, err
    assert "why the best wins" in out and png.stat().st_size > 1000
    assert "band: the best step" in out and "published runs (-16.1% to +10.2%)" in out
    code, out, _ = run_cli(capsys, "--model", "llama-7b", "--gpus", "64", "--json")
    first = json.loads(out)["layouts"][0]
    assert first["seconds"] == pytest.approx(sum(first["parts"].values()))
    assert first["mwh"] > 0 and first["usd"] > 0 and 0 < first["mfu"] < 1
    # every predicted time carries its error band (plan.error_band), days too
    low, high = first["seconds_band"]
    assert [low, high] == pytest.approx(list(plan.error_band(first["seconds"])))
    assert low < first["seconds"] < high
    assert first["days_band"][0] < first["days"] < first["days_band"][1]


@pytest.mark.pure
def test_cli_flags_pick_layouts_and_no_chunks_without_a_pipeline(capsys):
    picks = ("--dp", "16", "--tp", "2", "--microbatch-size", "2", "--chunks", "1")
    code, out, err = run_cli(capsys, "--model", "llama-7b", "--gpus", "64", "--json", *picks)
    assert code == 0, err
    layouts = [row["layout"] for row in json.loads(out)["layouts"]]
    assert layouts and all((x["dp"], x["tp"], x["b"], x["v"]) == (16, 2, 2, 1) for x in layouts)
    assert {x["pp"] for x in layouts} == {2}  # 64 GPUs = dp 16 x pp 2 x tp 2
    every = list(plan_search.layouts(plan.SHAPES["llama-7b"], cluster.preset("dgx-h100"), 64, 512))
    assert all(x.v == 1 for x in every if x.pp == 1)  # chunks of one stage interleave nothing
    assert {x.v for x in every if x.pp > 1} == {1, 2, 4}


@pytest.mark.pure
def test_the_command_runs_as_minidist_plan():
    command = [sys.executable, "-m", "minidist.cli", "plan", "--model", "llama-7b", "--gpus", "8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Llama 2 7B" in done.stdout, done.stderr


@pytest.mark.pure
@pytest.mark.parametrize(
    "args,line",
    [
        (["--model", "gpt5"], "unknown model 'gpt5'; known: gpt3-175b"),
        (["--cluster", "dgx-z"], "unknown cluster 'dgx-z'; known: dgx-a100"),
        (["--gpus", "0"], "--gpus=0 must be at least 1"),
        (["--tokens", "-1"], "--tokens=-1.0 must be positive"),
        (["--hidden", "100", "--heads", "3"], "hidden=100 is not divisible by heads=3"),
        (["--png", "/no/such/folder/p.png"], "--png /no/such/folder/p.png: its folder does not"),
        (["--gpus", "8", "--batch", "8"], "needs 349.8 GB a GPU; 90% of 80 GB is 72.0"),
    ],
)
def test_cli_refuses_bad_input_with_the_numbers(args, line, capsys):
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and line in err, err


@pytest.mark.threads  # the block is timed on threads of a ThreadsWorld
def test_this_machine_from_a_bench_p2p_file(tmp_path, capsys):
    # a link of 5 us and 2 GB/s, as `minidist bench p2p --json` would print it (mpiexec's own
    # lines after the object are skipped)
    rows = [{"nbytes": n, "time_us": 5 + n / 2e3} for n in (1024, 65536, 1 << 20)]
    path = tmp_path / "p2p.json"
    path.write_text(json.dumps({"bench": "p2p", "rows": rows}) + "\nmpiexec noise\n")
    machine = calibrate.Machine(str(path), plan.SHAPES["minidist"], repeats=3)
    assert machine.cluster.intra.latency == pytest.approx(5e-6, rel=1e-9)
    assert machine.cluster.intra.bandwidth == pytest.approx(2e9, rel=1e-9)
    assert machine.cluster.gpu.memory > 0 and machine.cluster.gpu.memory_bw > 1e8
    x = plan.Layout(1, 1, 2, b=2, scatter=False)
    assert 1e6 < machine.cluster_for(x).gpu.peak_flops < 1e13  # measured once, then kept
    assert machine.rates == {(2, 2): machine.cluster_for(x).gpu.peak_flops}
    # the main job's layouts only: no sequence parallelism, no selective recompute; --dp and
    # --microbatch-size pick; the model is minidist's own unless --model says otherwise
    picks = ["--dp", "2", "--microbatch-size", "2"]
    code, out, err = run_cli(
        capsys,
        "--cluster",
        "this",
        "--calibration",
        str(path),
        "--gpus",
        "2",
        "--batch",
        "16",
        "--json",
        *picks,
    )
    assert code == 0, err
    got = json.loads(out)
    assert got["cluster"] == "this machine" and got["model"]["name"] == "minidist's GPT"
    layouts = [row["layout"] for row in got["layouts"]]
    assert layouts and all(x["dp"] == 2 and x["b"] == 2 and not x["sp"] for x in layouts)
    assert {x["recompute"] for x in layouts} == {"none", "full"}
    assert all(not x["scatter"] for x in layouts)  # minidist's pipeline sends whole activations
    # no band: the published runs validate the presets, not this machine (within 25%: lesson 13)
    assert all(row["seconds_band"] is None for row in got["layouts"])
    code, _, err = run_cli(capsys, "--cluster", "this")
    assert code == 2 and "--cluster this needs --calibration FILE" in err, err
    code, _, err = run_cli(
        capsys, "--cluster", "this", "--calibration", str(path), "--model", "llama-7b"
    )
    assert code == 2 and "no gated MLP (glu=True)" in err, err


@pytest.mark.pure
def test_a_changed_shape_is_named_custom_with_its_own_count(capsys):
    args = ("--layers", "2", "--hidden", "64", "--heads", "4", "--gpus", "1", "--batch", "8")
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    # the FFN keeps 4 x the width, the output layer stays tied to the embedding as GPT-3's
    shape = plan.Shape("", 2, 64, 4, 256, GPT3.vocab, GPT3.seq, tied=True)
    name = "custom (GPT-3 175B with layers=2, hidden=64, heads=4, ffn=256)"
    assert out.startswith(f"{name} ({report.count(shape.params())})"), out
    assert report.count(shape.params()) == "3.4M" and report.count(175e9) == "175.0B"
    code, out, _ = run_cli(capsys, "--model", "llama-7b", "--gpus", "8", "--hidden", "4096")
    assert out.startswith("Llama 2 7B (6.7B)"), out  # a flag equal to the preset's changes nothing
