"""How a framework runs a step, where it decides the time: which data-parallel traffic hides
behind which compute, what the optimizer step moves through memory, where its ranks sit, which
attention kernel it runs, and (DeepSpeed's and llm-foundry's, fitted) what share of the
calibrated compute rate its runs reach.

Equals: nothing runs here; each profile is a framework's published behaviour, cited below (but the
compute shares, each fitted on one run: cluster/evidence.py), and exposed_dp_seconds() is the rule
it implies. plan.step asks it how much of a step's data-parallel traffic stays on the critical
path; tests/test_plan.py checks each rule on numbers.
Data-parallel traffic per step (t_x: one collective of a rank's 2-byte parameters or gradients,
priced by cluster/network.py; F, B: one microbatch's forward and backward on the stage, B with
what recompute runs again; L the stage's layers):
    after the flush   the gradients' all-reduce (ZeRO-1: reduce-scatter and all-gather) starts
                      once the last microbatch's backward is done: all exposed
    overlapped        gradient buckets reduce during the last microbatch's backward (the others
                      accumulate locally): max(0, t_grad - B) exposed; ZeRO-2 reduce-scatters
                      every microbatch behind its own backward: m max(0, t_rs - B)
    parameters        ZeRO-1/2's all-gather after the optimizer step: exposed, unless the
                      profile gathers them during the next forward: max(0, t_ag - F)
    ZeRO-3            piece by piece (U = L x units pieces, a layer or a module each) with a
                      prefetch of one piece: in the forward each piece's gather hides behind
                      the piece computed before it; in the backward each piece's gather and the
                      reduce-scatter of the piece before hide behind its backward; only the
                      step's very first gather and last reduce-scatter have nothing to hide
                      behind:  a + r + m (U max(0, a - F/U) + U max(0, a + r - B/U))
                      (a = t_ag / U, r = t_rs / U): compute hides at most one piece's traffic
                      at a time, never a whole step's at once
Tensor-parallel traffic (t: one layer's all-reduces, or sp's all-gathers and reduce-scatters,
of one microbatch; G: the layer's linear matmuls on the rank): exposed, t, unless the profile
splits each matmul into chunks and passes one chunk's activations while it multiplies the next
(overlap_tp): max(0, t - G) (exposed_tp_seconds).
Optimizer step: OPTIMIZER_BYTES read and written per parameter it updates, at the memory's
bandwidth (ZeRO: the rank's 1/dp shard).
Rank order: which ranks are neighbours, so which of a group's ranks share a node (plan.strides):
minidist and Llama 3 put the dp replicas outermost, Megatron-LM, Megatron-Core and DeepSpeed the
pipeline's stages.
Ladder: Profile (the data) -> exposed_dp_seconds, exposed_tp_seconds (the rules) -> plan.step.
Paper: the frameworks' code, cited at each profile.   Lesson: lessons/13_beyond_one_machine/.
Run: minidist plan --framework deepspeed ...
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.cluster.evidence import FRAMEWORK_COMPUTE

# The rank orders, innermost first (ep is carved out of dp in both, after tp's spare ranks).
# minidist's mesh (mesh.py: arange(world).view(dp, pp, cp, tp)), as Llama 3 orders its
# parallelism, "[TP, CP, PP, DP]" (Dubey et al., 2024, section 3.3.2): a stage's neighbours are
# tp cp ranks apart, and the dp replicas tp cp pp apart.
MINIDIST_ORDER = "tp-cp-pp-dp"
# Megatron-LM's (megatron/mpu/initialize.py, initialize_model_parallel, as Narayanan et al. ran
# it: its docstring's 16 GPUs of tp 2 x pp 4 make the data-parallel groups [g0, g2], [g1, g3],
# ... and the pipeline groups [g0, g4, g8, g12], ...: a stage's ranks are consecutive),
# Megatron-Core's (megatron/core/parallel_state.py,
# initialize_model_parallel(order="tp-cp-ep-dp-pp")) and DeepSpeed's (deepspeed/runtime/pipe/
# topology.py: PipeModelDataParallelTopology's axes ['pipe', 'data', 'model'], laid out
# row-major, the last axis varying fastest): the dp replicas tp cp apart, the stages outermost.
STAGES_OUTERMOST = "tp-cp-dp-pp"


@dataclass(frozen=True)
class Profile:
    """A framework's execution, as far as the plan prices it: whether gradient collectives run
    during the last microbatch's backward (overlap_grads) and ZeRO-1/2's parameter all-gather
    during the next forward (overlap_params); units: how many pieces ZeRO-3 gathers a layer in,
    one ahead of the other; source: where that is written; order: the rank order, innermost
    first, which decides which ranks of a group share a node (plan.strides); overlap_tp: the
    tensor-parallel collectives run behind the layer's matmuls; compute: the share of the GPU's
    calibrated compute efficiency (evidence.CALIBRATED, fitted on Megatron-LM's and Llama 3's
    runs) the framework's runs reach: fitted where evidence.FRAMEWORK_COMPUTE has it, 1 for
    the others; interleaves: its pipeline runs an interleaved schedule (v > 1), else
    plan.evaluate refuses v > 1; attention: its fused attention kernel, where a run has one
    (cluster/attention.py's KERNELS)."""

    name: str
    overlap_grads: bool
    overlap_params: bool
    source: str
    units: int = 1
    order: str = MINIDIST_ORDER
    overlap_tp: bool = False
    compute: float = 1.0
    interleaves: bool = True
    attention: str = "flash2"


# [MEGATRON] NVIDIA/Megatron-LM as Narayanan et al. (SC 2021) and Korthikanti et al. (2022) ran
#   it: megatron/training.py train_step runs forward_backward_func over every microbatch, then
#   model.allreduce_gradients() (its own "local" DistributedDataParallel, the default --DDP-impl).
# [DDP] PyTorch DistributedDataParallel (torch/nn/parallel/distributed.py: buckets of gradients
#   all-reduced from autograd hooks as the backward produces them; no_sync() for the microbatches
#   before the last, as Megatron-LM's forward_backward_no_pipelining wraps them);
#   examples/sc21/run_table_1.sh of Megatron-LM sets DDP=torch up to 18B (so Megatron-LM's rank
#   order).
# [MCORE] Megatron-Core: --overlap-grad-reduce ("overlap DDP grad reduce" during the backward of
#   the last microbatch) and --overlap-param-gather (the distributed optimizer's all-gather during
#   the next forward), megatron/training/arguments.py.
# [TP-OVERLAP] Megatron-Core's --tp-comm-overlap ("Enables the overlap of Tensor parallel
#   communication and GEMM kernels", megatron/training/arguments.py), Transformer Engine's
#   userbuffers, as NVIDIA Megatron-Bridge's performance recipes for Llama 3 and 3.1 on H100 run
#   it (scripts/performance/configs/llama3/llama3_llm_pretrain.py and llama31/, tags v0.2.0
#   and v0.5.0: comm_overlap.tp_comm_overlap_cfg = userbuffers_fp8_h100_h8192_tp4_mbs1_
#   seqlen8192, ..._h16384_tp8_cp2_mbs1_seqlen8192); its Qwen3 recipes set
#   CommOverlapConfig(tp_comm_overlap=False) on H100.
# [DEEPSPEED] microsoft/DeepSpeed: the pipeline engine's TrainSchedule (deepspeed/runtime/pipe/
#   schedule.py) issues ReduceTiedGrads, ReduceGrads and OptimizerStep after the last backward;
#   ZeRO-3 reduces with overlap_comm (ZERO3_OPTIMIZATION_OVERLAP_COMM_DEFAULT = True,
#   deepspeed/runtime/zero/constants.py) and prefetches parameters up to
#   stage3_prefetch_bucket_size (5e7) ahead: about the next layer's matrices. Its pipeline does
#   not interleave: the engine trains with TrainSchedule, plain 1F1B (schedule.py holds it and
#   the inference schedule, nothing interleaved).
# [FSDP] PyTorch FullyShardedDataParallel (Zhao et al., VLDB 2023, section 3.3: backward
#   prefetching, forward prefetching and a rate limiter of in-flight all-gathers): each unit's
#   reduce-scatter runs during the backward, its all-gather one unit ahead. MosaicML's MPT
#   benchmarks (llm-foundry) and Llama 3's training (Dubey et al., 2024, section 3.3.2) run so.
# [LLM-FOUNDRY] MosaicML's llm-foundry as its MPT benchmarks ran it (scripts/train/benchmarking/:
#   submit_benchmarks.py, --attn_impl default 'triton', which sweep.sh never sets, in every
#   version of the README's tables, through b2a43a1 of 2023-10-19 that added the H100 rows):
#   FSDP as [FSDP], attention by llmfoundry/models/layers/flash_attn_triton.py, a copy of
#   FlashAttention's Triton implementation.
PROFILES = {
    "megatron": Profile(
        "megatron", False, False, "[MEGATRON] gradients after the flush", order=STAGES_OUTERMOST
    ),
    "ddp": Profile(
        "ddp", True, False, "[DDP] buckets during the last backward", order=STAGES_OUTERMOST
    ),
    "megatron-core": Profile(
        "megatron-core", True, True, "[MCORE] --overlap-grad-reduce/param", order=STAGES_OUTERMOST
    ),
    "megatron-core-tp-overlap": Profile(
        "megatron-core-tp-overlap",
        True,
        True,
        "[MCORE] and [TP-OVERLAP] tp collectives behind the matmuls",
        order=STAGES_OUTERMOST,
        overlap_tp=True,
    ),
    # ZeRO-3 by module: the four matrices of a layer, each about a prefetch bucket
    "deepspeed": Profile(
        "deepspeed",
        False,
        False,
        "[DEEPSPEED] gradients after the flush",
        4,
        order=STAGES_OUTERMOST,
        compute=FRAMEWORK_COMPUTE["deepspeed"],
        interleaves=False,
    ),
    # a unit a transformer block, as llm-foundry and Llama 3 wrap them
    "fsdp": Profile("fsdp", True, True, "[FSDP] reduce-scatter in the backward, gather ahead"),
    # FSDP's, with a Triton attention kernel and its own compute share (fitted: evidence.py)
    "llm-foundry": Profile(
        "llm-foundry",
        True,
        True,
        "[LLM-FOUNDRY] FSDP, Triton FlashAttention",
        compute=FRAMEWORK_COMPUTE["llm-foundry"],
        attention="triton",
    ),
    # minidist's main job (gpt/train.py): gradients synced after the whole pipeline step;
    # ZeRO-3 gathers one unit ahead and reduce-scatters behind the next backward
    # (zero/gatherer.py), a unit every module with parameters: a block's two norms and four
    # linear layers
    "minidist": Profile("minidist", False, False, "gpt/train.py: after the step", 6),
}
DEFAULT = "megatron-core"

# A mixed-precision Adam step as Megatron-LM's optimizer runs it (megatron/optimizer/optimizer.py,
# Float16OptimizerWithFloat16Params.step), bytes per parameter: the 2-byte gradient copied into a
# float32 main gradient (2 + 4), unscaled and checked for inf/nan (4 + 4), its norm for clipping
# (4), Adam on the float32 parameter, gradient and two moments (16 read, 12 written), the
# parameter copied back to 2 bytes (4 + 2), the gradient buffer zeroed (2). A count, not a fit.
OPTIMIZER_BYTES = 54


def exposed_tp_seconds(profile: Profile, t: float, gemm: float) -> float:
    """Seconds of one layer's tensor-parallel traffic (t, one microbatch's) left on the critical
    path: all of it, or with overlap_tp what the layer's linear matmuls (gemm seconds) cannot
    cover (the docstring's rule)."""
    return max(0.0, t - gemm) if profile.overlap_tp else t


def exposed_dp_seconds(profile: Profile, zero: int, t: dict, m: int, f: float, b: float, L: int):
    """Seconds of a step's data-parallel traffic left on the critical path (the docstring's
    rules). t: one collective's seconds by kind ("all_reduce", "reduce_scatter", "all_gather");
    m microbatches; f, b: one microbatch's forward and backward seconds on the stage; L: its
    layers (ZeRO-3 gathers them in L x profile.units pieces of equal time: a, r the docstring's
    per piece)."""
    if zero == 3:
        units = L * profile.units
        a = t["all_gather"] / units
        r = t["reduce_scatter"] / units
        forward = units * max(0.0, a - f / units)
        backward = units * max(0.0, a + r - b / units)
        return a + r + m * (forward + backward)
    hide = b if profile.overlap_grads else 0.0
    if zero == 0:
        return max(0.0, t["all_reduce"] - hide)
    rounds = m if zero == 2 else 1  # ZeRO-2 reduce-scatters every microbatch's gradients
    grads = rounds * max(0.0, t["reduce_scatter"] - hide)
    params = max(0.0, t["all_gather"] - (f if profile.overlap_params else 0.0))
    return grads + params
