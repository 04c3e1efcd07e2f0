"""The planner's techniques of large runs: grouped-query attention, context parallelism, a
mixture of experts with expert parallelism, FP8, any interleaving factor and microbatch count,
tp beyond a node, and clusters from a file (minidist/cluster/plan.py, search.py, custom.py).

Tier 0: each formula as its docstring states it, on numbers worked by hand here; the command
line takes the flags and refuses what cannot run with the reason. About 3 s on two cores.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from minidist.cluster import attention, custom, hardware, network, plan, profiles
from minidist.cluster import search as plan_search

try:
    from .test_plan import run_cli
except ImportError:  # run as a script
    from test_plan import run_cli

pytestmark = pytest.mark.pure
A100 = hardware.preset("dgx-a100")
H100 = hardware.preset("dgx-h100")
LLAMA70 = plan.SHAPES["llama-70b"]
LLAMA405 = plan.SHAPES["llama3-405b"]
MIXTRAL = plan.SHAPES["mixtral-8x7b"]


def test_grouped_queries_shrink_keys_and_values_in_parameters_and_activations():
    # Llama 2 70B: 64 query heads, 8 key/value heads of 128: k and v are 8192 x 1024 each
    h = LLAMA70.hidden
    assert LLAMA70.kv_width() == 1024
    assert LLAMA70.attention_params() == 2 * h * h + 2 * h * 1024
    # Korthikanti et al.'s 24/t, term by term: q 2, k and v 4 h_kv/h, the attention's output 2,
    # the gated MLP's three f-wide activations 6 f/h; no dropout: 8 outside tp
    x = plan.Layout(1, 1, 8, b=1)
    split = 2 + 4 * 1024 / h + 2 + 6 * LLAMA70.ffn / h
    want = LLAMA70.seq * h * (8 + split / 8)
    assert plan.layer_activation_bytes(LLAMA70, x) == pytest.approx(want, rel=1e-12)
    gpt = plan.SHAPES["gpt3-175b"]  # GPT-3's shape gives their 24 back
    assert 2 + 4 + 2 + 4 * gpt.ffn / gpt.hidden == 24


def test_head_dim_widens_the_attention_beyond_the_model():
    # Qwen3-30B-A3B's config.json: hidden 2048, 32 heads and 4 kv heads of head_dim 128
    qwen = plan.Shape("qwen3", 48, 2048, 32, 768, 151936, 4096, 4, True, False, head_dim=128)
    assert (qwen.q_width(), qwen.kv_width()) == (4096, 512)
    assert qwen.attention_params() == 2 * 2048 * 4096 + 2 * 2048 * 512
    # the attention's FLOPs are 4 s heads d a token, not 4 s h
    assert qwen.layers_flops_per_token() == 48 * (2 * qwen.layer_params() + 4 * 4096 * 4096)
    # q and the attention's output kept 4096 wide: 2 q/h each in Korthikanti et al.'s terms
    x = plan.Layout(1, 1, 1)
    split = 2 * 2 + 4 * 512 / 2048 + 2 * 2 + 6 * 768 / 2048
    want = 4096 * 2048 * (8 + split)
    assert plan.layer_activation_bytes(qwen, x) == pytest.approx(want, rel=1e-12)
    # the default is hidden / heads: nothing changes for a shape that names no head_dim
    named = replace(LLAMA70, head_dim=128)  # Llama 2 70B: 64 heads of 8192 / 64 = 128
    assert named.attention_params() == LLAMA70.attention_params()
    assert named.layers_flops_per_token() == LLAMA70.layers_flops_per_token()


def test_context_parallelism_holds_a_cpth_of_the_sequence_and_its_ring_hides_behind_attention():
    shape = replace(LLAMA405, seq=131072)
    x = plan.Layout(dp=8, pp=16, tp=8, v=8, zero=2, sp=True, ends=True, cp=16)
    assert plan.problems(shape, x, 16384, 128) == []
    # a rank holds s/cp tokens of every activation, and ring attention keeps no s x s scores
    one = replace(x, cp=1)
    per_layer = plan.layer_activation_bytes(shape, x, flash=False)
    assert per_layer == pytest.approx(plan.layer_activation_bytes(shape, one) / 16)
    # the ring: cp - 1 steps of a chunk's keys and values (2 x 8192 tokens x 1024 / 8 values),
    # forward and twice backward, each step's transfer behind the attention block before it
    chunk = 2 * 2 * 8192 * 1024 / 8
    ring = 3 * 15 * network.p2p_seconds(H100, True, chunk, 0.96)
    rate = 1e15  # attention's FLOPs at this rate: 3 x 4 s h a token, on 8192 tokens, 1/8
    attention = 3 * 4 * 131072 * 16384 * 8192 / 8 / rate
    got = plan.cp_seconds(shape, x, H100, plan.calibrated(H100), 2, rate)
    assert got == pytest.approx(max(0.0, ring - attention))
    slow = rate / 1e3  # a slow GPU: the attention hides it all; a fast one: part shows
    assert plan.cp_seconds(shape, x, H100, plan.calibrated(H100), 2, slow) == 0.0
    assert plan.cp_seconds(shape, x, H100, plan.calibrated(H100), 2, rate * 1e3) > 0
    # the gradients average over dp x cp, 8 x 16 ranks: the cp ranks tp = 8 apart, the dp
    # replicas cp pp tp apart, so one a node; tp 1 and cp 4 within a node: four a node
    assert network.spread_axes([(8, 16), (8 * 16 * 16, 8)], 8) == network.Group(1, 128)
    assert network.spread_axes([(1, 4), (8, 2)], 8) == network.Group(4, 2)
    # cp must leave each rank two chunks of the sequence (one early, one late: balanced)
    odd = plan.problems(replace(shape, seq=131072 + 8), x, 16384, 128)
    assert odd == ["seq=131080 is not divisible by 2 x cp=16 chunks"]


def test_a_long_sequence_is_planned_with_context_parallelism():
    # Llama 3 405B at 131,072 tokens on 16,384 H100s (Dubey et al., table 4: tp 8, cp 16)
    shape = replace(LLAMA405, seq=131072)
    ok, _ = plan_search.search(shape, H100, 16384, 128, picked={"tp": 8})
    assert ok and ok[0].layout.cp > 1, ok[0].layout if ok else None
    short, _ = plan_search.search(LLAMA70, H100, 512, 512, picked={"tp": 8, "pp": 4})
    assert {q.layout.cp for q in short} == {1}  # 4096 tokens: not tried (search.LONG)


def test_mixtral_is_counted_as_its_paper_names_it():
    # Jiang et al. (2024): 47B parameters, 13B active a token (2 of 8 experts)
    assert MIXTRAL.params() / 1e9 == pytest.approx(46.7, abs=0.1)
    active = MIXTRAL.layers * MIXTRAL.active_layer_params() + 2 * MIXTRAL.vocab * MIXTRAL.hidden
    assert active / 1e9 == pytest.approx(12.9, abs=0.1)
    # model FLOPs count the 2 experts a token; executed FLOPs the capacity too
    padded = replace(MIXTRAL, capacity=1.25)
    extra = 0.25 * 2 * MIXTRAL.mlp_params() * 2 * 3 * MIXTRAL.layers  # 3 x 2 x 0.5 expert
    assert padded.model_flops_per_token() == MIXTRAL.model_flops_per_token()
    assert padded.step_flops_per_token() - MIXTRAL.step_flops_per_token() == pytest.approx(extra)


def test_expert_parallelism_shares_out_the_experts_and_moves_tokens_all_to_all():
    x = plan.Layout(dp=16, pp=1, tp=2, zero=1, b=1, sp=True, ep=8)
    dense, expert = plan.layer_params_held(MIXTRAL, x)
    assert expert == 1 * MIXTRAL.mlp_params() / 2  # 8 experts over ep 8, each cut over tp 2
    assert dense == MIXTRAL.attention_params() / 2 + MIXTRAL.hidden * 8
    # ZeRO-1: the dense state over dp = 16 ranks, the experts' over dp / ep = 2
    got = plan.memory_bytes(MIXTRAL, x, 256)["model state"]
    embedding = 2 * MIXTRAL.vocab * MIXTRAL.hidden / 2  # pp = 1: embedding and output layer
    dense_all = 32 * dense + embedding
    want = dense_all * (4 + 12 / 16) + 32 * expert * (4 + 12 / 2)
    assert got == pytest.approx(want, rel=1e-12)
    # 4 all-to-alls a layer (dispatch and combine, forward and backward) of a rank's s b / t
    # tokens x top_k hidden vectors, over 8 ranks 32 apart (one a node)
    tokens = MIXTRAL.seq / 2 * 2
    group = network.spread(2 * 1 * 1, 8, 8)
    assert group == network.Group(4, 2)
    each = network.all_to_all_seconds(H100, group, 2 * tokens * MIXTRAL.hidden, 0.96)
    assert plan.ep_seconds(MIXTRAL, x, H100, plan.calibrated(H100), 2) == pytest.approx(4 * each)
    # each expert's products have the rows the all-to-all brings it from the ep group: 8 ranks'
    # s tokens, top_k 2 of 8 experts each, 2 s rows (one rank's own share would be s / 4)
    h, q, kv, f = MIXTRAL.hidden, MIXTRAL.q_width(), MIXTRAL.kv_width(), MIXTRAL.ffn
    attention, mlp = [(h, (q + 2 * kv) // 2), (q // 2, h)], [(h, 2 * f // 2), (f // 2, h)]
    work = [sum(k * n for k, n in attention), 2 * sum(k * n for k, n in mlp)]  # top_k 2
    rows = [MIXTRAL.seq, 2 * MIXTRAL.seq]
    shares = [
        hardware.wave_share(H100.gpu, r, p) for r, p in zip(rows, (attention, mlp), strict=True)
    ]
    want = sum(work) / sum(w / share for w, share in zip(work, shares, strict=True))
    assert plan.matmul_share(MIXTRAL, x, H100.gpu) == pytest.approx(want, rel=1e-12)
    assert plan.problems(LLAMA70, plan.Layout(8, 1, 8, ep=2), 64, 64) == [
        "ep=2 needs a mixture of experts; Llama 2 70B has none"
    ]
    assert plan.problems(MIXTRAL, plan.Layout(12, 1, 1, ep=3), 12, 12) == [
        "ep=3 must divide experts=8 and dp=12"
    ]


def test_whole_experts_give_their_tensor_parallel_ranks_to_expert_parallelism():
    # etp = 1 (Megatron-Core's expert_tensor_parallel_size=1): the experts are not cut over
    # tp, so ep spans tp's two ranks and then dp's: ep 32 on dp 16 x tp 2, as Qwen3-235B-A22B's
    # preset runs; 8 experts of Mixtral over ep 8 on dp 4 x tp 2
    x = plan.Layout(dp=4, pp=1, tp=2, zero=1, b=1, sp=True, ep=8, etp=1)
    assert x.expert_tp() == 1 and x.ep_axes() == (2, 4)
    dense, expert = plan.layer_params_held(MIXTRAL, x)
    assert expert == MIXTRAL.mlp_params()  # one whole expert a rank
    assert dense == MIXTRAL.attention_params() / 2 + MIXTRAL.hidden * 8
    # ZeRO-1: the experts' state over the ranks that hold the same expert: dp x tp / ep = 1
    got = plan.memory_bytes(MIXTRAL, x, 64)["model state"]
    embedding = 2 * MIXTRAL.vocab * MIXTRAL.hidden / 2
    want = (32 * dense + embedding) * (4 + 12 / 4) + 32 * expert * (4 + 12 / 1)
    assert got == pytest.approx(want, rel=1e-12)
    # the all-to-all group: tp's 2 ranks side by side, then 4 dp replicas 2 apart: one node
    tokens = MIXTRAL.seq / 2 * 2
    group = network.spread_axes([(1, 2), (2, 4)], 8)
    assert group == network.Group(8, 1)
    each = network.all_to_all_seconds(H100, group, 2 * tokens * MIXTRAL.hidden, 0.96)
    assert plan.ep_seconds(MIXTRAL, x, H100, plan.calibrated(H100), 2) == pytest.approx(4 * each)
    # the same experts cut over tp (etp = 0, the default) hold half of each, and ep is dp's
    cut = replace(x, etp=0, ep=4)
    assert plan.layer_params_held(MIXTRAL, cut)[1] == 2 * MIXTRAL.mlp_params() / 2
    assert plan.problems(MIXTRAL, cut, 8, 64) == []
    assert plan.problems(MIXTRAL, replace(x, etp=0), 8, 64) == [
        "ep=8 must divide experts=8 and dp=4"
    ]
    # what cannot run, with the numbers
    assert plan.problems(MIXTRAL, replace(x, ep=3), 8, 64) == [
        "ep=3 must divide experts=8 and tp/etp=2 x dp=4, tp's ranks first"
    ]
    assert plan.problems(MIXTRAL, replace(x, etp=3), 8, 64) == ["etp=3 must divide tp=2"]
    assert plan.problems(LLAMA70, plan.Layout(8, 1, 8, etp=1), 64, 64) == [
        "etp=1 needs a mixture of experts; Llama 2 70B has none"
    ]
    # the search tries whole experts where tp > 1: on 16 GPUs as tp 2 x pp 2 x dp 4, ep 8
    # has room only with them
    ok, _ = plan_search.search(MIXTRAL, H100, 16, 64, picked={"tp": 2, "pp": 2, "ep": 8})
    assert ok and {q.layout.etp for q in ok} == {1}


def test_the_frameworks_rank_order_decides_which_groups_share_a_node():
    # 16 GPUs on nodes of 8, tp 4 x pp 2 x dp 2. minidist's mesh (tp, cp, pp, dp, innermost
    # first): a stage's neighbours 4 apart, the whole pipeline on one node, the two dp replicas
    # 8 apart, one a node. Megatron's and DeepSpeed's (tp, cp, dp, pp): the replicas 4 apart on
    # one node, the stages 8 apart, on two nodes
    x = plan.Layout(dp=2, pp=2, tp=4)
    mine, theirs = profiles.PROFILES["minidist"], profiles.PROFILES["megatron"]
    assert (mine.order, theirs.order) == (profiles.MINIDIST_ORDER, profiles.STAGES_OUTERMOST)
    assert plan.strides(x, mine.order) == {"tp": 1, "cp": 4, "pp": 4, "dp": 8}
    assert plan.strides(x, theirs.order) == {"tp": 1, "cp": 4, "dp": 4, "pp": 8}
    eff = plan.calibrated(A100)
    psi = LLAMA70.params() / 8
    batch = 16
    ours = plan.step(LLAMA70, x, A100, batch, eff, psi=psi, profile=mine)
    megatron = plan.step(LLAMA70, x, A100, batch, eff, psi=psi, profile=theirs)
    # both sync gradients after the flush (all exposed): only the dp ring's placement differs
    for got, group in ((ours["dp"], network.Group(1, 2)), (megatron["dp"], network.Group(2, 1))):
        want = network.collective_seconds(A100, "all_reduce", group, 2 * psi, 0.91)[0]
        assert got == pytest.approx(want)
    # 2 m messages each way of s b h / tp values, all-gathered over tp on arrival: on NVLink in
    # minidist's order, on the sending GPU's card in Megatron's
    act = 2 * LLAMA70.seq * LLAMA70.hidden
    gather = network.collective_seconds(A100, "all_gather", network.Group(4, 1), act, 0.91)[0]
    m = x.microbatches(batch)
    for pp, across in ((ours["pp"], False), (megatron["pp"], True)):
        p2p = network.p2p_seconds(A100, across, act / 4, 0.91)
        assert pp == pytest.approx(2 * m * (p2p + gather))
    same = ("compute", "bubble", "tp", "cp", "ep", "optimizer")
    assert all(ours[k] == megatron[k] for k in same)
    # an ep group of 8 carved out of dp 8 under pp 2 (Qwen3-30B-A3B's on 16 H100s): 2 apart in
    # minidist's order, 4 ranks a node on two nodes; 1 apart in Megatron-Core's, one node
    y = plan.Layout(dp=8, pp=2, tp=1, b=1, ep=8)
    eff = plan.calibrated(H100)
    nbytes = 2 * MIXTRAL.seq * MIXTRAL.top_k * MIXTRAL.hidden  # a rank's tokens, top_k each
    for order, group in (
        (profiles.MINIDIST_ORDER, network.Group(4, 2)),
        (profiles.PROFILES["megatron-core"].order, network.Group(8, 1)),
    ):
        each = network.all_to_all_seconds(H100, group, nbytes, 0.96)
        assert plan.ep_seconds(MIXTRAL, y, H100, eff, 2, order) == pytest.approx(4 * each)


def test_all_to_all_sends_inside_the_node_and_across_at_once():
    n = 1e9
    inside = 3 / 8 * n / H100.intra.bandwidth  # to the 3 other ranks of the node
    across = 4 / 8 * n / (H100.inter.bandwidth * 0.5)  # to the 4 on the other node
    got = network.all_to_all_seconds(H100, network.Group(4, 2), n, 0.5)
    assert got == pytest.approx(H100.inter.latency + max(inside, across))
    one = network.all_to_all_seconds(H100, network.Group(8, 1), n)
    assert one == pytest.approx(H100.intra.latency + 7 / 8 * n / H100.intra.bandwidth)


def test_fp8_runs_the_linear_layers_at_the_fp8_peak_where_the_gpu_has_one():
    # NVIDIA's H100 datasheet: 1,979 TFLOP/s dense FP8, twice its bf16; the A100 has none
    assert H100.gpu.fp8_flops == 1979e12 and A100.gpu.fp8_flops == 0
    ratio = H100.gpu.peak_flops / H100.gpu.fp8_flops  # 989 / 1979: half the time a FLOP
    x = plan.Layout(dp=64, pp=1, tp=8, zero=1, b=1, sp=True)
    eff = plan.calibrated(H100)
    # unfused attention (flash=False): every matmul FLOP at the matmul rate, as the rule says;
    # a fused kernel's measured time stays bf16 whatever fp8 says (test below)
    bf16 = plan.step(LLAMA70, x, H100, 512, eff, flash=False)
    fp8 = plan.step(LLAMA70, replace(x, fp8=True), H100, 512, eff, flash=False)
    linear = plan.linear_share(LLAMA70, "none")
    assert 0.8 < linear < 1  # attention's scores and values and the logits stay in bf16
    memory = plan.elementwise_nbytes(LLAMA70, x, flash=False) / H100.gpu.memory_bw
    memory *= x.microbatches(512)
    matmuls = bf16["compute"] - memory
    assert fp8["compute"] - memory == pytest.approx(matmuls * (1 - linear * (1 - ratio)), rel=1e-9)
    refused = plan.evaluate(LLAMA70, replace(x, fp8=True), A100, 512, 512, plan.calibrated(A100))
    assert refused.why_not == ("fp8: the A100-SXM4-80GB has no FP8 tensor cores",)


def test_a_fused_attention_kernel_takes_its_measured_time_not_its_flops_at_the_matmul_rate():
    # FlashAttention-2 on an H100, head dim 128 (Shah et al., 2024, figures 5(d) and 6(b)): at
    # 8k, forward 333 TFLOP/s on the causal half of 4 s h, backward 318 on 2.5 times that
    assert attention.rates("H100", 128, 8192) == (333e12, 318e12)
    assert attention.rates("H100", 128, 131072) == (335e12, 322e12)  # flat past 16k
    assert attention.rates("H100", 128, 3000) == (298e12, 291e12)  # the nearest shorter
    # on the A100 (Dao, 2023, figure 4(d)) one rate for the forward and backward together
    assert attention.rates("A100", 128, 8192) == (182e12, 182e12)
    assert attention.rates("V100", 128, 8192) is None  # not measured: the matmul rate
    # the Triton FlashAttention of llm-foundry: measured on the A100; on the H100 the first
    # FlashAttention's rates stand in
    assert attention.rates("A100", 128, 2048, "triton") == (68e12, 68e12)
    assert attention.rates("H100", 128, 2048, "triton") == (108e12, 108e12)
    s, h = 8192, LLAMA70.hidden  # Llama 2 70B: 64 heads of 128
    half = 2 * s * h  # a token's causal forward FLOPs in one layer
    want = half / 333e12 + 2.5 * half / 318e12
    assert attention.seconds_per_token("H100", 128, s, h, "none") == pytest.approx(want)
    again = want + half / 333e12  # full recompute runs the forward again
    assert attention.seconds_per_token("H100", 128, s, h, "full") == pytest.approx(again)
    # in a step: the kernel's time replaces 3 x 4 s h at the bf16 matmul rate, layer by layer
    shape = replace(LLAMA70, seq=s)
    x = plan.Layout(dp=64, pp=1, tp=8, zero=1, b=1, sp=True)
    eff = plan.calibrated(H100)
    fused = plan.step(shape, x, H100, 512, eff)["compute"]
    plain = plan.step(shape, x, H100, 512, eff, flash=False)["compute"]
    plain -= plan.elementwise_nbytes(shape, x, flash=False) / H100.gpu.memory_bw * 8
    fused -= plan.elementwise_nbytes(shape, x) / H100.gpu.memory_bw * 8
    rate = H100.gpu.peak_flops * eff.compute * plan.matmul_share(shape, x, H100.gpu)
    tokens = 8 * s / 8  # 8 microbatches of s tokens, over tp 8
    change = shape.layers * tokens * (want - 3 * 4 * s * h / rate)
    assert fused - plain == pytest.approx(change, rel=1e-9)
    # float32 values or no flash: no fused kernel
    assert plan.attention_seconds_per_token(shape, x, H100, False, rate) == 0.0
    # the framework's kernel: llm-foundry's Triton one, at its rates
    triton = half / 135e12 + 2.5 * half / 135e12  # at 8k
    got = plan.attention_seconds_per_token(shape, x, H100, True, rate, "triton")
    assert got == pytest.approx(triton - 3 * 4 * s * h / rate)
    foundry = profiles.PROFILES["llm-foundry"]
    with_flash2 = replace(foundry, attention="flash2")
    triton_step = plan.step(shape, x, H100, 512, eff, profile=foundry)["compute"]
    flash2_step = plan.step(shape, x, H100, 512, eff, profile=with_flash2)["compute"]
    change = shape.layers * tokens * (triton - want)
    assert triton_step - flash2_step == pytest.approx(change, rel=1e-9)


def test_the_search_tries_every_interleaving_that_divides_a_stage():
    # 96 layers on 8 stages: 12 a stage, interleaved by 1, 2, 3 or 4 (search.MOST_V)
    every = plan_search.layouts(plan.SHAPES["gpt3-175b"], A100, 64, 512, picked={"pp": 8})
    assert {x.v for x in every} == {1, 2, 3, 4}


def test_microbatches_tp_cp_ep_and_fp8_are_picked_on_the_command_line(capsys):
    code, out, err = run_cli(capsys, "--model", "llama-7b", "--microbatches", "16", "--json")
    assert code == 0, err
    layouts = [row["layout"] for row in json.loads(out)["layouts"]]
    assert layouts and all(512 // (x["dp"] * x["b"]) == 16 for x in layouts)
    args = ("--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--gpus", "64", "--batch", "64")
    picks = ("--ep", "8", "--cp", "2", "--fp8", "--seq-len", "4096", "--json")
    code, out, err = run_cli(capsys, *args, *picks)
    assert code == 0, err
    got = json.loads(out)["layouts"]
    assert got and all((x["layout"]["ep"], x["layout"]["cp"]) == (8, 2) for x in got)
    assert all(x["layout"]["fp8"] and x["parts"]["ep"] > 0 for x in got)
    code, out, err = run_cli(capsys, *args, "--tp", "2", "--etp", "1", "--ep", "8", "--json")
    assert code == 0, err
    got = [x["layout"] for x in json.loads(out)["layouts"]]
    assert got and all((x["tp"], x["etp"], x["ep"]) == (2, 1, 8) for x in got)
    code, _, err = run_cli(capsys, "--fp8")  # the A100 has none
    assert code == 2 and "fp8: the A100-SXM4-80GB has no FP8 tensor cores" in err, err
    code, _, err = run_cli(capsys, "--model", "llama-7b", "--top-k", "2")
    assert code == 2 and "--top-k, --capacity: Llama 2 7B has no experts" in err, err
    code, _, err = run_cli(capsys, "--capacity", "0")
    assert code == 2 and "--capacity=0.0 must be positive" in err, err


def test_a_cluster_from_a_file(tmp_path, capsys):
    toml = tmp_path / "mine.toml"
    toml.write_text(
        'base = "dgx-h100"\nname = "two cards a node"\nnics = 2\n'
        '[gpu]\nname = "H100 slower"\npeak_tflops = 800\n[inter]\nbandwidth_gb_s = 12.5\n'
    )
    got = custom.load(str(toml))
    assert got.name == "two cards a node" and got.nics == 2 and got.gpus_per_node == 8
    assert got.gpu.peak_flops == 800e12 and got.gpu.fp8_flops == H100.gpu.fp8_flops
    assert got.inter.bandwidth == 12.5e9 and got.inter.latency == H100.inter.latency
    assert plan.generation(got) == "H100"  # its name says Hopper
    whole = {
        "name": "box",
        "gpus_per_node": 4,
        "node_watts": 2000,
        "usd_per_gpu_hour": 1,
        "pue": 1.3,
        "gpu": {"name": "X1", "peak_tflops": 100, "memory_gb": 48, "memory_bw_gb_s": 900,
                "watts": 300, "calibration": "A100"},
        "intra": {"name": "bus", "latency_us": 1, "bandwidth_gb_s": 32},
        "inter": {"name": "eth", "latency_us": 5, "bandwidth_gb_s": 3},
    }  # fmt: skip
    path = tmp_path / "box.json"
    path.write_text(json.dumps(whole))
    box = custom.load(str(path))
    assert (box.gpu.memory, box.intra.latency, box.nics) == (48e9, 1e-6, 1)
    code, out, err = run_cli(capsys, "--cluster", str(path), "--model", "llama-7b", "--gpus", "8")
    assert code == 0 and "on 8 x X1" in out, err
    bad = dict(whole, gpus_per_node=0, colour="red", gpu=dict(whole["gpu"], peak_tflops=math.inf))
    path.write_text(json.dumps(bad))
    code, _, err = run_cli(capsys, "--cluster", str(path))
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    for part in (
        "colour: unknown",
        "gpus_per_node=0: must be a positive number",
        "gpu.peak_tflops",
    ):
        assert part in err, err
    path.write_text(json.dumps({"name": "half"}))
    with pytest.raises(ValueError, match="gpus_per_node: missing"):
        custom.load(str(path))
    code, _, err = run_cli(capsys, "--cluster", str(tmp_path / "none.toml"))
    assert code == 2 and "no such file" in err, err


def test_a_run_that_needs_a_technique_its_layout_lacks_is_warned_of(capsys):
    # Llama 3 405B at 131,072 tokens, held to cp 1: the warning names what attention costs
    args = ("--model", "llama3-405b", "--cluster", "dgx-h100", "--gpus", "16384", "--tp", "8")
    long = ("--batch", "128", "--seq-len", "131072", "--tokens", "1e13")
    code, out, err = run_cli(capsys, *args, *long, "--cp", "1")
    assert code == 0, err
    assert "warning: seq=131072 without context parallelism: attention is 57%" in out, out
    code, out, _ = run_cli(capsys, *args, *long, "--cp", "1", "--json")
    (line,) = json.loads(out)["warnings"]
    assert "Llama 3 ran cp 16 at 131,072 tokens (Dubey et al., 2024, table 4)" in line
    code, out, _ = run_cli(capsys, *args, *long, "--json")  # free to choose: it takes cp
    got = json.loads(out)
    assert got["layouts"][0]["layout"]["cp"] > 1 and got["warnings"] == []
    # Llama 2 70B on 16 A100s fits only with recompute; asked for, it is no news
    code, out, _ = run_cli(capsys, "--model", "llama-70b", "--gpus", "16", "--json")
    assert json.loads(out)["warnings"][0].startswith("fits only with activation recompute")
    code, out, _ = run_cli(
        capsys, "--model", "llama-70b", "--gpus", "16", "--json", "--recompute", "full"
    )
    assert json.loads(out)["warnings"] == []
