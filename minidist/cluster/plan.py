"""Planning a large run: which layouts fit, how long a step takes, and why, from formulas.

Equals: nothing runs here; every number is a formula of the model's shape, the layout and the
cluster (cluster/hardware.py), each stated below with its source; tests/test_plan*.py check them
against minidist's own code (bytes, memory) and tests/test_published_runs.py against published runs.
Memory per GPU (bytes; Psi_g = this GPU's parameters; mixed precision with Adam):
    model state   4 + 12/dp (ZeRO-1), 2 + 14/dp (ZeRO-2), 16/dp (ZeRO-3) bytes per parameter
                  (Rajbhandari et al., SC 2020, section 3.1); without ZeRO 20, the paper's 16
                  and the float32 copy of the gradients Megatron-LM's optimizer steps on (its
                  docs: 20 for fp16 parameters and gradients); Psi_g of the first stage: its
                  layers and the embedding (and the output layer if pp = 1, unless tied);
                  float32 (e = 4): 16, 8 + 12/dp, 4 + 16/dp, 20/dp (ZeRO keeps a float32
                  master, as minidist's does); ZeRO-3 also one layer's gathered parameters
    activations   per layer and microbatch of b sequences of s tokens (Korthikanti et al.,
                  2022, table 2): s b h (10 + 24/t + 5 a s/(h t)); with sequence parallelism
                  s b h (34 + 5 a s/h)/t; selective recompute drops the 5 a s/h term; full
                  recompute keeps 2 s b h (/t with sp) per layer. The first stage of 1F1B holds
                  min(pp, m) microbatches of L/pp layers, x (1 + (pp-1)/(pp v)) interleaved
                  (Narayanan et al., SC 2021, section 2.2.2); with ends (Llama 3's pipeline:
                  the embedding and the head fill a layer's slot each, Dubey et al., 2024,
                  section 3.3.2) the second stage, a layer fuller, may hold the most.
Time per step (the slowest stage):
    compute       FLOPs / (peak x efficiency x the framework's share of it, 1 but where fitted:
                  profiles.Profile.compute x matmul_share: what tile and wave quantization leave of
                  the rate); the executed FLOPs of cluster/shapes.py (a token's forward 2 Psi_matmul
                  + 4 s h L + 2 V h, training 3x that, + what recompute runs again), split over tp,
                  the layers over pp, the logits on the last stage (Dubey et al., 2024, section
                  3.3.2); with flash, a fused attention kernel's measured time instead of its FLOPs'
                  (cluster/attention.py: the framework's kernel, the causal half at its rate by
                  sequence length); + the elementwise ops' bytes / memory bandwidth: 5 passes over
                  the activations each layer keeps (7 with full recompute; selective adds its
                  attention core's s x s bytes)
    pipeline      m microbatch slots of the slowest stage, and a bubble of (pp-1)/v slots of
                  the fullest stage without the head (they fill and drain the pipe)
    collectives   each on its own group, ranks placed in the framework's rank order
                  (profiles.py: minidist's mesh and Llama 3 put tp innermost, then cp, pp, dp;
                  Megatron and DeepSpeed tp, cp, dp, pp), priced as NCCL runs them (network.py:
                  a ring on each network card the group's GPUs reach, or a tree, by size);
                  tp <= g stays on the node's links, a larger tp crosses the network
    tensor par.   4 all-reduces of s b h bf16 values per layer and microbatch (6 with full
                  recompute), + 1 for the vocabulary-parallel embedding (forward) on the first
                  stage and 1 for the output layer (backward) on the last (both if pp = 1);
                  the layers' behind their matmuls where the framework overlaps them
                  (profiles.exposed_tp_seconds)
    pipeline p2p  2 m v messages of s b h / t bf16 values each way between stages (across
                  nodes on the sending GPU's own card if they span nodes), all-gathered over
                  tp on arrival (Narayanan et al., section 4.1); s b h, not gathered, as
                  minidist's pipeline sends them
    context par.  cp ranks hold s/cp tokens each; a ring passes keys and values (cp - 1 steps
                  of 2 (s/cp) b h_kv/t values, forward, twice backward) behind each attention
                  block (cp_seconds: what the attention's FLOPs cannot cover)
    expert par.   a mixture's experts shared out over ep ranks (carved out of dp; with etp < tp
                  out of tp's spare ranks first, then dp's); 4 all-to-alls a layer (6 with full
                  recompute) of a rank's tokens x top_k x capacity hidden vectors (ep_seconds)
    FP8           the layers' linear matmuls at the GPU's FP8 peak (linear_share), the rest bf16
    data par.     over dp (x cp), of 2 Psi_g bytes: an all-reduce; ZeRO-1 a reduce-scatter and an
                  all-gather; ZeRO-2 a reduce-scatter per microbatch; ZeRO-3 also two
                  all-gathers per microbatch, at ZeRO-3's own efficiency (Efficiency.sharded);
                  less what the framework hides behind compute (cluster/profiles.py)
    optimizer     profiles.OPTIMIZER_BYTES per parameter of the rank (ZeRO: of its shard), read
                  and written at the memory's bandwidth
Ladder: Shape, Layout -> memory_bytes (fits or not, and why) -> step (the time breakdown;
sent_nbytes: the bytes it prices) -> plan_search.search (every layout of a GPU count, the
feasible ones ranked) -> plan_cli (`minidist plan`); cluster/calibrate.py: this machine, measured.
Paper: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC 2021); Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022).   Lesson: lessons/13_beyond_one_machine/.
Run: minidist plan --model gpt3-175b --cluster dgx-a100 --gpus 1024 --batch 1536
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from minidist.cluster import attention, network, profiles

# plan.X for callers, the planner's one face: the model's shape (shapes.py), and what the
# published runs taught it (evidence.py: the fitted efficiencies, its errors and their band)
from minidist.cluster.evidence import (  # noqa: F401
    CALIBRATED,
    VALIDATION_ERRORS,
    Efficiency,
    calibrated,
    error_band,
    error_deciles,
    generation,
)
from minidist.cluster.hardware import Cluster, wave_share
from minidist.cluster.profiles import MINIDIST_ORDER, Profile
from minidist.cluster.shapes import SHAPES, Shape  # noqa: F401


@dataclass(frozen=True)
class Layout:
    """How a run is cut: dp x pp x tp x cp GPUs, v chunks per stage (interleaved), ZeRO stage,
    microbatch size b, recompute (none | selective | full), sequence parallelism, scatter (a
    tp rank sends 1/tp of an activation on, the next stage all-gathers; minidist sends all),
    ends (the embedding and the head take a layer's slot each: the first chunk holds only the
    embedding, the last only the head, as Llama 3 takes a layer off the first and last stage),
    cp (context parallelism: a ring of cp ranks holds a sequence's chunks), ep (expert
    parallelism, carved out of dp: ep ranks share out a mixture's experts), fp8 (the layers'
    linear matmuls in FP8, where the GPU has it), etp (expert tensor parallelism,
    Megatron-Core's expert_tensor_parallel_size: how many of the tp ranks cut each expert; 0,
    all of them, as the dense layers; fewer leave tp / etp ranks to ep, which then spans them
    and dp, as large mixtures run with etp = 1)."""

    dp: int
    pp: int
    tp: int
    v: int = 1
    zero: int = 0
    b: int = 1
    recompute: str = "none"
    sp: bool = False
    scatter: bool = True  # a stage sends 1/tp of an activation (Narayanan et al., section 4.1)
    ends: bool = False  # the embedding and the head take a layer's slot each (Dubey et al., 3.3.2)
    cp: int = 1
    ep: int = 1
    fp8: bool = False
    etp: int = 0  # 0: the experts are cut over all tp ranks, as the dense layers

    def expert_tp(self) -> int:
        """The tp ranks that cut each expert (etp, or all tp of them)."""
        return self.etp or self.tp

    def ep_axes(self) -> tuple[int, int]:
        """(ranks of ep taken from tp's spare ranks, from dp): the spare ones first, as
        Megatron-Core orders its expert groups (etp innermost, then ep)."""
        inner = min(self.ep, self.tp // self.expert_tp())
        return inner, self.ep // inner

    def microbatches(self, batch: int) -> int:
        return batch // (self.dp * self.b)


def problems(shape: Shape, layout: Layout, gpus: int, batch: int) -> list[str]:
    """Why this layout cannot run this shape at all (divisibility), with the numbers."""
    found, x = [], layout
    if x.dp * x.pp * x.tp * x.cp != gpus:
        cp = f" x cp={x.cp}" if x.cp > 1 else ""
        found.append(f"dp={x.dp} x pp={x.pp} x tp={x.tp}{cp} != {gpus} GPUs")
    if shape.layers + 2 * x.ends < x.pp * x.v:
        ends = " + 2 ends" if x.ends else ""
        found.append(f"layers={shape.layers}{ends} are fewer than pp={x.pp} x v={x.v} stages")
    if x.ends and x.pp == 1:
        found.append("the embedding and the head as stages (ends) need pp > 1")
    if shape.heads % x.tp or (shape.kv_heads or shape.heads) % x.tp:
        kv = shape.kv_heads or shape.heads
        found.append(f"heads={shape.heads} (kv heads {kv}) are not divisible by tp={x.tp}")
    if batch % (x.dp * x.b):
        found.append(f"batch={batch} is not divisible by dp={x.dp} x b={x.b}")
    elif x.v > 1 and x.microbatches(batch) % x.pp:
        m = x.microbatches(batch)
        found.append(f"interleaving needs microbatches={m} divisible by pp={x.pp}")
    if x.sp and x.tp == 1:
        found.append("sequence parallelism needs tp > 1")
    if shape.seq % (2 * x.cp) and x.cp > 1:  # two chunks a rank, one early one late (balanced)
        found.append(f"seq={shape.seq} is not divisible by 2 x cp={x.cp} chunks")
    if x.etp and not shape.experts:
        found.append(f"etp={x.etp} needs a mixture of experts; {shape.name} has none")
    elif x.etp and x.tp % x.etp:
        found.append(f"etp={x.etp} must divide tp={x.tp}")
    elif x.ep > 1 and not shape.experts:
        found.append(f"ep={x.ep} needs a mixture of experts; {shape.name} has none")
    elif x.ep > 1 and not _ep_fits(shape, x):
        spare = x.tp // x.expert_tp()
        room = f"dp={x.dp}" if spare == 1 else f"tp/etp={spare} x dp={x.dp}, tp's ranks first"
        found.append(f"ep={x.ep} must divide experts={shape.experts} and {room}")
    return found


def _ep_fits(shape: Shape, x: Layout) -> bool:
    """Whether ep divides the experts and takes whole axes: tp's spare ranks (tp / etp), then
    dp's."""
    spare = x.tp // x.expert_tp()
    inner, outer = x.ep_axes()
    whole = spare % inner == 0 and inner * outer == x.ep and x.dp % outer == 0
    return shape.experts % x.ep == 0 and whole


def stage_layers(shape: Shape, layout: Layout) -> int:
    """Layers on the fullest stage: v chunks of ceil(L / (pp v)) (uneven when pp v does not
    divide L, as minidist's pipeline/partition.py and Megatron-DeepSpeed allow); with ends, L + 2
    slots, the first chunk the embedding's, the last the head's (Llama 3's balanced pipeline), so
    that a middle stage is the fullest (or, with pp = 2, both stages have a slot less)."""
    x = layout
    full = -(-(shape.layers + 2 * x.ends) // (x.pp * x.v)) * x.v
    return full - 1 if x.ends and x.pp == 2 else full


def memory_bytes(shape: Shape, layout: Layout, batch: int, flash: bool = True, e: int = 2) -> dict:
    """Bytes per GPU on the fullest stage: model state and activations (the docstring), and
    with ZeRO-3 one layer's gathered parameters (freed layer by layer, as DeepSpeed does).
    flash: attention that never stores the s x s scores (FlashAttention; Dao et al., 2022)
    keeps no 5 a s/h term, as selective recompute. e: bytes of a value (2: mixed precision;
    4: float32, each of Korthikanti et al.'s 2-byte values twice as large, and the model state
    float32 parameters and gradients, Adam's two moments, with ZeRO also a float32 master as
    minidist's zero/stages.py keeps one). Without dropout (shape.dropout) the per-layer constant is
    8, not 10 (no two s b h masks), and the attention term 2 a s/h, not 5 (the softmax output is
    the one s x s tensor kept). ZeRO shards the dense parameters over dp x cp (every cp rank
    holds them whole) and a mixture's experts over the ranks that hold the same ones, dp x cp
    x (tp / etp) / ep (ep ranks share them out; with etp < tp, tp's spare ranks are ep's too)."""
    x, h = layout, shape.hidden
    layers = stage_layers(shape, x)
    if x.recompute == "full":  # each layer's input, 2 s b h bytes (/t with sp), s/cp a rank
        per_layer = shape.seq / x.cp * x.b * h * e / (x.tp if x.sp else 1)
    else:
        per_layer = layer_activation_bytes(shape, x, flash, e)
    m = x.microbatches(batch)
    # (layers, embeddings, rank r): the first stage holds the embedding (and the output layer
    # if pp = 1, unless tied); with ends it has a layer less, and the second (full, 2/v
    # microbatches behind) may hold more; in flight: 1F1B's pp - r microbatches, or
    # Megatron-LM's interleaved warm-up + 1 chunks, 2 (pp - r - 1) + (v - 1) pp + 1, of 1/v
    # stage each
    stages = [(layers, shape.embedding_matrices() if x.pp == 1 else 1, 0)]
    if x.ends and x.pp > 2:
        stages = [(layers - 1, 1, 0), (layers, 0, 1)]
    dense_layer, expert_layer = layer_params_held(shape, x)
    dense_bytes = per_param_bytes(x.zero, x.dp * x.cp, e)
    # the experts' optimizer state is sharded over the ranks that hold the same experts
    expert_bytes = per_param_bytes(x.zero, x.dp * x.cp * x.tp // x.expert_tp() // x.ep, e)
    memories = []
    for n, ends, r in stages:
        dense = n * dense_layer + ends * shape.vocab * h / x.tp
        chunks = 2 * (x.pp - r - 1) + (x.v - 1) * x.pp + 1
        in_flight = min(x.pp - r, m) if x.v == 1 else chunks / x.v
        activations = per_layer * n * in_flight
        state = dense * dense_bytes + n * expert_layer * expert_bytes
        memories.append({"model state": state, "activations": activations})
    memory = max(memories, key=lambda d: sum(d.values()))
    if x.zero == 3:
        memory["gathered"] = e * max(dense_layer + expert_layer, shape.vocab * h / x.tp)
    return memory


def per_param_bytes(zero: int, shards: int, e: int = 2) -> float:
    """Bytes of model state a parameter costs a rank, its optimizer state sharded over `shards`
    ranks by ZeRO (the docstring's table; e = 4: float32)."""
    mixed = {0: 20, 1: 4 + 12 / shards, 2: 2 + 14 / shards, 3: 16 / shards}
    fp32 = {0: 16, 1: 8 + 12 / shards, 2: 4 + 16 / shards, 3: 20 / shards}
    return (mixed if e == 2 else fp32)[zero]


def layer_params_held(shape: Shape, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameters of one layer a rank holds: the attention (and a dense MLP, and
    the router) cut over tp; a mixture's experts / ep of them, each cut over etp."""
    x = layout
    if not shape.experts:
        return shape.layer_params() / x.tp, 0.0
    dense = shape.attention_params() / x.tp + shape.hidden * shape.experts
    return dense, shape.experts // x.ep * shape.mlp_params() / x.expert_tp()


def layer_activation_bytes(shape: Shape, layout: Layout, flash: bool = True, e: int = 2) -> float:
    """Bytes one layer keeps for backward per microbatch without full recompute (Korthikanti et
    al., table 2, the docstring's formulas; see memory_bytes for flash, e and dropout). Their 24
    s b h / t counted term by term, for any shape: q (2 q/h: q the queries' width, h unless
    head_dim says otherwise), k and v (4 h_kv/h), the attention's output (2 q/h), the MLP's two
    inner activations (4 f/h; gated, three: 6 f/h); a mixture keeps its experts' for every
    token top_k x capacity times; cp ranks hold s/cp tokens each, and ring attention keeps no
    s x s scores."""
    x = layout
    h = shape.hidden
    s = shape.seq
    a = shape.heads
    t, sbh = x.tp, s / x.cp * x.b * h * e / 2  # Korthikanti et al. count 2-byte values
    drop = 2 if shape.dropout else 0
    scores = 5 if shape.dropout else 2
    ring = x.cp > 1
    kept = x.recompute in ("selective", "op") or flash or ring
    attention = 0 if kept else scores * a * s / (h * t)
    routed = shape.top_k * shape.capacity if shape.experts else 1
    mlp = (6 if shape.glu else 4) * shape.ffn / h * routed
    q = 2 * shape.q_width() / h  # q, and the attention's output as wide
    split = q + 4 * shape.kv_width() / h + q + mlp  # cut over tp: 24 for GPT-3's shape
    return sbh * (((8 + drop + split) / t if x.sp else 8 + drop + split / t) + attention)


def stage_flops_per_token(shape: Shape, layout: Layout) -> tuple[float, float]:
    """Training FLOPs per token (all tp ranks) of the slowest stage, which sets the pace, and
    of the fullest without the head, like those that fill and drain the pipe: the layers'
    share of step_flops_per_token; the last stage, with what the ceil partition leaves it,
    also runs the head's 3 x 2 V h (not recomputed), which makes it the latency bottleneck
    (Dubey et al., 2024, section 3.3.2; Megatron-LM puts the head there too)."""
    head = 3 * 2 * shape.vocab * shape.hidden
    per_layer = (shape.step_flops_per_token(layout.recompute) - head) / shape.layers
    slowest, heads, fullest = stage_layer_counts(shape, layout)
    return slowest * per_layer + heads * head, fullest * per_layer


def stage_layer_counts(shape: Shape, layout: Layout) -> tuple[int, int, int]:
    """(layers of the slowest stage, 1 if it runs the head else 0, layers of the fullest
    without the head): the fullest stage, or the last if its layers and the head outweigh it."""
    x, fullest = layout, stage_layers(shape, layout)
    if x.pp == 1:
        return fullest, 1, fullest
    head = 3 * 2 * shape.vocab * shape.hidden
    per_layer = (shape.step_flops_per_token(layout.recompute) - head) / shape.layers
    slots, chunk = shape.layers + 2 * x.ends, -(-(shape.layers + 2 * x.ends) // (x.pp * x.v))
    last = (x.v - 1) * chunk + max(0, slots - (x.pp * x.v - 1) * chunk) - x.ends
    if last * per_layer + head > fullest * per_layer:
        return last, 1, fullest
    return fullest, 0, fullest


def matmul_share(shape: Shape, layout: Layout, gpu) -> float:
    """matmul_share_of: the same, for the numbers of the layout it depends on (cached)."""
    x = layout
    return matmul_share_of(shape, x.tp, x.b, x.cp, gpu, x.expert_tp(), x.ep)


@functools.lru_cache(maxsize=4096)
def matmul_share_of(shape: Shape, t: int, b: int, cp: int, gpu, et: int = 0, ep: int = 1) -> float:
    """The share of the matmul rate a layer's products keep on one tp rank after tile and wave
    quantization (cluster.wave_share): b s / cp rows by q k v (h -> (q + 2 h_kv)/t), out
    (q/t -> h), and for the MLP's up (h -> f/t, twice if gated) and down (f/t -> h) as many rows,
    or, for a mixture, each expert's: the tokens routed to it from the ep ranks that share out
    the experts (the all-to-all brings a rank's experts theirs), top_k x capacity / experts of
    each rank's rows, ep ranks' worth, cut over et (etp: default t), each rank's rows et/t as
    many (a tp rank dispatches its 1/(t/et) of the tokens). step() applies it to all of a
    stage's FLOPs (the logits and attention scores are large products too: a
    simplification)."""
    h = shape.hidden
    f = shape.ffn
    kv = shape.kv_width()
    q = shape.q_width()
    up = f * (2 if shape.glu else 1)
    rows = shape.seq * b // cp
    et = et or t
    attention = [(h, (q + 2 * kv) // t), (q // t, h)]
    mlp = [(h, up // et), (f // et, h)]
    expert_rows = rows
    if shape.experts:  # each expert's share of the routed tokens
        routed = rows * shape.top_k * shape.capacity / shape.experts * ep
        expert_rows = max(1, round(routed * et / t))
    work = [sum(k * n for k, n in attention), sum(k * n for k, n in mlp)]
    if shape.experts:
        work[1] *= shape.top_k * shape.capacity  # every token's top_k experts
    shares = [wave_share(gpu, rows, attention), wave_share(gpu, expert_rows, mlp)]
    return sum(work) / sum(w / share for w, share in zip(work, shares, strict=True))


def linear_share(shape: Shape, recompute: str) -> float:
    """The share of a layer's executed FLOPs in its linear layers (2 x the active parameters a
    forward): what FP8 runs (Transformer Engine's FP8 is its Linear layers'; attention's scores
    and values and the logits stay in bf16: NVIDIA Transformer Engine documentation, "Using FP8
    with Transformer Engine")."""
    per_layer = shape.step_flops_per_token(recompute) - 3 * 2 * shape.vocab * shape.hidden
    linear = 2 * shape.active_layer_params(capacity=True) * shape.layers
    again = {"none": 0, "selective": 0, "full": linear, "op": linear / 2}[recompute]
    return (3 * linear + again) / per_layer


def elementwise_nbytes(shape: Shape, layout: Layout, flash: bool = True, e: int = 2) -> float:
    """Bytes the fullest stage's non-matmul work (norms, GELU, softmax, dropout, residual adds)
    moves through memory per microbatch: each value a layer keeps for backward (without
    recompute) is the input of an elementwise op y = f(x), which reads x and writes y in
    forward, and reads x, reads dy and writes dx in backward: 5 passes, 7 with full recompute
    (its forward runs again). Selective recompute runs the attention core's forward again:
    where attention keeps its s x s scores (not flash), recompute_core_nbytes more. A count,
    not a fit."""
    kept = layer_activation_bytes(shape, replace(layout, recompute="none"), flash, e)
    passes = 7 if layout.recompute in ("full", "op") else 5  # op: the elementwise ops again
    again = recompute_core_nbytes(shape, layout, e) if layout.recompute == "selective" else 0
    keeps_scores = not flash and layout.cp == 1  # ring attention keeps none, as flash
    return (passes * kept + (again if keeps_scores else 0)) * stage_layers(shape, layout)


def recompute_core_nbytes(shape: Shape, layout: Layout, e: int = 2) -> float:
    """Bytes one layer's attention core moves through memory in its forward, per microbatch on
    one tp rank, over its a s^2 b / t scores (Megatron-LM's core attention: QK^T writes the
    scores, the fused softmax reads them and writes its output, the dropout reads that and
    writes its mask, 1 byte, and its output): 11 bytes a score in 2-byte values, 6 without
    dropout (the scores written, read and the softmax written)."""
    x = layout
    scores = shape.heads * shape.seq**2 / x.cp * x.b / x.tp
    per_score = (3 * e + (e + 1 + e if shape.dropout else 0)) if e else 0
    return scores * per_score


def forward_share(shape: Shape, recompute: str) -> float:
    """The forward's share of a microbatch's training FLOPs on a stage: 1/3 without recompute,
    about 1/4 with full (the backward runs the forward again), a little less than 1/3 with
    selective (the attention core's forward again, in the backward)."""
    return shape.forward_flops_per_token(capacity=True) / shape.step_flops_per_token(recompute)


def step(
    shape: Shape,
    layout: Layout,
    cluster: Cluster,
    batch: int,
    eff: Efficiency,
    e: int = 2,
    flash: bool = True,
    psi: float = 0,
    profile: Profile | None = None,
) -> dict:
    """Seconds per step of the slowest stage, by part: compute, bubble, tp, cp, ep, pp, dp,
    optimizer. e: bytes of an activation or gradient element on the wire (2: bf16; 4: float32).
    compute is a roofline's two sides: the FLOPs at peak (the layers' linear matmuls at the FP8
    peak with fp8) x efficiency x matmul_share, the rest of the work (elementwise_nbytes) at the
    memory's bandwidth. psi: a rank's parameters, which dp syncs (default the dense ones / (pp
    tp) and its experts / ep cut over etp, on its stage: no biases, norms or positions, < 0.1%
    of a large model). profile: the framework (cluster/profiles.py), which decides what dp and
    tp traffic hides behind compute, by its rank order which groups share a node, and by its
    compute share the matmuls' rate (DeepSpeed's below the calibrated one); default
    profiles.DEFAULT."""
    x = layout
    h = shape.hidden
    m = x.microbatches(batch)
    tokens = shape.seq * x.b / x.cp  # a microbatch's tokens on one cp rank
    profile = profile or profiles.PROFILES[profiles.DEFAULT]
    layers = stage_layers(shape, x)
    share = eff.compute * profile.compute * matmul_share(shape, x, cluster.gpu)
    bf16 = cluster.gpu.peak_flops * share
    # the layers' linear matmuls at the FP8 rate with fp8 (bf16's on a GPU without one)
    linear_rate = (cluster.gpu.fp8_flops * share or bf16) if x.fp8 else bf16
    linear = linear_share(shape, x.recompute) if x.fp8 else 0.0
    per_flop = linear / linear_rate + (1 - linear) / bf16
    elementwise = elementwise_nbytes(shape, x, flash, e) / cluster.gpu.memory_bw
    # a fused attention kernel's measured time replaces its FLOPs at the matmul rate, layer by
    # layer (cluster/attention.py); 0 where none is measured or attention is not fused
    fused = attention_seconds_per_token(
        shape, x, cluster, flash and e == 2, bf16, profile.attention
    )
    slowest_layers, _, fullest_layers = stage_layer_counts(shape, x)
    slowest_flops, fullest_flops = stage_flops_per_token(shape, x)
    rank_tokens = tokens / x.tp
    slowest = (slowest_flops * per_flop + slowest_layers * fused) * rank_tokens + elementwise
    fullest = (fullest_flops * per_flop + fullest_layers * fused) * rank_tokens + elementwise
    g = cluster.gpus_per_node
    act = e * tokens * h  # bytes of one activation tensor on a rank
    # the framework's rank order (profile.order: minidist's mesh, tp innermost, then cp, pp,
    # dp; Megatron's and DeepSpeed's, tp, cp, dp, pp; ep carved out of dp in both): each
    # dimension's collectives run on the group this order gives it, on its links
    apart = strides(x, profile.order)
    tp_group = network.spread(1, x.tp, g)
    tp_ar, _ = network.collective_seconds(cluster, "all_reduce", tp_group, act, eff.network)
    ends = 2 if x.pp == 1 else 1  # the embedding's all-reduce (forward), the head's (backward)
    # the layer's linear matmuls on this rank, one microbatch: 2 x its active parameters a
    # token's forward, 3 passes (4 with full recompute), at linear_rate
    passes = 4 if x.recompute == "full" else 3
    gemm = passes * 2 * shape.active_layer_params(capacity=True) * rank_tokens / linear_rate
    per_layer = (6 if x.recompute == "full" else 4) * tp_ar
    t_tp = layers * profiles.exposed_tp_seconds(profile, per_layer, gemm) + ends * tp_ar
    t_cp = layers * cp_seconds(shape, x, cluster, eff, e, bf16)
    t_ep = layers * ep_seconds(shape, x, cluster, eff, e, profile.order)
    across = apart["pp"] * x.pp > g  # a pipeline whose stages span nodes
    t_pp = network.p2p_seconds(cluster, across, act / (x.tp if x.scatter else 1), eff.network)
    if x.scatter:  # the receiving stage all-gathers the tp ranks' slices
        t_pp += network.collective_seconds(cluster, "all_gather", tp_group, act, eff.network)[0]
    t_pp = 2 * m * x.v * t_pp if x.pp > 1 else 0.0
    # the rank's parameters: the dense ones cut over tp, a mixture's experts but its ep share
    # cut over etp (their gradients average over the ranks that hold the same experts: priced
    # over the dp group, a simplification)
    experts = shape.layers * shape.experts * shape.mlp_params()
    held = shape.layers * (shape.experts // x.ep) * shape.mlp_params() / x.expert_tp()
    psi_g = psi or ((shape.params() - experts) / x.tp + held) / x.pp
    # gradients are averaged over dp x cp (every cp rank saw other tokens of the same sequences)
    dp_group = network.spread_axes([(x.tp, x.cp), (apart["dp"], x.dp)], g)
    each = dp_collectives(cluster, x, dp_group, e * psi_g, eff)
    forward = forward_share(shape, x.recompute) * slowest  # one microbatch's, on this stage
    dp = profiles.exposed_dp_seconds(profile, x.zero, each, m, forward, slowest - forward, layers)
    shard = 1 / (x.dp * x.cp) if x.zero else 1.0  # ZeRO: the optimizer steps on the rank's shard
    optimizer = psi_g * shard * profiles.OPTIMIZER_BYTES / cluster.gpu.memory_bw
    return {
        "compute": m * slowest,
        "bubble": (x.pp - 1) / x.v * (fullest + t_tp + t_cp + t_ep),
        "tp": m * t_tp,
        "cp": m * t_cp,
        "ep": m * t_ep,
        "pp": t_pp,
        "dp": dp,
        "optimizer": optimizer,
    }


def strides(x: Layout, order: str) -> dict[str, int]:
    """How many ranks apart two neighbours of each dimension sit, for a rank order given
    innermost first (profiles.MINIDIST_ORDER, "tp-cp-pp-dp": a stage's neighbours tp cp apart,
    the dp replicas tp cp pp apart; profiles.STAGES_OUTERMOST, "tp-cp-dp-pp": the dp replicas tp
    cp apart, the stages tp cp dp apart). network.spread turns a stride into ranks a node."""
    sizes = {"tp": x.tp, "cp": x.cp, "pp": x.pp, "dp": x.dp}
    apart = 1
    found = {}
    for name in order.split("-"):
        found[name] = apart
        apart *= sizes[name]
    return found


def attention_seconds_per_token(
    shape: Shape, x: Layout, cluster: Cluster, flash: bool, rate: float, kernel: str = "flash2"
) -> float:
    """What a fused attention kernel changes in one layer's time per token (all tp ranks): its
    measured seconds (cluster/attention.py's kernel, the framework's: profiles.Profile.attention,
    at the kernel's length s/cp) less the attention's FLOPs as shapes.py counts them (3 x 4 s h,
    + 4 s h recomputed by full or selective) at the bf16 matmul rate (FLOP/s; FP8 never runs
    them). 0 without flash (step() passes none for float32 values too: the kernels run bf16 and
    fp16), or where no rate is measured."""
    if not flash:
        return 0.0
    gen = generation(cluster)
    s, h = shape.seq, shape.q_width()  # the attention's FLOPs are 4 s heads d
    measured = attention.seconds_per_token(
        gen, shape.head_width(), s, h, x.recompute, s // x.cp, kernel
    )
    if measured is None:
        return 0.0
    again = 1 if x.recompute in ("full", "selective") else 0
    return measured - (3 + again) * 4 * s * h / rate


def cp_seconds(shape: Shape, x: Layout, cluster: Cluster, eff, e: int, rate: float) -> float:
    """Seconds one layer's context-parallel ring leaves exposed per microbatch: cp - 1 steps,
    each passing a chunk's keys and values (2 (s/cp) b h_kv/t values) to the next rank, in the
    forward, and twice in the backward (keys and values again, and their gradients back), each
    step's transfer overlapping the attention block of the step before (Liu et al., "Ring
    Attention with Blockwise Transformers", 2023, section 3; Megatron-LM's context parallelism
    likewise): what the attention's own FLOPs (4 s h a token forward, 3x in training: on s/cp
    tokens, 1/t of it) cannot cover. 0 if cp = 1."""
    if x.cp == 1:
        return 0.0
    tokens = shape.seq * x.b / x.cp
    chunk = e * 2 * tokens * shape.kv_width() / x.tp
    across = x.cp * x.tp > cluster.gpus_per_node  # the ring's neighbours are tp ranks apart
    ring = 3 * (x.cp - 1) * network.p2p_seconds(cluster, across, chunk, eff.network)
    attention = 3 * 4 * shape.seq * shape.q_width() * tokens / x.tp / rate
    return max(0.0, ring - attention)


def ep_seconds(
    shape: Shape, x: Layout, cluster: Cluster, eff, e: int, order: str = MINIDIST_ORDER
) -> float:
    """Seconds of one layer's expert-parallel all-to-alls per microbatch: the tokens go to their
    top_k experts and come back (dispatch and combine), forward and backward (4; 6 with full
    recompute), each of a rank's s b / (cp t) tokens x top_k x capacity hidden vectors over the
    ep group (cluster/network.py: all_to_all_seconds), on the critical path (Lepikhin et al.,
    GShard, 2020, section 3.2; Megatron-LM's MoE layer likewise). The group: tp's spare ranks
    (etp apart) first, then dp's, as far apart as the rank order puts dp replicas (strides:
    pp cp tp in minidist's order, cp tp in Megatron's). 0 if ep = 1."""
    if x.ep == 1:
        return 0.0
    tokens = shape.seq * x.b / (x.cp * x.tp) * shape.top_k * shape.capacity
    inner, outer = x.ep_axes()
    axes = [(x.expert_tp(), inner), (strides(x, order)["dp"], outer)]
    group = network.spread_axes(axes, cluster.gpus_per_node)
    each = network.all_to_all_seconds(cluster, group, e * tokens * shape.hidden, eff.network)
    return (6 if x.recompute == "full" else 4) * each


def dp_collectives(cluster: Cluster, x: Layout, group, nbytes: float, eff) -> dict:
    """Seconds of one data-parallel collective of nbytes (a rank's gradients or parameters)
    over its dp group, by kind, NCCL's choice each (cluster/network.py): all_reduce (no ZeRO),
    reduce_scatter and all_gather (ZeRO), ZeRO-3's at the network efficiency its sharded
    traffic reached (eff.sharded). profiles.exposed_dp_seconds says how many run and what
    hides: no ZeRO one all-reduce; ZeRO-1 a reduce-scatter and an all-gather; ZeRO-2 a
    reduce-scatter every microbatch and one all-gather; ZeRO-3 two all-gathers (forward,
    backward) and a reduce-scatter every microbatch. 0 each if dp = 1."""
    kinds = ("all_reduce", "reduce_scatter", "all_gather")
    if x.dp * x.cp == 1:
        return dict.fromkeys(kinds, 0.0)
    reach = eff.sharded if x.zero == 3 else eff.network
    return {k: network.collective_seconds(cluster, k, group, nbytes, reach)[0] for k in kinds}


def sent_nbytes(shape: Shape, layout: Layout, batch: int, e: int = 2, psi: float = 0) -> dict:
    """Bytes one rank of the first stage sends per step on each dimension's links, with ring
    collectives (an all-reduce of N bytes over p ranks: 2 (p-1)/p N; a reduce-scatter or an
    all-gather half that): what step() prices. psi: this rank's parameters (default the
    plan's count: matrices and the embedding, memory_bytes' Psi).
    tp   m (4 L_s + 1) all-reduces of an activation (6 L_s + 1 with full recompute; + 1 for
         the output layer if pp = 1)
    pp   m v activations on and m (v-1) gradients back (chunk 0 of the first stage gets none),
         each 1/tp of the activation with scatter (then the m (2v - 1) it receives are each
         all-gathered on the tp links: (tp-1)/tp of an activation sent)
    dp   step()'s rounds of all-reduces of e psi bytes
    (Context and expert parallelism's traffic is step()'s cp_seconds and ep_seconds, not
    counted here: minidist's main job, which these bytes are checked against, runs neither.)"""
    x = layout
    m = layout.microbatches(batch)
    act = e * shape.seq * layout.b * shape.hidden
    ring = lambda p: 2 * (p - 1) / p  # noqa: E731
    layers = stage_layers(shape, x)
    ends = 2 if x.pp == 1 else 1  # the embedding's all-reduce and the output layer's
    tp = m * (layers * (6 if x.recompute == "full" else 4) + ends) * act * ring(x.tp)
    pp = m * (2 * x.v - 1) * act / (x.tp if x.scatter else 1) if x.pp > 1 else 0
    tp += m * (2 * x.v - 1) * act * ring(x.tp) / 2 if x.scatter and x.pp > 1 else 0
    matrices = shape.embedding_matrices() if x.pp == 1 else 1
    psi = psi or (layers * shape.layer_params() + matrices * shape.vocab * shape.hidden) / x.tp
    rounds = {0: 1, 1: 1, 2: (m + 1) / 2, 3: 1.5 * m}[x.zero]
    return {"dp": rounds * ring(x.dp) * e * psi, "pp": pp, "tp": tp}


@dataclass(frozen=True)
class Plan:
    """One layout's verdict: memory per GPU (bytes), step time by part (s), and the
    reasons it cannot run (empty if it can)."""

    layout: Layout
    memory: dict
    parts: dict
    why_not: tuple[str, ...]

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())


def evaluate(
    shape, layout, cluster, gpus, batch, eff, flash=True, headroom=0.9, e=2, profile=None
) -> Plan:
    """The verdict on one layout; memory must fit in headroom x the GPU's memory (the rest:
    the framework, fragmentation, buffers: an assumption), and only a layout that fits is
    priced. e: bytes of a value, profile: the framework (step; it refuses an interleaved
    pipeline where it has none)."""
    why = problems(shape, layout, gpus, batch)
    profile = profile or profiles.PROFILES[profiles.DEFAULT]
    if layout.v > 1 and not profile.interleaves:
        why.append(f"v={layout.v}: {profile.name}'s pipeline does not interleave (v=1 only)")
    if layout.fp8 and not cluster.gpu.fp8_flops:
        why.append(f"fp8: the {cluster.gpu.name} has no FP8 tensor cores")
    if why:
        return Plan(layout, {}, {}, tuple(why))
    memory = memory_bytes(shape, layout, batch, flash, e)
    total, room = sum(memory.values()), headroom * cluster.gpu.memory
    if total > room:  # not priced: it cannot run
        gb = cluster.gpu.memory / 1e9
        why = f"needs {total / 1e9:.1f} GB a GPU; {headroom:.0%} of {gb:g} GB is {room / 1e9:.1f}"
        return Plan(layout, memory, {}, (why,))
    parts = step(shape, layout, cluster, batch, eff, e, flash, profile=profile)
    return Plan(layout, memory, parts, ())
