"""The main job's optimizer: AdamW with GPT's weight decay (on the weight matrices only), the
same in every layout and in the single-process reference, and the loss scale of its precision.

Equals: torch.optim.AdamW over decay_groups, in one process and on every rank (each on the
slices it holds: the rule reads modules and dimensions, so slices split like the full model).
Lesson: lessons/12_3d_parallel/ (weight decay, GPT's way).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minidist.mixed_precision.amp import LossScaler
from minidist.tensor_parallel.blocks import VocabParallelEmbedding

EMBEDDINGS = (nn.Embedding, VocabParallelEmbedding)  # lookup tables, full or cut over tp


def make_optimizer(config):
    """AdamW on any tensors or groups: the optimizer of every variant (and of the reference);
    weight_decay is the default, which decay_groups turns off where GPT practice does."""

    def adamw(params, **kw) -> torch.optim.AdamW:
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, **kw)

    return adamw


def decay_groups(module: nn.Module, tensors: list | None = None) -> list[dict]:
    """AdamW's two groups over module's trainable parameters (or over tensors standing for
    them, in the same order: amp's masters): the weight matrices of linear layers decay (the
    optimizer's weight_decay); biases, LayerNorm weights and the token and position embeddings
    do not (weight_decay 0), as GPT-2/3 and minGPT train (a table row is decayed every step
    but gets a gradient only when its token appears). The rule reads each parameter's module
    and dimensions, so the full model and its tp slices split alike."""
    params = [q for q in module.parameters() if q.requires_grad]
    no_decay = set()
    for m in module.modules():
        for q in m.parameters(recurse=False):
            if q.dim() < 2 or isinstance(m, EMBEDDINGS):
                no_decay.add(id(q))
    tensors = params if tensors is None else list(tensors)
    decay = [id(q) not in no_decay for q in params]
    return [
        {"params": [t for t, d in zip(tensors, decay, strict=True) if d]},
        {"params": [t for t, d in zip(tensors, decay, strict=True) if not d], "weight_decay": 0.0},
    ]


def grouped_optimizer(config, module: nn.Module) -> Callable:
    """tensors -> AdamW over decay_groups(module, tensors) (None: module's own parameters)."""
    adamw = make_optimizer(config)

    def build(tensors: list | None = None) -> torch.optim.AdamW:
        return adamw(decay_groups(module, tensors))

    return build


def make_scaler(amp: str) -> LossScaler:
    """fp16 needs a dynamic loss scale (its range is narrow); bf16 and fp32 none."""
    if amp == "fp16":
        return LossScaler(2.0**16)
    return LossScaler(1.0, dynamic=False)
