"""A model's shape for the planner, and how it is counted: parameters and FLOPs, each by a
named convention.

Equals: nothing runs here; the counts are formulas of the shape. tests/test_plan.py checks them
against Narayanan et al.'s FLOP formula and the parameter counts the models are named by.
Parameters: L (attention + MLP) + V h for the embedding, + V h again for an untied output
layer (tied: the output layer is the embedding's matrix, counted once, as GPT-2/3, Megatron-LM,
BLOOM and MPT do; Llama and GPT-NeoX-20B untie it). Biases and norms (< 0.1%) are left out.
FLOPs per token, three conventions:
    executed   what the GPUs run: 3 forwards (forward, and a backward of twice its work), plus
               what recompute runs again: full, the layers' forward; selective, the attention
               core's matmuls, 4 s h a layer; op, TorchTitan's selective policy, every second
               linear layer's forward, the attention kept (its activation_checkpoint.py: "saves
               output of all compute ops, except every second mm") (step_flops_per_token:
               plan.step prices it)
    model      3 forwards, no recompute, whatever the layout: MFU's numerator (Chowdhery et
               al., PaLM, 2022, appendix B)
    hardware   the model's plus recompute as the papers count it: full, the layers' forward
               (Narayanan et al., SC 2021, equation 3: 96 B s l h^2 (1 + s/6h + V/16lh));
               selective, 12 s h a layer (Korthikanti et al., 2022: their HFU of table 5 is
               72 B s l h^2 (1 + s/3h + V/12lh), model FLOPs' s/6h twice)
A forward: 2 x the layer's matmul parameters + 4 s h (attention scores and values; 4 s heads d
where the heads' width d is not h / heads) per layer, and 2 V h for the logits.
Ladder: Shape -> params (tied or not) -> the three FLOP counts -> plan.py prices them.
Paper: Narayanan et al. (SC 2021), section 5.1; Korthikanti et al. (2022).
Lesson: lessons/13_beyond_one_machine/.   Run: minidist plan --model gpt3-175b
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer: layers, hidden size, heads (kv_heads < heads: grouped
    queries, keys and values of kv_heads heads; head_dim: each head's width, if not
    hidden / heads), FFN size, vocabulary, sequence length; glu: a
    gated MLP (3 matrices, Llama); dropout: its masks are kept for backward; tied: the output
    layer is the embedding's; experts > 0: every layer's MLP is a mixture of that many experts
    of ffn each, top_k of them for each token, each expert computing at most capacity x its
    even share of the tokens (Switch Transformer's capacity factor: Fedus et al., JMLR 2022,
    section 2.1; the executed FLOPs count the capacity, padded or not, the model FLOPs only
    top_k)."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    kv_heads: int = 0  # 0: as many as heads
    glu: bool = False
    dropout: bool = True  # its masks are stored for backward (Korthikanti et al. count them)
    tied: bool = False  # the output layer shares the embedding's matrix
    experts: int = 0  # 0: a dense MLP
    top_k: int = 1
    capacity: float = 1.0
    head_dim: int = 0  # 0: hidden / heads

    def head_width(self) -> int:
        """One head's width d: head_dim, or h / heads."""
        return self.head_dim or self.hidden // self.heads

    def q_width(self) -> int:
        """Width of the queries (and of the attention's output): heads x d, h unless head_dim
        says otherwise (Qwen3, GPT-OSS: attention wider or narrower than the model)."""
        return self.heads * self.head_width()

    def kv_width(self) -> int:
        """Width of the keys (and of the values): kv_heads x d (h kv_heads / heads by default)."""
        return (self.kv_heads or self.heads) * self.head_width()

    def attention_params(self) -> int:
        """q and out (h x heads d each), k and v (h x kv_width each)."""
        return 2 * self.hidden * self.q_width() + 2 * self.hidden * self.kv_width()

    def mlp_params(self) -> int:
        """One MLP (one expert): up (twice if gated) and down."""
        return (3 if self.glu else 2) * self.hidden * self.ffn

    def layer_params(self) -> int:
        """Parameters of one layer's matrices (biases and norms are < 0.1%: left out): attention,
        the MLP or every expert's and the router's h x experts."""
        router = self.hidden * self.experts
        return self.attention_params() + max(1, self.experts) * self.mlp_params() + router

    def active_layer_params(self, capacity: bool = False) -> float:
        """The parameters a token's forward multiplies by in one layer: attention, top_k experts
        (x capacity: what the experts run, capacity included) and the router."""
        if not self.experts:
            return self.layer_params()
        k = self.top_k * (self.capacity if capacity else 1.0)
        return self.attention_params() + k * self.mlp_params() + self.hidden * self.experts

    def embedding_matrices(self) -> int:
        """V x h matrices: the embedding, and the output layer unless tied (1 or 2)."""
        return 1 if self.tied else 2

    def params(self) -> int:
        """Every parameter: the layers, the token embedding and the output layer unless tied."""
        return (
            self.layers * self.layer_params() + self.embedding_matrices() * self.vocab * self.hidden
        )

    def layers_flops_per_token(self, capacity: bool = False) -> float:
        """The layers' forward: matmuls 2 x their active parameters (capacity: as executed),
        attention scores and values 4 s h each."""
        active = self.active_layer_params(capacity)
        return self.layers * (2 * active + 4 * self.seq * self.q_width())

    def forward_flops_per_token(self, capacity: bool = False) -> float:
        """The whole forward: the layers, then the logits' 2 V h."""
        return self.layers_flops_per_token(capacity) + 2 * self.vocab * self.hidden

    def step_flops_per_token(self, recompute: str = "none") -> float:
        """Executed: forward and backward (3 forwards, experts at their capacity), plus what
        recompute runs again: full, the layers' forward (not the logits: Narayanan et al.'s
        96 B s l h^2 (1 + s/6h + V/16lh)); selective, the attention core's matmuls, 4 s h a
        layer; op (TorchTitan's selective policy), every second linear layer's forward."""
        again = {"none": 0, "full": self.layers_flops_per_token(capacity=True)}
        again["selective"] = 4 * self.seq * self.q_width() * self.layers
        again["op"] = self.active_layer_params(capacity=True) * self.layers  # half of 2 x
        return 3 * self.forward_flops_per_token(capacity=True) + again[recompute]

    def model_flops_per_token(self) -> float:
        """Model FLOPs (MFU's): 3 forwards, no recompute (Chowdhery et al., appendix B); a
        mixture of experts' active parameters (top_k experts, no capacity)."""
        return 3 * self.forward_flops_per_token()

    def hardware_flops_per_token(self, recompute: str = "none") -> float:
        """Hardware FLOPs (HFU's) as the papers count them: full recompute adds the layers'
        forward (Narayanan et al., equation 3), selective 12 s h a layer (Korthikanti et al.'s
        HFU, 1 + s/3h where model FLOPs have 1 + s/6h)."""
        again = {"none": 0, "full": self.layers_flops_per_token()}
        again["selective"] = 12 * self.seq * self.q_width() * self.layers
        again["op"] = self.active_layer_params() * self.layers  # as executed: no paper counts it
        return self.model_flops_per_token() + again[recompute]


def conventions(shape: Shape) -> dict:
    """How this shape's numbers are counted, in words (minidist plan prints and --json holds
    them)."""
    tied = "tied to the embedding, counted once" if shape.tied else "untied, counted apart"
    return {
        "parameters": f"the output layer {tied}",
        "mfu": "model FLOPs, 3 forwards, no recompute (Chowdhery et al., PaLM, appendix B)",
        "hfu": "model FLOPs and recompute: full, the layers' forward (Narayanan et al., eq. 3); "
        "selective, 12 s h a layer (Korthikanti et al., table 5)",
    }


# [GPT3] Brown et al., "Language Models are Few-Shot Learners" (2020), table 2.1; vocabulary
#        padded to 51,200 as Megatron-LM does; the output layer tied to the embedding (GPT-2's,
#        Radford et al., 2019, as Megatron-LM trains it: 174.6B, Narayanan et al., table 2).
#        [LLAMA2] Touvron et al., "Llama 2" (2023), table 1 and the released configs; no
#        dropout (the released code has no dropout layer), an untied output layer (its
#        params.json and model.py: tok_embeddings and output apart).
#        [LLAMA3] Dubey et al., "The Llama 3 Herd of Models" (2024), table 3.
#        [MIXTRAL] Jiang et al., "Mixtral of Experts" (2024), table 1: 32 layers of 4096, 32
#        heads (8 kv), 8 experts of 14336 (gated), 2 a token, vocabulary 32000, context 32768;
#        46.7B parameters here, 12.9B active (the paper: 47B and 13B). The MoE's
#        capacity is left at 1 (Mixtral drops no tokens: an assumption for its time).
SHAPES = {
    "gpt3-175b": Shape("GPT-3 175B", 96, 12288, 96, 4 * 12288, 51200, 2048, tied=True),  # [GPT3]
    "llama-70b": Shape("Llama 2 70B", 80, 8192, 64, 28672, 32000, 4096, 8, True, False),  # [LLAMA2]
    "llama-7b": Shape("Llama 2 7B", 32, 4096, 32, 11008, 32000, 4096, 0, True, False),  # [LLAMA2]
    "llama3-405b": Shape("Llama 3 405B", 126, 16384, 128, 53248, 128256, 8192, 8, True, False),
    "mixtral-8x7b": Shape(
        "Mixtral 8x7B", 32, 4096, 32, 14336, 32000, 32768, 8, True, False, experts=8, top_k=2
    ),  # [MIXTRAL]
    "minidist": Shape("minidist's GPT", 4, 64, 4, 256, 256, 64, dropout=False),  # train's
}
