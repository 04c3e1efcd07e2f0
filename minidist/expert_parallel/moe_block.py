"""The transformer block with a mixture of experts in place of its MLP, and its experts shared
out over an ep group: the main job's third step (gpt/train.py), on the layers of
minidist/transformer.py.

Equals: MoEBlock with an MoE (moe.py) is the single-process block; parallel_block holds the same
router and E/ep of its experts (ExpertParallelMoE), and the main job trained with them equals
the single-process run (float64: losses 1e-12 relative, parameters 1e-10, tests/test_train.py).
Communication per block and microbatch: ExpertParallelMoE's (three all-to-alls forward, two
backward: moe.py); none while applying.
Memory per rank: the block's dense weights, the router (E D), E/ep experts.
Ladder: MoEBlock (attention, then MoE; the auxiliary loss attached to the output) ->
parallel_block (the experts cut over ep_comm) -> apply_ep (every block of the layers) ->
apply_expert_dp (every gradient averaged over its own replicas: minidist/replicas.py).
Paper: Fedus, Zoph, Shazeer, Switch Transformers (JMLR 2022), section 2.2; Lepikhin et al.,
GShard (ICLR 2021), section 2.2; Megatron-LM's MoEAuxLossAutoScaler (megatron/core/
transformer/moe/moe_utils.py) for attaching the auxiliary loss to an activation.
Lesson: lessons/14_expert_parallel/; the composition: lessons/12_3d_parallel/.

The auxiliary loss reaches the gradients without passing through a pipeline: AttachAux returns
a block's output unchanged and, in backward, hands its aux a gradient of 1 (times aux_weight).
So a block on any stage adds alpha E sum_i f_i P_i to the loss it trains on; the loss printed
is the cross-entropy alone.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.expert_parallel.moe import SWITCH_ALPHA, ExpertParallelMoE, MoE, sync_grads
from minidist.replicas import Replicas, held_nbytes
from minidist.transformer import TransformerBlock, attention, recording_cut


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
    one group). order: None, or the B T token numbers in the order the groups take them (the
    main job's gpt/context.token_order: the tokens of each cp rank together). aux_weight: what
    one group's auxiliary loss weighs in the loss."""

    def __init__(self, ln1: nn.LayerNorm, attn: nn.Module, ln2: nn.LayerNorm, moe: nn.Module):
        super().__init__()
        self.ln1 = ln1
        self.attn = attn
        self.ln2 = ln2
        self.moe = moe
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
    d = first.fc1.in_features
    d_ff = first.fc1.out_features
    router = full.router
    moe = ExpertParallelMoE(
        d,
        d_ff,
        len(full.experts),
        ep_comm,
        router.k,
        router.capacity_factor,
        router.alpha,
        dtype=router.weight.dtype,
    )
    moe.router.load_state_dict(router.state_dict())
    for local, e in zip(moe.experts, range(moe.lo, moe.lo + moe.n_local), strict=True):
        local.load_state_dict(full.experts[e].state_dict())
    return MoEBlock(block.ln1, block.attn, block.ln2, moe)


def apply_ep(layers: nn.ModuleList, ep_comm) -> dict[int, torch.Tensor]:
    """Expert parallelism, in place: every MoEBlock's experts cut over ep_comm
    (parallel_block), the router on every rank. Returns {i: which of layer i's elements this
    rank holds} (recording_cut) for every block cut."""
    held = {}
    for i, layer in enumerate(layers):
        if isinstance(layer, MoEBlock):
            with recording_cut(layers, i, held):
                layers[i] = parallel_block(layer, ep_comm)
    return held


def group_blocks(
    module: nn.Module, group_tokens: int | None, aux_weight: float, order=None
) -> None:
    """Set every MoEBlock in module to route groups of group_tokens tokens, taken in order
    (None: sequence after sequence), each group's auxiliary loss weighing aux_weight."""
    for block in module.modules():
        if isinstance(block, MoEBlock):
            block.group_tokens, block.aux_weight = group_tokens, aux_weight
            block.order = order


def apply_expert_dp(module: nn.ModuleList, mesh, adamw, scaler) -> Replicas:
    """Data parallel replicas of layers with experts (fp32, no ZeRO: the main job's step 5),
    stepped by adamw on each rank: the step sums each gradient over its replicas by hand
    (dense: mesh.grad_comm, dp x cp; each block's router: ep, edp, cp, every rank; its
    experts: edp, cp), then divides all by dp cp: their mean. Checkpoints are refused."""
    moes = [m for m in module.modules() if isinstance(m, (MoE, ExpertParallelMoE))]
    routed = {id(q) for moe in moes for q in moe.parameters()}
    dense = [q for q in module.parameters() if id(q) not in routed]
    replicas = mesh.dp_comm if mesh.edp_comm is None else mesh.edp_comm  # ep = 1: all of dp
    n = mesh.grad_comm.world_size  # dp x cp: every rank whose loss the mean is over

    def update() -> bool:
        for q in dense:
            if q.grad is None:  # every rank must reduce the same tensors
                q.grad = torch.zeros_like(q)
            mesh.grad_comm.all_reduce(q.grad, "sum")
        for moe in moes:
            sync_grads(moe, mesh.ep_comm, replicas)
            sync_grads(moe, None, mesh.cp_comm)  # router and experts: cp saw other tokens
        for q in module.parameters():
            q.grad.div_(n)  # sums over every dp (x cp) rank's loss: the mean
        adamw.step()
        return True

    def refused(*_):
        raise ValueError("checkpoints of a run with experts are not supported")

    held = lambda: held_nbytes(module, adamw, [])  # noqa: E731
    return Replicas(module, adamw, scaler, update, adamw.zero_grad, refused, refused, held)
