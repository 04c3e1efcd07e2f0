"""Published throughput of large training runs on NVIDIA GPUs, each with its source.

Every number is read from the source named by its row (SOURCES; the quoted evidence in EVIDENCE);
ASSUMED lists what a source does not state and the planner needed. plan.CALIBRATED is fitted on
three rows and each fitted framework's share of its compute rate on one (evidence.py names them);
tests/test_published_runs.py checks the planner on every other row.
Sources report one of: the iteration time (seconds), MFU (model FLOPs over peak, recompute not
counted: Chowdhery et al., PaLM, appendix B), Megatron-LM's achieved TFLOP/s per GPU (tflops),
which counts the extra forward pass of full recompute (Narayanan et al., SC 2021, section 5.1,
equation 3), or tokens a second a GPU (tokens: TorchTitan's and Megatron-Bridge's tables).
Every row with flash attention is priced at its framework's kernel's measured rates
(minidist/cluster/attention.py): FlashAttention-2's, an assumption where a source does not name
its kernel, or the Triton FlashAttention llm-foundry's MPT benchmarks ran.
Left out: PTD GPT-174.6B on 384 A100 (Narayanan Table 2) (tp and pp not stated (only their product,
96)); PTD GPT-174.6B on 768 A100 (Narayanan Table 2) (the same); PTD GPT-174.6B on 1536 A100
(Narayanan Table 2) (the same); OPT-175B on 992 A100-80GB (tensor-parallel size and batch in
sequences not stated). Not yet added (FP8 and context parallelism are modelled now): NeMo 24.07
GPT3-175B FP8 on 128 and on 512 H100; NeMo 24.07 LLAMA3-70B FP8 on 64 H100; NeMo 24.07 LLAMA3-8B
FP8 on 8 H100. Megatron-Bridge 25.11's DGX-H100 table: Qwen3-30B-A3B is r54, LLAMA3_70B r55,
LLAMA3.1_405B r56, Qwen3_235B_a22B r57; left out: LLAMA3_8B (its recipe recomputes 5 of the 32
layers, recompute_num_layers=5, which no Layout expresses) and GPT OSS 120B (its row's GA of 2
contradicts GBS 512 / (MBS 4 x DP 16) = 8; and attention sinks and alternating sliding windows,
not modelled). Megatron-Bridge 26.06's DGX-H100 rows, the last release with any: Qwen3_30B_a3B
is r58, LLAMA3.1_405B r59; left out: Nemotron_3_Nano (Mamba layers among its attention layers,
not modelled). The releases between 25.11 and 26.06 ran the same models on H100s too; only the
last of them is taken, so that no row is chosen for its error.
"""

SOURCES = {
    "n21": (
        "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
        "Megatron-LM', SC 2021 (arXiv:2104.04473); microbatch sizes and interleaving from its "
        "examples/sc21/run_table_1.sh"
    ),
    "k22": (
        "Korthikanti et al., 'Reducing Activation Recomputation in Large Transformer Models', "
        "MLSys 2023 (arXiv:2205.05198)"
    ),
    "s22": (
        "Smith et al., 'Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B', "
        "arXiv:2201.11990 (2022), section 2.4, as quoted by llm-analysis's README (the paper "
        "itself not read)"
    ),
    "b22": (
        "BigScience, BLOOM-176B training (Le Scao et al., arXiv:2211.05100, and the bigscience "
        "training README and log)"
    ),
    "x22": (
        "Black et al., 'GPT-NeoX-20B', arXiv:2204.06745 (2022); layout from EleutherAI/gpt-neox "
        "configs/20B.yml; 117 TFLOP/s from secondary notes"
    ),
    "d24": (
        "Dubey et al., 'The Llama 3 Herd of Models', arXiv:2407.21783 (2024), table 4 and section "
        "3.3.2"
    ),
    "m23": (
        "MosaicML llm-foundry, scripts/train/benchmarking/README.md (MFU tables) and the mpt yamls"
    ),
    "t24": (
        "Liang et al., 'TorchTitan: One-stop PyTorch native solution for production ready LLM "
        "pre-training', ICLR 2025 (arXiv:2410.06511), section 3.1 and tables 1, 2, 3 and 5; the "
        "sequence length from torchtitan's train_configs (llama3_8b.toml, llama3_70b.toml: "
        "seq_len = 8192); the GPUs' memory bandwidth from its docs/performance.md"
    ),
    "mb25": (
        "NVIDIA NeMo Megatron-Bridge, docs/performance-summary.md, '25.11 NeMo Container', "
        "Pre-Training Performance, System: DGX-H100 (docs.nvidia.com/nemo/megatron-bridge/latest/"
        "performance-summary.html); the model's shape from Qwen/Qwen3-30B-A3B's config.json; "
        "what the table leaves out of the Llama rows' layouts from the repository's v0.2.0 tag "
        "(2025-11-26, the release before the 25.11 table): scripts/performance/configs/llama3/ "
        "and llama31/ (workload_base_configs.py, *_llm_pretrain.py) and "
        "src/megatron/bridge/recipes/llama/llama3.py"
    ),
    "mb26": (
        "NVIDIA NeMo Megatron-Bridge, docs/performance-summary-archive.md, '26.06 NeMo Container', "
        "Pre-Training Performance, the DGX-H100 rows (the last release whose table has H100 rows; "
        "26.06.01's and 26.08's have none); what the table leaves out from the repository's "
        "v0.5.0 tag (2026-06-16): scripts/performance/configs/qwen/qwen3_workload_base_configs.py "
        "and qwen3_llm_pretrain.py, configs/llama/llama31_workload_base_configs.py and "
        "src/megatron/bridge/recipes/llama/llama3.py"
    ),
}

# Each source's framework, as minidist/cluster/profiles.py names it (what traffic hides behind
# compute, and the rank order; the profiles cite the frameworks' code). Megatron-LM (n21, k22):
# its own DDP, gradients after the last microbatch; except where examples/sc21/run_table_1.sh sets
# DDP=torch (PyTorch's DistributedDataParallel), up to 18B: r00 to r03. Narayanan et al.'s ZeRO-3
# rows ran DeepSpeed's ZeRO-3 (section 5.2: "ZeRO-3 ... as implemented in DeepSpeed"). MT-NLG,
# BLOOM and GPT-NeoX-20B (s22, b22, x22) ran DeepSpeed's pipeline engine. MosaicML's MPT
# benchmarks (m23) ran llm-foundry: PyTorch FSDP (its yamls: fsdp_config) and the Triton
# FlashAttention its benchmark script sets (profiles.py cites it); Llama 3 (d24) its own
# FSDP (Dubey et al., section 3.3.2). Megatron-Bridge (mb25, mb26) runs Megatron-Core, and its
# Llama recipes on H100 overlap tensor-parallel traffic with the matmuls as well (r55, r56, r59:
# comm_overlap.tp_comm_overlap_cfg, cited at the profile), its Qwen3 recipes not.
PROFILE = {
    "n21": "megatron",
    "k22": "megatron",
    "s22": "deepspeed",
    "b22": "deepspeed",
    "x22": "deepspeed",
    "d24": "fsdp",
    "m23": "llm-foundry",
    "t24": "fsdp",
    "mb25": "megatron-core",
    "mb26": "megatron-core",
    **dict.fromkeys(("r00", "r01", "r02", "r03"), "ddp"),
    **dict.fromkeys(("r10", "r11", "r12", "r13", "r14", "r15"), "deepspeed"),
    **dict.fromkeys(("r55", "r56", "r59"), "megatron-core-tp-overlap"),
}

# Whose models train without dropout, so no layer keeps a dropout mask for backward (torch's
# dropout at p = 0 returns its input): GPT-NeoX-20B (configs/20B.yml: "hidden-dropout": 0,
# "attention-dropout": 0); MosaicML's MPT (llm-foundry's MPTConfig defaults attn_pdrop,
# resid_pdrop and emb_pdrop to 0.0, and the benchmarked yamls set none of them); Llama (the
# released model code, meta-llama/llama llama/model.py, has no dropout layer, and the paper
# names none); Megatron-Bridge's Llama and Qwen3 models (src/megatron/bridge/models/llama/
# llama_provider.py and qwen/qwen_provider.py at its v0.2.0 tag: hidden_dropout and
# attention_dropout 0.0). Megatron-LM's and Megatron-DeepSpeed's runs keep their default of 0.1
# (BLOOM's tr11-176B-ml.slurm sets no --hidden-dropout or --attention-dropout).
NO_DROPOUT = ("x22", "m23", "d24", "t24", "mb25", "mb26")

# Whose output layer is the embedding's matrix, its parameters counted once (plan.Shape.tied), as
# each source counts them: Megatron-LM's GPT computes the logits with the word embeddings' weight
# (megatron/model/gpt_model.py, parallel_lm_logits(..., word_embeddings_weight)), so Narayanan et
# al.'s and Korthikanti et al.'s models and MT-NLG (174.6B for GPT-3's shape: Narayanan et al.,
# table 2); BLOOM and MPT likewise (their Hugging Face configs: BloomForCausalLM ties lm_head to
# the word embeddings; MPT's logits unembed transformer.wte). GPT-NeoX-20B ("tie_word_embeddings":
# false in EleutherAI/gpt-neox-20b's config) and Llama (separate tok_embeddings and output) do not.
TIED = ("n21", "k22", "s22", "b22", "m23")

# Whose pipelines give the embedding and the head a layer's slot each (plan.Layout.ends): Llama 3
# "reduce[s] one Transformer layer each from the first and the last stages", so that "the first
# model chunk on the first stage has only the embedding, and the last model chunk on the last
# stage has only output projection and loss calculation" (Dubey et al., section 3.3.2). With
# 126 layers on 16 stages that leaves a chunk empty only if a chunk holds one layer: 126 + 2
# slots over 16 ranks, v = 8 chunks each (derived, the paper names no V; its bubble, (PP - 1) /
# (V M), then doubles from 8,192 GPUs, M = 32, to 16,384, M = 16, as its MFU falls 43% -> 41%).
# Megatron-Bridge's Llama 3.1 405B (r56) likewise: llama31_405b_pretrain_config sets
# account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split (its
# recipes/llama/llama3.py), 126 + 2 slots over 8 stages of v = 8 chunks; its Qwen3-235B-A22B
# (r57) too (qwen3_235b_a22b_pretrain_config, recipes/qwen/qwen3_moe.py): 94 + 2 slots over 8
# stages of v = 4 chunks; its 26.06 Llama 3.1 405B (r59) as r56 (the same recipe at v0.5.0). A
# source or a row.
ENDS = ("d24", "r56", "r57", "r59")

# layers, hidden, heads, kv heads, ffn, gated (glu), vocab, sequence length
SHAPES = {
    "L24h2304": (24, 2304, 24, 24, 9216, False, 51200, 2048),
    "L30h3072": (30, 3072, 32, 32, 12288, False, 51200, 2048),
    "L36h4096": (36, 4096, 32, 32, 16384, False, 51200, 2048),
    "L40h6144": (40, 6144, 48, 48, 24576, False, 51200, 2048),
    "L48h8192": (48, 8192, 64, 64, 32768, False, 51200, 2048),
    "L60h10240": (60, 10240, 80, 80, 40960, False, 51200, 2048),
    "L80h12288": (80, 12288, 96, 96, 49152, False, 51200, 2048),
    "L96h16384": (96, 16384, 128, 128, 65536, False, 51200, 2048),
    "L105h20480": (105, 20480, 128, 128, 81920, False, 51200, 2048),
    "L128h25600": (128, 25600, 160, 160, 102400, False, 51200, 2048),
    "L96h12288": (96, 12288, 96, 96, 49152, False, 51200, 2048),
    "L48h6144": (48, 6144, 64, 64, 24576, False, 51200, 2048),
    "L70h14336v250": (70, 14336, 112, 112, 57344, False, 250680, 2048),
    "L44h6144": (44, 6144, 64, 64, 24576, False, 51200, 2048),
    "L126h16384s8192v128": (126, 16384, 128, 8, 53248, True, 128000, 8192),
    "L126h16384s131072v128": (126, 16384, 128, 8, 53248, True, 128000, 131072),
    "L32h4096s8192v128": (32, 4096, 32, 8, 14336, True, 128256, 8192),
    "L32h4096s131072v128": (32, 4096, 32, 8, 14336, True, 128256, 131072),
    "L80h8192s8192v128": (80, 8192, 64, 8, 28672, True, 128256, 8192),
    "L80h8192v50": (80, 8192, 64, 64, 32768, False, 50368, 2048),
    "L48h7168v50": (48, 7168, 56, 56, 28672, False, 50368, 2048),
    "L40h5120v50": (40, 5120, 40, 40, 20480, False, 50368, 2048),
    "L32h4096v50": (32, 4096, 32, 32, 16384, False, 50368, 2048),
    "L48h2048e128": (48, 2048, 32, 4, 768, True, 151936, 4096),
    "L94h4096e128": (94, 4096, 64, 4, 1536, True, 151936, 4096),
}
# What the columns of SHAPES cannot hold: heads wider than hidden / heads, a mixture of experts.
# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B's config.json on Hugging Face): hidden_size 2048, 48 layers,
# 32 attention heads and 4 key/value heads of head_dim 128 (queries 4096 wide: twice the
# model), num_experts 128 of moe_intermediate_size 768, num_experts_per_tok 8, vocab_size
# 151936, tie_word_embeddings false; no shared expert. Qwen3-235B-A22B (Megatron-Bridge's
# Qwen3MoEModelProvider235B_A22B and the Qwen3MoEModelProvider it extends, src/megatron/bridge/
# models/qwen/qwen_provider.py at its v0.2.0 tag): 94 layers, hidden_size 4096, 64 attention
# heads and 4 query groups, kv_channels 128, 128 experts of moe_ffn_hidden_size 1536, top 8,
# vocab_size 151936, share_embeddings_and_output_weights False.
SHAPE_MORE = {
    "L48h2048e128": {"head_dim": 128, "experts": 128, "top_k": 8},
    "L94h4096e128": {"head_dim": 128, "experts": 128, "top_k": 8},
}

# id: shape, source, GPU, GB, GPUs, tp, pp, v, ZeRO, microbatch, batch, recompute, sp, flash
RUNS = {
    "r00": ("L24h2304", "n21", "A100", 80, 32, 1, 1, 1, 0, 16, 512, "full", 0, 0),
    "r01": ("L30h3072", "n21", "A100", 80, 64, 2, 1, 1, 0, 16, 512, "full", 0, 0),
    "r02": ("L36h4096", "n21", "A100", 80, 128, 4, 1, 1, 0, 16, 512, "full", 0, 0),
    "r03": ("L40h6144", "n21", "A100", 80, 256, 8, 1, 1, 0, 8, 1024, "full", 0, 0),
    "r04": ("L48h8192", "n21", "A100", 80, 512, 8, 2, 1, 0, 4, 1536, "full", 0, 0),
    "r05": ("L60h10240", "n21", "A100", 80, 1024, 8, 4, 3, 0, 2, 1792, "full", 0, 0),
    "r06": ("L80h12288", "n21", "A100", 80, 1536, 8, 8, 2, 0, 2, 2304, "full", 0, 0),
    "r07": ("L96h16384", "n21", "A100", 80, 1920, 8, 16, 2, 0, 1, 2160, "full", 0, 0),
    "r08": ("L105h20480", "n21", "A100", 80, 2520, 8, 35, 3, 0, 1, 2520, "full", 0, 0),
    "r09": ("L128h25600", "n21", "A100", 80, 3072, 8, 64, 1, 0, 1, 3072, "full", 0, 0),
    "r10": ("L96h12288", "n21", "A100", 80, 384, 1, 1, 1, 3, 4, 1536, "full", 0, 0),
    "r11": ("L96h12288", "n21", "A100", 80, 768, 1, 1, 1, 3, 2, 1536, "full", 0, 0),
    "r12": ("L96h12288", "n21", "A100", 80, 1536, 1, 1, 1, 3, 1, 1536, "full", 0, 0),
    "r13": ("L105h20480", "n21", "A100", 80, 640, 1, 1, 1, 3, 4, 2560, "full", 0, 0),
    "r14": ("L105h20480", "n21", "A100", 80, 1120, 1, 1, 1, 3, 2, 2240, "full", 0, 0),
    "r15": ("L105h20480", "n21", "A100", 80, 2240, 1, 1, 1, 3, 1, 2240, "full", 0, 0),
    "r19": ("L105h20480", "n21", "A100", 80, 560, 8, 35, 1, 0, 1, 2240, "full", 0, 0),
    "r20": ("L105h20480", "n21", "A100", 80, 1120, 8, 35, 1, 0, 1, 2240, "full", 0, 0),
    "r21": ("L105h20480", "n21", "A100", 80, 2240, 8, 35, 1, 0, 1, 2240, "full", 0, 0),
    "r22": ("L48h6144", "k22", "A100", 80, 8, 8, 1, 1, 0, 4, 4, "selective", 1, 0),
    "r23": ("L48h6144", "k22", "A100", 80, 8, 8, 1, 1, 0, 4, 4, "full", 0, 0),
    "r24": ("L96h12288", "k22", "A100", 80, 64, 8, 8, 3, 0, 1, 64, "selective", 1, 0),
    "r25": ("L96h12288", "k22", "A100", 80, 64, 8, 8, 3, 0, 1, 64, "full", 0, 0),
    "r26": ("L105h20480", "k22", "A100", 80, 280, 8, 35, 3, 0, 1, 280, "selective", 1, 0),
    "r27": ("L105h20480", "k22", "A100", 80, 280, 8, 35, 3, 0, 1, 280, "full", 0, 0),
    "r28": ("L128h25600", "k22", "A100", 80, 512, 8, 64, 1, 0, 1, 512, "selective", 1, 0),
    "r29": ("L128h25600", "k22", "A100", 80, 512, 8, 64, 1, 0, 1, 512, "full", 0, 0),
    "r30": ("L105h20480", "k22", "A100", 80, 2240, 8, 35, 3, 0, 1, 2240, "selective", 1, 0),
    "r31": ("L105h20480", "k22", "A100", 80, 2240, 8, 35, 3, 0, 1, 2240, "full", 0, 0),
    "r32": ("L105h20480", "s22", "A100", 80, 2240, 8, 35, 1, 1, 1, 1920, "full", 0, 0),
    "r33": ("L105h20480", "s22", "A100", 80, 2800, 8, 35, 1, 1, 1, 1920, "full", 0, 0),
    "r34": ("L105h20480", "s22", "A100", 80, 3360, 8, 35, 1, 1, 1, 1920, "full", 0, 0),
    "r36": ("L70h14336v250", "b22", "A100", 80, 384, 4, 12, 1, 1, 2, 2048, "full", 0, 0),
    "r37": ("L44h6144", "x22", "A100", 40, 96, 2, 4, 1, 1, 4, 1536, "full", 0, 0),
    "r38": ("L126h16384s8192v128", "d24", "H100", 80, 8192, 8, 16, 8, 2, 1, 2048, "none", 1, 1),
    "r39": ("L126h16384s8192v128", "d24", "H100", 80, 16384, 8, 16, 8, 2, 1, 2048, "none", 1, 1),
    "r40": ("L126h16384s131072v128", "d24", "H100", 80, 16384, 8, 16, 8, 2, 1, 128, "none", 1, 1),
    "r41": ("L80h8192v50", "m23", "H100", 80, 64, 1, 1, 1, 3, 8, 2048, "full", 0, 1),
    "r42": ("L48h7168v50", "m23", "H100", 80, 32, 1, 1, 1, 3, 14, 1344, "full", 0, 1),
    "r43": ("L40h5120v50", "m23", "H100", 80, 64, 1, 1, 1, 3, 2, 128, "none", 0, 1),
    "r44": ("L32h4096v50", "m23", "H100", 80, 8, 1, 1, 1, 3, 6, 48, "none", 0, 1),
    "r45": ("L80h8192v50", "m23", "A100", 80, 64, 1, 1, 1, 3, 8, 2048, "full", 0, 1),
    "r46": ("L48h7168v50", "m23", "A100", 80, 8, 1, 1, 1, 3, 3, 504, "full", 0, 1),
    "r47": ("L32h4096v50", "m23", "A100", 80, 8, 1, 1, 1, 3, 6, 96, "none", 0, 1),
    "r48": ("L80h8192v50", "m23", "A100", 40, 128, 1, 1, 1, 3, 4, 512, "full", 0, 1),
    "r49": ("L40h5120v50", "m23", "A100", 40, 128, 1, 1, 1, 3, 16, 2048, "full", 0, 1),
    "r50": ("L32h4096s8192v128", "t24", "H100", 102, 8, 1, 1, 1, 3, 2, 16, "op", 0, 1),
    "r51": ("L32h4096s8192v128", "t24", "H100", 102, 128, 1, 1, 1, 3, 2, 256, "op", 0, 1),
    "r52": ("L32h4096s131072v128", "t24", "H100", 102, 8, 1, 1, 1, 3, 1, 2, "full", 0, 1),
    "r53": ("L80h8192s8192v128", "t24", "H100", 102, 256, 8, 1, 1, 3, 16, 512, "full", 1, 1),
    "r54": ("L48h2048e128", "mb25", "H100", 80, 16, 1, 2, 24, 1, 2, 512, "none", 0, 1),
    "r55": ("L80h8192s8192v128", "mb25", "H100", 80, 64, 4, 8, 5, 1, 1, 128, "none", 1, 1),
    "r56": ("L126h16384s8192v128", "mb25", "H100", 80, 1024, 8, 8, 8, 1, 1, 512, "none", 1, 1),
    "r57": ("L94h4096e128", "mb25", "H100", 80, 256, 2, 8, 4, 1, 1, 2048, "none", 1, 1),
    "r58": ("L48h2048e128", "mb26", "H100", 80, 16, 1, 1, 1, 1, 1, 1024, "none", 0, 1),
    "r59": ("L126h16384s8192v128", "mb26", "H100", 80, 1024, 8, 8, 8, 1, 1, 1536, "none", 1, 1),
}

# What the columns of RUNS cannot hold: context parallelism, FP8, and the GPUs' memory bandwidth
# where it is not the preset's. Llama 3's long-context stage ran cp 16 (Dubey et al., table 4);
# TorchTitan's table 5 ran FSDP 2 x CP 4 with torch.compile and Float8, its table 3 Float8 too;
# TorchTitan's H100s have 95 GiB of HBM2e at 2.4 TB/s ("Each H100 GPU is equipped with 96GB HBM2e
# with 2.4 TB/sec peak memory bandwidth", its docs/performance.md; 95 GiB = 102 GB, section 3.1).
MORE = {
    "r40": {"cp": 16},
    "r52": {"cp": 4, "fp8": True},
    "r53": {"fp8": True},
    "r54": {"ep": 8, "fp8": True},
    "r55": {"fp8": True},
    "r56": {"cp": 2, "fp8": True},
    "r57": {"ep": 32, "etp": 1, "fp8": True},
    "r58": {"ep": 16, "fp8": True},
    "r59": {"cp": 2, "fp8": True},
}
MEMORY_BW = {"t24": 2400e9}

# what the source reports: seconds per iteration, MFU, or Megatron-LM's TFLOP/s per GPU
REPORTED = {
    "r00": ("tflops", 137),
    "r01": ("tflops", 138),
    "r02": ("tflops", 142),
    "r03": ("tflops", 135),
    "r04": ("tflops", 138),
    "r05": ("tflops", 140),
    "r06": ("tflops", 148),
    "r07": ("tflops", 155),
    "r08": ("tflops", 163),
    "r09": ("tflops", 163),
    "r10": ("tflops", 144),
    "r11": ("tflops", 88),
    "r12": ("tflops", 44),
    "r13": ("tflops", 138),
    "r14": ("tflops", 98),
    "r15": ("tflops", 48),
    "r19": ("tflops", 171),
    "r20": ("tflops", 167),
    "r21": ("tflops", 159),
    "r22": ("seconds", 1.1),
    "r23": ("seconds", 1.42),
    "r24": ("seconds", 13.75),
    "r25": ("seconds", 18.13),
    "r26": ("seconds", 37.83),
    "r27": ("seconds", 49.05),
    "r28": ("seconds", 71.49),
    "r29": ("seconds", 94.42),
    "r30": ("seconds", 39.15),
    "r31": ("mfu", 0.421),
    "r32": ("seconds", 60.1),
    "r33": ("seconds", 50.2),
    "r34": ("seconds", 44.4),
    "r36": ("seconds", 104.7),
    "r37": ("tflops", 117),
    "r38": ("mfu", 0.43),
    "r39": ("mfu", 0.41),
    "r41": ("mfu", 0.4257),
    "r42": ("mfu", 0.4392),
    "r43": ("mfu", 0.3986),
    "r44": ("mfu", 0.4644),
    "r45": ("mfu", 0.5333),
    "r46": ("mfu", 0.553),
    "r47": ("mfu", 0.6423),
    "r48": ("mfu", 0.4891),
    "r49": ("mfu", 0.5193),
    "r40": ("mfu", 0.38),
    "r50": ("tokens", 6258),
    "r51": ("tokens", 5645),
    "r52": ("tokens", 1071),
    "r53": ("tokens", 897),
    "r54": ("tokens", 5275),
    "r55": ("tokens", 1602),
    "r56": ("tokens", 292),
    "r57": ("tokens", 1575),
    "r58": ("tokens", 8826),
    "r59": ("tokens", 326),
}

NAMES = {
    "r00": "Megatron-LM PTD-P weak scaling GPT-1.7B on 32 A100",
    "r01": "Megatron-LM PTD-P weak scaling GPT-3.6B on 64 A100",
    "r02": "Megatron-LM PTD-P weak scaling GPT-7.5B on 128 A100",
    "r03": "Megatron-LM PTD-P weak scaling GPT-18.4B on 256 A100",
    "r04": "Megatron-LM PTD-P weak scaling GPT-39.1B on 512 A100",
    "r05": "Megatron-LM PTD-P weak scaling GPT-76.1B on 1024 A100",
    "r06": "Megatron-LM PTD-P weak scaling GPT-145.6B on 1536 A100",
    "r07": "Megatron-LM PTD-P weak scaling GPT-310.1B on 1920 A100",
    "r08": "Megatron-LM PTD-P weak scaling GPT-529.6B on 2520 A100",
    "r09": "Megatron-LM PTD-P weak scaling GPT-1008.0B on 3072 A100",
    "r10": "ZeRO-3 GPT-174.6B on 384 A100 (Narayanan Table 2)",
    "r11": "ZeRO-3 GPT-174.6B on 768 A100 (Narayanan Table 2)",
    "r12": "ZeRO-3 GPT-174.6B on 1536 A100 (Narayanan Table 2)",
    "r13": "ZeRO-3 GPT-529.6B on 640 A100 (Narayanan Table 2)",
    "r14": "ZeRO-3 GPT-529.6B on 1120 A100 (Narayanan Table 2)",
    "r15": "ZeRO-3 GPT-529.6B on 2240 A100 (Narayanan Table 2)",
    "r19": "PTD GPT-529.6B on 560 A100 (Narayanan Table 2)",
    "r20": "PTD GPT-529.6B on 1120 A100 (Narayanan Table 2)",
    "r21": "PTD GPT-529.6B on 2240 A100 (Narayanan Table 2)",
    "r22": "Megatron seq-parallel + selective recompute 22B on 8 A100 (no DP)",
    "r23": "Megatron full-recompute baseline 22B on 8 A100 (no DP)",
    "r24": "Megatron seq-parallel + selective recompute 175B (GPT-3) on 64 A100 (no DP)",
    "r25": "Megatron full-recompute baseline 175B (GPT-3) on 64 A100 (no DP)",
    "r26": "Megatron seq-parallel + selective recompute 530B (MT-NLG) on 280 A100 (no DP)",
    "r27": "Megatron full-recompute baseline 530B (MT-NLG) on 280 A100 (no DP)",
    "r28": "Megatron seq-parallel + selective recompute 1T on 512 A100 (no DP)",
    "r29": "Megatron full-recompute baseline 1T on 512 A100 (no DP)",
    "r30": "Megatron seq-parallel + selective recompute 530B on 2240 A100 (DP=8)",
    "r31": "Megatron full-recompute 530B on 2240 A100 (DP=8)",
    "r32": "MT-NLG 530B throughput benchmark on 280 DGX A100 (2240 GPUs)",
    "r33": "MT-NLG 530B throughput benchmark on 350 DGX A100 (2800 GPUs)",
    "r34": "MT-NLG 530B throughput benchmark on 420 DGX A100 (3360 GPUs)",
    "r36": "BLOOM-176B on 384 A100-80GB (Jean Zay)",
    "r37": "GPT-NeoX-20B on 96 A100-40GB",
    "r38": "Llama 3 405B pre-training stage on 8,192 H100 (TP8 CP1 PP16 DP64, seq 8192)",
    "r39": "Llama 3 405B pre-training stage on 16,384 H100 (TP8 CP1 PP16 DP128, seq 8192)",
    "r41": "MPT-70b FSDP benchmark on 64 H100-80GB, seq 2048",
    "r42": "MPT-30b FSDP benchmark on 32 H100-80GB, seq 2048",
    "r43": "MPT-13b FSDP benchmark on 64 H100-80GB, seq 2048",
    "r44": "MPT-7b FSDP benchmark on 8 H100-80GB, seq 2048",
    "r45": "MPT-70b FSDP benchmark on 64 A100-80GB, seq 2048",
    "r46": "MPT-30b FSDP benchmark on 8 A100-80GB, seq 2048",
    "r47": "MPT-7b FSDP benchmark on 8 A100-80GB, seq 2048",
    "r48": "MPT-70b FSDP benchmark on 128 A100-40GB, seq 2048",
    "r49": "MPT-13b FSDP benchmark on 128 A100-40GB, seq 2048",
    "r40": "Llama 3 405B long-context stage on 16,384 H100 (TP8 CP16 PP16 DP8, seq 131072)",
    "r50": "TorchTitan FSDP Llama 3.1 8B on 8 H100, seq 8192",
    "r51": "TorchTitan FSDP Llama 3.1 8B on 128 H100, seq 8192",
    "r52": "TorchTitan FSDP2 CP4 Float8 Llama 3.1 8B on 8 H100, seq 131072",
    "r53": "TorchTitan FSDP32 TP8 Float8 Llama 3.1 70B on 256 H100, seq 8192",
    "r54": "Megatron-Bridge Qwen3-30B-A3B MoE PP2 VP24 EP8 FP8 on 16 H100, seq 4096",
    "r55": "Megatron-Bridge Llama 3 70B TP4 PP8 VP5 FP8 on 64 H100, seq 8192",
    "r56": "Megatron-Bridge Llama 3.1 405B TP8 PP8 CP2 VP8 FP8 on 1024 H100, seq 8192",
    "r57": "Megatron-Bridge Qwen3-235B-A22B MoE TP2 PP8 VP4 EP32 FP8 on 256 H100, seq 4096",
    "r58": "Megatron-Bridge 26.06 Qwen3-30B-A3B MoE EP16 FP8 on 16 H100, seq 4096",
    "r59": "Megatron-Bridge 26.06 Llama 3.1 405B TP8 PP8 CP2 VP8 FP8 on 1024 H100, seq 8192",
}

# What section 3.3.2 of Dubey et al. states of both Llama 3 rows' layout.
LLAMA3_SECTION_3_3_2 = (
    "Sec 3.3.2: 'Our use of FSDP for Llama 3 shards optimizer states and gradients, but for "
    "model shards we do not reshard after forward computation'; 'we use an interleaved "
    "schedule'; 'we could pre-train Llama 3 on sequences of 8K tokens without activation "
    "checkpointing'"
)

EVIDENCE = {
    "r00": (
        "Table 1; Sec 5 (hardware), Sec 5.1; examples/sc21/run_table_1.sh: Table 1 row: 1.7 | "
        "24 | 2304 | 24 | 1 | 1 | 32 | 512 | 137 | 44% | 4.4"
    ),
    "r01": (
        "Table 1; Sec 5 (hardware), Sec 5.1; examples/sc21/run_table_1.sh: Table 1 row: 3.6 | "
        "32 | 3072 | 30 | 2 | 1 | 64 | 512 | 138 | 44% | 8.8"
    ),
    "r02": (
        "Table 1; Sec 5 (hardware), Sec 5.1; examples/sc21/run_table_1.sh: Table 1 row: 7.5 | "
        "32 | 4096 | 36 | 4 | 1 | 128 | 512 | 142 | 46% | 18.2"
    ),
    "r03": (
        "Table 1; Sec 5 (hardware), Sec 5.1; examples/sc21/run_table_1.sh: Table 1 row: 18.4 | "
        "48 | 6144 | 40 | 8 | 1 | 256 | 1024 | 135 | 43% | 34.6"
    ),
    "r04": (
        "Table 1; Sec 5 (hardware), Sec 5.1; examples/sc21/run_table_1.sh: Table 1 row: 39.1 | "
        "64 | 8192 | 48 | 8 | 2 | 512 | 1536 | 138 | 44% | 70.8"
    ),
    "r05": (
        "Table 1; Sec 5 (hardware), Sec 5.1; examples/sc21/run_table_1.sh: Table 1 row: 76.1 | "
        "80 | 10240 | 60 | 8 | 4 | 1024 | 1792 | 140 | 45% | 143.8"
    ),
    "r06": (
        "Table 1; Sec 5 (hardware), Sec 5.1; examples/sc21/run_table_1.sh: Table 1 row: 145.6 | "
        "96 | 12288 | 80 | 8 | 8 | 1536 | 2304 | 148 | 47% | 227.1"
    ),
    "r07": (
        "Table 1; Sec 5 (hardware), Sec 5.1; examples/sc21/run_table_1.sh: Table 1 row: 310.1 | "
        "128 | 16384 | 96 | 8 | 16 | 1920 | 2160 | 155 | 50% | 297.4"
    ),
    "r08": (
        "Table 1; Sec 5 (hardware), Sec 5.1; examples/sc21/run_table_1.sh: Table 1 row: 529.6 | "
        "128 | 20480 | 105 | 8 | 35 | 2520 | 2520 | 163 | 52% | 410.2"
    ),
    "r09": (
        "Table 1; Sec 5 (hardware), Sec 5.1; examples/sc21/run_table_1.sh: Table 1 row: 1008.0 "
        "| 160 | 25600 | 128 | 8 | 64 | 3072 | 3072 | 163 | 52% | 502.0"
    ),
    "r10": (
        "Table 2; Sec 5.2: Table 2: ZeRO-3 | 174.6 | MP 1 | batch 1536 | 384 GPUs | MBS 4 | 144 "
        "TFLOP/s | 90 days"
    ),
    "r11": (
        "Table 2; Sec 5.2: Table 2: ZeRO-3 | 174.6 | MP 1 | batch 1536 | 768 GPUs | MBS 2 | 88 "
        "TFLOP/s | 74 days"
    ),
    "r12": (
        "Table 2; Sec 5.2: Table 2: ZeRO-3 | 174.6 | MP 1 | batch 1536 | 1536 GPUs | MBS 1 | 44 "
        "TFLOP/s | 74 days"
    ),
    "r13": (
        "Table 2; Sec 5.2: Table 2: ZeRO-3 | 529.6 | MP 1 | batch 2560 | 640 GPUs | MBS 4 | 138 "
        "TFLOP/s | 169 days"
    ),
    "r14": (
        "Table 2; Sec 5.2: Table 2: ZeRO-3 | 529.6 | MP 1 | batch 2240 | 1120 GPUs | MBS 2 | 98 "
        "TFLOP/s | 137 days"
    ),
    "r15": (
        "Table 2; Sec 5.2: Table 2: ZeRO-3 | 529.6 | MP 1 | batch 2240 | 2240 GPUs | MBS 1 | 48 "
        "TFLOP/s | 140 days"
    ),
    "r19": (
        "Table 2; Sec 5.2: Table 2: PTD | 529.6 | MP 280 | batch 2240 | 560 GPUs | MBS 1 | 171 "
        "TFLOP/s | 156 days"
    ),
    "r20": (
        "Table 2; Sec 5.2: Table 2: PTD | 529.6 | MP 280 | batch 2240 | 1120 GPUs | MBS 1 | 167 "
        "TFLOP/s | 80 days"
    ),
    "r21": (
        "Table 2; Sec 5.2: Table 2: PTD | 529.6 | MP 280 | batch 2240 | 2240 GPUs | MBS 1 | 159 "
        "TFLOP/s | 42 days"
    ),
    "r22": (
        "Table 3, Table 5, Sec 6, Appendix A: Table 3: 22B | 64 | 6144 | 48 | TP 8 | PP 1 | 8 "
        "GPUs | GBS 4 | MBS 4; Table 5: full recompute 1.42 s, present work 1.1 s, MFU 41.5%, "
        "HFU 43.7%"
    ),
    "r23": ("Table 3, Table 5: Table 5: 22B | Full Recompute 1.42 | Present Work 1.1 | ..."),
    "r24": (
        "Table 3, Table 5, Sec 6, Appendix A: Table 3: 175B (GPT-3) | 96 | 12288 | 96 | TP 8 | "
        "PP 8 | 64 GPUs | GBS 64 | MBS 1; Table 5: full recompute 18.13 s, present work 13.75 "
        "s, MFU 51.4%, HFU 52.8%"
    ),
    "r25": ("Table 3, Table 5: Table 5: 175B | Full Recompute 18.13 | Present Work 13.75 | ..."),
    "r26": (
        "Table 3, Table 5, Sec 6, Appendix A: Table 3: 530B (MT-NLG) | 128 | 20480 | 105 | TP 8 "
        "| PP 35 | 280 GPUs | GBS 280 | MBS 1; Table 5: full recompute 49.05 s, present work "
        "37.83 s, MFU 56.0%, HFU 57.0%"
    ),
    "r27": ("Table 3, Table 5: Table 5: 530B | Full Recompute 49.05 | Present Work 37.83 | ..."),
    "r28": (
        "Table 3, Table 5, Sec 6, Appendix A: Table 3: 1T | 160 | 25600 | 128 | TP 8 | PP 64 | "
        "512 GPUs | GBS 512 | MBS 1; Table 5: full recompute 94.42 s, present work 71.49 s, MFU "
        "56.3%, HFU 57.0%"
    ),
    "r29": ("Table 3, Table 5: Table 5: 1T | Full Recompute 94.42 | Present Work 71.49 | ..."),
    "r30": (
        "Sec 6.3 (text); abstract: 'time per iteration increases slightly from 37.83 seconds to "
        "39.15 seconds. This results in an MFU drop from 56.0% to 54.2%'"
    ),
    "r31": (
        "Abstract: '... 54.2%, which is 29% faster than the 42.1% we achieve using recomputation.'"
    ),
    "r32": (
        "Sec 2.4 (throughput), Sec 3.2 (architecture) - via secondary quotations: '280 ... DGX "
        "A100 servers ... 60.1 seconds ... 126 TFLOP/s per GPU' (as quoted by llm-analysis "
        "README)"
    ),
    "r33": (
        "Sec 2.4 (throughput), Sec 3.2 (architecture) - via secondary quotations: '350 ... DGX "
        "A100 servers ... 50.2 seconds ... 121 TFLOP/s per GPU' (as quoted by llm-analysis "
        "README)"
    ),
    "r34": (
        "Sec 2.4 (throughput), Sec 3.2 (architecture) - via secondary quotations: '420 ... DGX "
        "A100 servers ... 44.4 seconds ... 113 TFLOP/s per GPU' (as quoted by llm-analysis "
        "README)"
    ),
    "r36": (
        "train/tr11-176B-ml/README.md: Replica setup, Architecture, Throughput, Important "
        "checkpoints: 'iteration 85376/ 115311 | ... elapsed time per iteration (s): 104.70 | "
        "... global batch size: 2048 | ... TFLOPs: 149.77'"
    ),
    "r37": (
        "configs/20B.yml; paper Sec 2.3/3 (TFLOP/s via secondary notes): 20B.yml: pipe- "
        "parallel-size 4, model-parallel-size 2, micro batch 4, grad accum 32; notes: '117 "
        "teraflops per gpus'"
    ),
    "r38": (
        "Table 4, Table 3, Sec 3.3.1-3.3.2: Table 4: 8,192 | TP 8 | CP 1 | PP 16 | DP 64 | "
        "8,192 | 32 | 16M | 430 | 43%; " + LLAMA3_SECTION_3_3_2
    ),
    "r39": (
        "Table 4, Table 3, Sec 3.3.1-3.3.2: Table 4: 16,384 | TP 8 | CP 1 | PP 16 | DP 128 | "
        "8,192 | 16 | 16M | 400 | 41%; " + LLAMA3_SECTION_3_3_2
    ),
    "r41": (
        "benchmarking/README.md section 'H100 80GB BF16'; yamls/pretrain/mpt-70b.yaml: row: 70b "
        "| 2048 | 64 | MFU 42.57 | HFU 56.76 | MBS 8 | GA 4 | GBS 2048 | 1039 tok/s/GPU | ckpt "
        "True"
    ),
    "r42": (
        "benchmarking/README.md section 'H100 80GB BF16'; yamls/pretrain/mpt-30b.yaml: row: 30b "
        "| 2048 | 32 | MFU 43.92 | HFU 58.57 | MBS 14 | GA 3 | GBS 1344 | 2308 tok/s/GPU | ckpt "
        "True"
    ),
    "r43": (
        "benchmarking/README.md section 'H100 80GB BF16'; yamls/pretrain/mpt-13b.yaml: row: 13b "
        "| 2048 | 64 | MFU 39.86 | HFU 39.86 | MBS 2 | GA 1 | GBS 128 | 4800 tok/s/GPU | ckpt "
        "False"
    ),
    "r44": (
        "benchmarking/README.md section 'H100 80GB BF16'; yamls/pretrain/mpt-7b.yaml: row: 7b | "
        "2048 | 8 | MFU 46.44 | HFU 46.44 | MBS 6 | GA 1 | GBS 48 | 10643 tok/s/GPU | ckpt "
        "False"
    ),
    "r45": (
        "benchmarking/README.md section 'A100 80GB with 1600 Gbps node-node interconnect "
        "(RoCE)'; yamls/pretrain/mpt-70b.yaml: row: 70b | 2048 | 64 | MFU 53.33 | HFU 71.1 | "
        "MBS 8 | GA 4 | GBS 2048 | 410 tok/s/GPU | ckpt True"
    ),
    "r46": (
        "benchmarking/README.md section 'A100 80GB with 1600 Gbps node-node interconnect "
        "(RoCE)'; yamls/pretrain/mpt-30b.yaml: row: 30b | 2048 | 8 | MFU 55.3 | HFU 73.74 | MBS "
        "3 | GA 21 | GBS 504 | 916 tok/s/GPU | ckpt True"
    ),
    "r47": (
        "benchmarking/README.md section 'A100 80GB with 1600 Gbps node-node interconnect "
        "(RoCE)'; yamls/pretrain/mpt-7b.yaml: row: 7b | 2048 | 8 | MFU 64.23 | HFU 64.23 | MBS "
        "6 | GA 2 | GBS 96 | 4641 tok/s/GPU | ckpt False"
    ),
    "r48": (
        "benchmarking/README.md section 'A100 40GB with 1600 Gbps node-node interconnect "
        "(RoCE)'; yamls/pretrain/mpt-70b.yaml: row: 70b | 2048 | 128 | MFU 48.91 | HFU 65.21 | "
        "MBS 4 | GA 1 | GBS 512 | 376 tok/s/GPU | ckpt True"
    ),
    "r49": (
        "benchmarking/README.md section 'A100 40GB with 1600 Gbps node-node interconnect "
        "(RoCE)'; yamls/pretrain/mpt-13b.yaml: row: 13b | 2048 | 128 | MFU 51.93 | HFU 69.24 | "
        "MBS 16 | GA 1 | GBS 2048 | 1972 tok/s/GPU | ckpt True"
    ),
    "r40": (
        "Table 4, Sec 3.3.2: Table 4: 16,384 | TP 8 | CP 16 | PP 16 | DP 8 | 131,072 | 16 | 16M "
        "| 380 | 38%; " + LLAMA3_SECTION_3_3_2
    ),
    "r50": (
        "Table 1: '1D parallelism (FSDP) on Llama 3.1 8B model, 8 GPUs. Mixed precision training. "
        "Selective activation checkpointing. Local batch size 2, global batch size 16': FSDP | "
        "6,258 Tok/Sec | 81.9 GiB"
    ),
    "r51": (
        "Table 2: '1D parallelism (FSDP) on Llama 3.1 8B model, 128 GPUs ... Selective activation "
        "checkpointing. Local batch size 2, global batch size 256': FSDP | 5,645 Tok/Sec | 67.0 GiB"
    ),
    "r52": (
        "Table 5: 'FSDP + CP + torch.compile + Float8 on Llama 3.1 8B model, 8 GPUs ... Full "
        "activation checkpointing. Local batch size 1': FSDP 2, CP 4 | 131,072 | 1,071 Tok/Sec"
    ),
    "r53": (
        "Table 3: '2D parallelism (FSDP + TP) + torch.compile + Float8 on Llama 3.1 70B model, 256 "
        "GPUs ... Full activation checkpointing. FSDP degree 32, TP degree 8. Local batch size 16, "
        "global batch size 512': 2D | 897 Tok/Sec | 70.3 GiB"
    ),
    "r54": (
        "25.11 NeMo Container, Pre-Training Performance, System: DGX-H100: Qwen3_30B_a3B | 16 | "
        "FP8-CS | 512 | 2 | 4096 | 0 | 1 | 2 | 1 | 24 | 8 | 32 | 5275 | 121 (#-GPUs, Precision, "
        "GBS, MBS, Sequence Length, FSDP, TP, PP, CP, VP, EP, GA, Tokens / sec / GPU, Model "
        "TFLOP / sec / GPU); 'In MoE training benchmarks, we force-balance the token "
        "distribution among experts and all benchmarks are token-dropless.'"
    ),
    "r55": (
        "25.11 NeMo Container, Pre-Training Performance, System: DGX-H100: LLAMA3_70B | 64 | "
        "FP8-CS | 128 | 1 | 8192 | 0 | 4 | 8 | 1 | 5 | 1 | 64 | 1602 | 719 (#-GPUs, Precision, "
        "GBS, MBS, Sequence Length, FSDP, TP, PP, CP, VP, EP, GA, Tokens / sec / GPU, Model "
        "TFLOP / sec / GPU)"
    ),
    "r56": (
        "25.11 NeMo Container, Pre-Training Performance, System: DGX-H100: LLAMA3.1_405B | 1024 "
        "| FP8-CS | 512 | 1 | 8192 | 0 | 8 | 8 | 2 | 8 | 1 | 64 | 292 | 737 (#-GPUs, Precision, "
        "GBS, MBS, Sequence Length, FSDP, TP, PP, CP, VP, EP, GA, Tokens / sec / GPU, Model "
        "TFLOP / sec / GPU)"
    ),
    "r57": (
        "25.11 NeMo Container, Pre-Training Performance, System: DGX-H100: Qwen3_235B_a22B | 256 "
        "| FP8-CS | 2048 | 1 | 4096 | 0 | 2 | 8 | 1 | 4 | 32 | 128 | 1575 | 233 (#-GPUs, "
        "Precision, GBS, MBS, Sequence Length, FSDP, TP, PP, CP, VP, EP, GA, Tokens / sec / GPU, "
        "Model TFLOP / sec / GPU), as the repository's docs/performance-summary-archive.md "
        "holds it; 'In MoE training benchmarks, we force-balance the token distribution among "
        "experts and all benchmarks are token-dropless.'"
    ),
    "r58": (
        "26.06 NeMo Container, Pre-Training Performance, Model: Qwen3_30B_a3B: DGX-H100 | 16 | "
        "FP8 | 1024 | 1 | 4096 | 1 | 1 | 1 | n/a | 16 | 8826 | 203 (System, #-GPUs, Precision, "
        "GBS, MBS, Sequence Length, TP, PP, CP, VP, EP, Tokens / sec / GPU, Model TFLOP / sec / "
        "GPU); v0.5.0's QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1: num_gpus=16, "
        "global_batch_size=1024, expert_model_parallel_size=16, moe_a2a_overlap=False; 'In MoE "
        "training benchmarks, we force-balance the token distribution among experts and all "
        "benchmarks are token-dropless.'"
    ),
    "r59": (
        "26.06 NeMo Container, Pre-Training Performance, Model: LLAMA3.1_405B: DGX-H100 | 1024 | "
        "FP8 | 1536 | 1 | 8192 | 8 | 8 | 2 | 8 | n/a | 326 | 822 (System, #-GPUs, Precision, "
        "GBS, MBS, Sequence Length, TP, PP, CP, VP, EP, Tokens / sec / GPU, Model TFLOP / sec / "
        "GPU); v0.5.0's LLAMA31_405B_PRETRAIN_CONFIG_H100_FP8_CS_V2: V1 (tp 8, pp 8, cp 2, vp "
        "8) with global_batch_size=1536"
    ),
}


# What the paper leaves to us is the same for Llama 3's 8,192- and 16,384-GPU rows.
LLAMA3_ASSUMED = [
    (
        "FSDP as ZeRO-2, its gradients reduce-scattered in bf16 every microbatch (the paper "
        "says FP32; priced so on NCCL's rings, 8.4 s of it a step, 1.7 s stays exposed and the "
        "compute efficiency that matches the 8,192-GPU step of 12.64 s is 1.0)"
    ),
    "microbatch 1",
    "v = 8 (derived: ENDS)",
    "sp (the paper cites Korthikanti et al. for its tensor parallelism)",
    "flash attention",
]

# What TorchTitan's tables leave to us (its rows' H100s ran at a 500 W power limit, its
# docs/performance.md says: not priced, the planner's H100 draws what its datasheet allows)
TORCHTITAN_ASSUMED = [
    "selective activation checkpointing as its default 'op' policy (every second mm recomputed)",
    "flash attention (PyTorch's scaled dot product attention)",
    "FSDP as ZeRO-3 a transformer block a unit",
    "the 500 W power limit not priced",
]

# What Megatron-Bridge's 25.11 table leaves to us of its Llama rows, read from the v0.2.0 tag
# (SOURCES["mb25"]), and its 26.06 table of r59, from v0.5.0 (SOURCES["mb26"]); their
# performance recipes overlap tensor-parallel traffic with the matmuls (tp_comm_overlap with
# Transformer Engine's userbuffers: PROFILE's megatron-core-tp-overlap).
# What MosaicML's benchmark table leaves to us (its MP Mode column: DEFAULT for the amp_bf16
# rows, which reduces gradients in float32 in some Composer versions and in bf16 in others;
# PURE for the bf16 rows, bf16)
MPT_ASSUMED = [
    "ffn = 4 hidden",
    "the Triton FlashAttention at the rates measured on A100s; on H100s FlashAttention's (the "
    "first version's), which stand in for it",
    "gradients reduce-scattered in bf16",
]

MEGATRON_BRIDGE_LLAMA_ASSUMED = [
    "Megatron-Core's distributed optimizer as ZeRO-1 (use_distributed_optimizer=True)",
    "sequence parallelism (WorkloadBaseConfig.sequence_parallel: tp > 1)",
    "no activation recompute (the H100 FP8 presets set none)",
    "flash attention at FlashAttention-2's rates (Transformer Engine's fused attention)",
    "tensor-parallel traffic hidden behind the layer's matmuls, as far as they last (the "
    "recipes' tp_comm_overlap)",
]

ASSUMED = {
    "r00": ["ffn = 4 hidden"],
    "r01": ["ffn = 4 hidden"],
    "r02": ["ffn = 4 hidden"],
    "r03": ["ffn = 4 hidden"],
    "r04": ["ffn = 4 hidden"],
    "r05": ["ffn = 4 hidden"],
    "r06": ["ffn = 4 hidden"],
    "r07": ["ffn = 4 hidden"],
    "r08": ["ffn = 4 hidden"],
    "r09": ["ffn = 4 hidden"],
    "r10": ["ffn = 4 hidden", "full recompute as in table 1"],
    "r11": ["ffn = 4 hidden", "full recompute as in table 1"],
    "r12": ["ffn = 4 hidden", "full recompute as in table 1"],
    "r13": ["ffn = 4 hidden", "full recompute as in table 1"],
    "r14": ["ffn = 4 hidden", "full recompute as in table 1"],
    "r15": ["ffn = 4 hidden", "full recompute as in table 1"],
    "r19": ["ffn = 4 hidden", "full recompute as in table 1", "v = 1"],
    "r20": ["ffn = 4 hidden", "full recompute as in table 1", "v = 1"],
    "r21": ["ffn = 4 hidden", "full recompute as in table 1", "v = 1"],
    "r22": ["ffn = 4 hidden"],
    "r23": ["ffn = 4 hidden"],
    "r24": ["ffn = 4 hidden"],
    "r25": ["ffn = 4 hidden"],
    "r26": ["ffn = 4 hidden"],
    "r27": ["ffn = 4 hidden"],
    "r28": ["ffn = 4 hidden", "v = 1"],
    "r29": ["ffn = 4 hidden", "v = 1"],
    "r30": ["ffn = 4 hidden"],
    "r31": ["ffn = 4 hidden"],
    "r32": ["ffn = 4 hidden", "vocab 51,200", "full recompute", "microbatch 1", "v = 1"],
    "r33": ["ffn = 4 hidden", "vocab 51,200", "full recompute", "microbatch 1", "v = 1"],
    "r34": ["ffn = 4 hidden", "vocab 51,200", "full recompute", "microbatch 1", "v = 1"],
    "r36": ["ffn = 4 hidden", "v = 1"],
    "r37": ["ffn = 4 hidden", "vocab 51,200", "v = 1"],
    "r38": LLAMA3_ASSUMED,
    "r39": LLAMA3_ASSUMED,
    "r41": MPT_ASSUMED,
    "r42": MPT_ASSUMED,
    "r43": MPT_ASSUMED,
    "r44": MPT_ASSUMED,
    "r45": MPT_ASSUMED,
    "r46": MPT_ASSUMED,
    "r47": MPT_ASSUMED,
    "r48": MPT_ASSUMED,
    "r49": MPT_ASSUMED,
    "r40": [
        *LLAMA3_ASSUMED,
        "context parallelism as a ring (the paper all-gathers keys and values)",
    ],
    "r50": TORCHTITAN_ASSUMED,
    "r51": TORCHTITAN_ASSUMED,
    "r52": [*TORCHTITAN_ASSUMED[1:], "global batch 2 (FSDP 2 x local 1)"],
    "r53": [*TORCHTITAN_ASSUMED[1:], "microbatch 16 (no pipeline: no accumulation)"],
    "r54": [
        "Megatron-Core's distributed optimizer as ZeRO-1",
        "no activation recompute",
        "flash attention at FlashAttention-2's rates (Transformer Engine's fused attention)",
        "capacity 1 (the table's routing is force-balanced and dropless)",
        "the expert-parallel group placed in Megatron-Core's rank order, pp outermost "
        "(profiles.STAGES_OUTERMOST): its ep 8 on one node's NVLink",
    ],
    "r55": MEGATRON_BRIDGE_LLAMA_ASSUMED,
    "r56": MEGATRON_BRIDGE_LLAMA_ASSUMED,
    "r57": [
        "Megatron-Core's distributed optimizer as ZeRO-1",
        "sequence parallelism (WorkloadBaseConfig.sequence_parallel: tp > 1)",
        "no activation recompute",
        "flash attention at FlashAttention-2's rates (Transformer Engine's fused attention)",
        "capacity 1 (the table's routing is force-balanced and dropless)",
        "whole experts, etp = 1 (its v0.2.0 preset: expert_tensor_parallel_size=1), ep over tp's "
        "ranks first, then dp's",
        "the all-to-alls exposed (the preset's moe_a2a_overlap not priced)",
    ],
    "r58": [
        "Megatron-Core's distributed optimizer as ZeRO-1",
        "no activation recompute (qwen3_llm_pretrain.py's set_qwen3_common_configs)",
        "flash attention at FlashAttention-2's rates (Transformer Engine's fused attention)",
        "capacity 1 (the table's routing is force-balanced and dropless)",
        "the all-to-alls exposed, as its preset runs them (moe_a2a_overlap=False)",
    ],
    "r59": MEGATRON_BRIDGE_LLAMA_ASSUMED,
}
