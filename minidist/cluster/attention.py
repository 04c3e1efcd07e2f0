"""Attention kernels as measured: the FLOP/s a fused attention kernel reaches, by kernel, GPU,
head dimension and sequence length, and what that makes of the attention's time in a layer.

Equals: nothing runs here; the rates are published measurements (KERNELS below), the seconds a
formula of them. tests/test_plan_techniques.py checks the formula on numbers worked by hand.
Counting: a fused kernel (FlashAttention; Dao et al., 2022) computes the 4 s h FLOPs a token's
attention forward has (scores and values, shapes.py) only where the causal mask lets it:
about half of them, and the kernel benchmarks count that half (FlashAttention-2's
benchmark_flash_attention.py: 4 s^2 d heads / 2 with a causal mask); its backward runs the
scores again, 2.5 forwards' FLOPs (the same file: bwd 2.5 f). A layer's attention, per token
on all tp ranks: forward 2 s h / R_fwd, backward 2.5 x 2 s h / R_bwd, and the forward again
under full recompute. The planner counts 3 x 4 s h (+ 4 s h recomputed) at its matmul rate
where attention is not fused: no flash (Megatron-LM's batched matmuls, its softmax priced as
bytes), or float32 values (the kernels run bf16 and fp16: this machine's plans), or a GPU
generation with no measured rate. Which kernel a run has is its framework's
(profiles.Profile.attention): FlashAttention-2, or the Triton FlashAttention MosaicML's
llm-foundry ran.
Ladder: KERNELS (data) -> rates (by sequence, clamped to the measured range) ->
seconds_per_token -> plan.step prices a stage's attention with it.
Papers: Shah et al., "FlashAttention-3: Fast and Accurate Attention with Asynchrony and
Low-precision" (2024, arXiv:2407.08608), figures 5 and 6; Dao, "FlashAttention-2: Faster
Attention with Better Parallelism and Work Partitioning" (2023, arXiv:2307.08691), figure 4.
Lesson: lessons/13_beyond_one_machine/.
Run: minidist plan --model llama3-405b --cluster dgx-h100 --gpus 8192 --batch 2048
"""

from __future__ import annotations

# [FA3] Shah et al. (2024), figure 5(d), "Attention forward speed (FP16/BF16) on H100 80GB
#       SXM5", with causal mask, head dim 128, FlashAttention-2's bars; figure 6(b), backward,
#       head dim 128, FlashAttention-2's bars: TFLOP/s at sequence lengths 512 to 16k (batch
#       x sequence = 16k tokens, hidden 2048). The backward figure has no causal panel: its
#       rates without the mask stand in (an assumption). FlashAttention-2 is what PyTorch's
#       scaled_dot_product_attention runs on these GPUs (TorchTitan's), and it stands in for the
#       other validated runs' fused kernels (Transformer Engine's, Llama 3's own);
#       FlashAttention-3's own bars are faster (forward 292-616 TFLOP/s).
# [FA2] Dao (2023), figure 4(d), "Attention forward + backward speed (A100 80GB SXM4)", with
#       causal mask, head dim 128 (the same figure as assets/flash2_a100_fwd_bwd_benchmark.png
#       in Dao-AILab/flash-attention): TFLOP/s of the forward and backward together, at
#       512 to 16k, for FlashAttention-2 and for FlashAttention's Triton implementation
#       (flash_attn/flash_attn_triton.py). One rate for both passes: the figure has them
#       together (on the H100 the two differ by 2-10%).
# [FA2-H100] The same benchmark on an H100 80GB SXM5 (assets/flash2_h100_fwd_bwd_benchmark.png,
#       panel (d): causal, head dim 128), FlashAttention's (the first version's) bars, which
#       stand in for the Triton kernel there (not benchmarked on the H100; on the A100 the two
#       ran within 3% of each other: 68 and 69 TFLOP/s at 2k).
# The H200 takes the H100's (its calibration's generation: the same SMs and peak; an
# assumption).
SEQUENCES = (512, 1024, 2048, 4096, 8192, 16384)
# kernel: {(GPU generation, head dim): (forward TFLOP/s by sequence, backward TFLOP/s by
# sequence)}
KERNELS = {
    "flash2": {
        ("H100", 128): ((191, 260, 298, 319, 333, 335), (214, 260, 291, 310, 318, 322)),  # [FA3]
        ("A100", 128): ((99, 133, 155, 173, 182, 189),) * 2,  # [FA2]
    },
    # MosaicML's llm-foundry: llmfoundry/models/layers/flash_attn_triton.py, "Copied from
    # https://github.com/HazyResearch/flash-attention/blob/eff9fe6.../flash_attn_triton.py"
    "triton": {
        ("A100", 128): ((50, 61, 68, 74, 78, 80),) * 2,  # [FA2]
        ("H100", 128): ((98, 109, 108, 126, 135, 137),) * 2,  # [FA2-H100], standing in
    },
}


def rates(generation: str, head_dim: int, seq: int, kernel: str = "flash2"):
    """(forward, backward) FLOP/s of the kernel on a causal sequence of seq keys, as the
    kernel benchmarks count FLOPs (the causal half), or None where none is measured. Between
    measured lengths the nearest shorter one; beyond 16k the 16k rate (the bars are flat from
    8k); below 512 the 512 rate. Other head dims take the nearest tabled one of the GPU (the
    validated runs all have heads of 128: a simplification elsewhere)."""
    measured = KERNELS[kernel]
    dims = [d for gen, d in measured if gen == generation]
    if not dims:
        return None
    dim = min(dims, key=lambda d: abs(d - head_dim))
    forward, backward = measured[(generation, dim)]
    at = max([i for i, s in enumerate(SEQUENCES) if s <= seq] or [0])
    return forward[at] * 1e12, backward[at] * 1e12


def seconds_per_token(
    generation: str,
    head_dim: int,
    seq: int,
    hidden: int,
    recompute: str,
    keys: int = 0,
    kernel: str = "flash2",
) -> float | None:
    """Seconds one layer's fused causal attention takes per token, training, on all tp ranks
    together (divide by tp for one rank): forward 2 s h FLOPs (the causal half of 4 s h) at
    the forward rate, backward 2.5 times that at the backward rate, and the forward again with
    full recompute (selective recompute's attention core is the kernel's own backward). seq:
    the sequence (s); keys: the length a kernel call runs over, where the rate is looked up
    (default s; context parallelism's ring runs blocks of s/cp); kernel: KERNELS' name. None
    where no rate is measured."""
    found = rates(generation, head_dim, keys or seq, kernel)
    if found is None:
        return None
    forward, backward = found
    causal = 2 * seq * hidden  # the causal half of the forward's 4 s h
    forwards = 2 if recompute == "full" else 1
    return forwards * causal / forward + 2.5 * causal / backward
