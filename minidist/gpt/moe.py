"""The mixture-of-experts variant of the main job's GPT: every block's MLP replaced by the MoE
layer of expert_parallel/moe.py, its experts shared out over the mesh's ep group.

Equals: train_full on the same model with all E experts in one process, each block routing
the whole batch in the same groups as the ranks do (one group per rank and microbatch: b = B /
(dp m) sequences, b T / cp tokens, with cp each rank's zigzag chunks: context.token_order;
capacity and the auxiliary loss are per group, as GShard and Switch define them), the
auxiliary loss weighted 1 / (dp m cp) per group (the mean over groups).
float64: losses 1e-12 relative, parameters 1e-10 (tests/test_train.py).
Communication per step, per rank (ep ranks on ep_comm): per block and microbatch, that of
ExpertParallelMoE (three all-to-alls forward, two backward: expert_parallel/moe.py); at the step's
end replicas.experts all-reduces every gradient once: the dense ones and the routers' over
dp x cp (the routers' as ep, edp, then cp), the experts' over edp then cp, their replicas. On
the dp counter (dp x cp and edp count as dp): 8 + f Psi_r bytes, Psi_r the rank's parameters
(dp_nbytes); on ep the routers' f E D per block and the all-to-alls (what the routers decide).
Memory per rank: the blocks' dense weights, the routers (E D each), E/ep experts per block.
Ladder: MoEBlock (attention, then MoE; the auxiliary loss attached to the output) ->
parallel_block (the experts cut over ep_comm) -> replicas.experts (gradients averaged
over their own replicas).
Paper: Fedus, Zoph, Shazeer, Switch Transformers (JMLR 2022), section 2.2; Lepikhin et al.,
GShard (ICLR 2021), section 2.2; Megatron-LM's MoEAuxLossAutoScaler (megatron/core/
transformer/moe/moe_utils.py) for attaching the auxiliary loss to an activation.
Lesson: lessons/14_expert_parallel/.
Run: minidist train --dp 4 --ep 2 --experts 4 --topk 2 --check

The auxiliary loss reaches the gradients without passing through the pipeline: AttachAux
returns a block's output unchanged and, in backward, hands its aux a gradient of 1 (times
aux_weight). So a block on any stage adds alpha E sum_i f_i P_i to the loss it trains on; the
loss printed is the cross-entropy alone, in every layout and in the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.expert_parallel.moe import SWITCH_ALPHA, ExpertParallelMoE, MoE
from minidist.transformer import TransformerBlock, attention


class AttachAux(torch.autograd.Function):
    """x unchanged; in backward, aux gets gradient 1: as if aux were added to the loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_ones(())


class SelfAttention(nn.Module):
    """Causal multi-head self-attention, whole: x (B, T, D) -> (B, T, D)."""

    def __init__(self, qkv: nn.Linear, proj: nn.Linear, n_heads: int):
        super().__init__()
        self.qkv, self.proj = qkv, proj
        self.n_heads_local = n_heads  # all of them: not cut over tp (as ParallelSelfAttention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(attention(self.qkv(x), self.n_heads_local, causal=True))


class MoEBlock(nn.Module):
    """x + attn(ln1(x)), then + moe(ln2(x)) with moe's auxiliary loss attached: (B, T, D) ->
    (B, T, D). moe is an MoE (every expert: the input cut into groups of group_tokens tokens,
    sequence after sequence; None: one group) or an ExpertParallelMoE (this rank's input is
    one group). order: None, or the B T token numbers in the order the groups take them
    (context.token_order: the tokens of each cp rank together). aux_weight: what one group's
    auxiliary loss weighs in the loss."""

    def __init__(self, ln1: nn.LayerNorm, attn: nn.Module, ln2: nn.LayerNorm, moe: nn.Module):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.moe = ln1, attn, ln2, moe
        self.group_tokens: int | None = None
        self.order: torch.Tensor | None = None
        self.aux_weight = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x).flatten(0, 1)  # (B T, D): sequence after sequence
        if isinstance(self.moe, MoE) and self.group_tokens:
            h = h if self.order is None else h[self.order]  # (B T, D): group after group
            y, aux = self.moe(h, [self.group_tokens] * (h.shape[0] // self.group_tokens))
            y = y if self.order is None else y[self.order.argsort()]  # back in sequence order
        else:
            y, aux = self.moe(h)  # (B T, D), 0-d
        return AttachAux.apply(x + y.view_as(x), aux * self.aux_weight)


def block_full(config, seed: int, dtype) -> MoEBlock:
    """Block `seed`'s MoE form: the attention and LayerNorms of the dense block with that
    seed, and an MoE (router and experts) drawn from seed + 5."""
    c = config
    dense = TransformerBlock(c.d_model, c.n_heads, c.d_ff, causal=True, seed=seed, dtype=dtype)
    moe = MoE(
        c.d_model, c.d_ff, c.experts, c.topk, c.capacity_factor, SWITCH_ALPHA, seed + 5, dtype
    )
    return MoEBlock(dense.ln1, SelfAttention(dense.qkv, dense.proj, c.n_heads), dense.ln2, moe)


def parallel_block(block: MoEBlock, ep_comm) -> MoEBlock:
    """The block with its experts cut over ep_comm: an ExpertParallelMoE holding the same
    router and its E/ep experts, copied from block's (the rest shared)."""
    full, first = block.moe, block.moe.experts[0]
    d, d_ff, router = first.fc1.in_features, first.fc1.out_features, full.router
    moe = ExpertParallelMoE(
        d, d_ff, len(full.experts), ep_comm, router.k, router.capacity_factor, router.alpha,
        dtype=router.weight.dtype,
    )  # fmt: skip
    moe.router.load_state_dict(router.state_dict())
    for local, e in zip(moe.experts, range(moe.lo, moe.lo + moe.n_local), strict=True):
        local.load_state_dict(full.experts[e].state_dict())
    return MoEBlock(block.ln1, block.attn, block.ln2, moe)


def apply_ep(model, ep_comm) -> None:
    """Expert parallelism on a model.GPT with experts, in place: every block's experts cut over
    ep_comm (parallel_block), the router on every rank."""
    for i in model.blocks:
        model.cut(i, lambda block: parallel_block(block, ep_comm), ep_comm)


def group_blocks(
    module: nn.Module, group_tokens: int | None, aux_weight: float, order=None
) -> None:
    """Set every MoEBlock in module to route groups of group_tokens tokens, taken in order
    (None: sequence after sequence), each group's auxiliary loss weighing aux_weight."""
    for block in module.modules():
        if isinstance(block, MoEBlock):
            block.group_tokens, block.aux_weight = group_tokens, aux_weight
            block.order = order


def problems(config) -> list[str]:
    """What stops a TrainConfig's experts (or its ep) from running, with the numbers."""
    c, experts, found = config, config.model.experts, []
    if c.ep > 1 and not experts:
        found.append(f"ep={c.ep} needs experts: --ep shares out the experts of --experts E")
    if experts and c.ep >= 1 and experts % c.ep:
        found.append(f"experts={experts} is not divisible by ep={c.ep}")
    if not experts:
        return found
    refused = {
        "tp": (c.tp, 1, "the experts are not cut over tp"),
        "zero": (c.zero, 0, "ZeRO shards over dp, but the ranks of an ep group hold different"
                 " experts"),
        "amp": (c.amp, "fp32", "the experts train in --dtype only"),
    }  # fmt: skip
    for name, (value, fine, why) in refused.items():
        if value != fine:
            found.append(f"experts={experts} with {name}={value!r} is not supported: {why}")
    return found


def dp_nbytes(params: list, f: int) -> int:
    """Payload bytes a rank hands the dp counter per step with experts: the loss's 8 (float64),
    then every gradient it holds once, in f-byte elements (the dense ones over dp x cp, each
    router's and this rank's experts' over their replicas: replicas.experts sends no flags)."""
    return 8 + f * sum(q.numel() for q in params)
