"""The zero-bubble split of a backward: B, the input gradient, now; W, the weight gradients, later.

Equals: torch.autograd.backward of the chunk at once: the same input and weight gradients, B
and W only run at different times (float64: 1e-12 relative, as tests/test_pipeline.py checks).
Communication: none (the executor, pipeline/stage.py, sends what B returns).
Memory per rank: each layer's graph is kept from B until W (retain_graph), plus its output
gradient: a microbatch's activations stay until its W (ZB-H1's min(p, m) microbatches).
Ladder: a chunk run at once (GPipe, 1F1B) -> run layer by layer on detached inputs, so that B is
autograd.grad of each layer's input alone and W autograd.backward into its weights alone.
Paper: Qi et al., Zero Bubble Pipeline Parallelism (2023), section 2.
Lesson: lessons/06_pipeline/.   Run: minidist schedule --schedule zb --stages 4 --microbatches 8
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LayerGraph:
    """One layer of a chunk run for ZB, its graph cut from its neighbours': its (detached)
    input, output, weights, and the output gradient B leaves for W."""

    inp: torch.Tensor
    out: torch.Tensor
    params: list[nn.Parameter]
    grad_out: torch.Tensor | None = None


def run_layer_by_layer(chunk: nn.Module, x: torch.Tensor) -> list[LayerGraph]:
    """Run chunk layer by layer, each layer on a detached copy of its input: then B and W
    can run per layer, W long after B. A chunk that is not an nn.Sequential is one layer:
    its W then redoes the input gradients inside it (correct, but as slow as a backward)."""
    graphs, h = [], x
    for layer in chunk if isinstance(chunk, nn.Sequential) else [chunk]:
        inp = h.detach().requires_grad_(h.requires_grad)
        h = layer(inp)
        graphs.append(LayerGraph(inp, h, [q for q in layer.parameters() if q.requires_grad]))
    return graphs


def input_gradient(graphs: list[LayerGraph], g: torch.Tensor | None) -> torch.Tensor | None:
    """ZB's B: the gradient of the first layer's input from g, the last layer's output
    gradient, layer by layer from the last; each layer keeps its output gradient for W, and
    its graph stays (retain_graph). None where nothing flows back."""
    for graph in reversed(graphs):
        graph.grad_out = g
        if g is None or not (graph.inp.requires_grad and graph.out.requires_grad):
            g = None  # nothing flows further back
            continue
        (g,) = torch.autograd.grad(graph.out, graph.inp, g, retain_graph=True, allow_unused=True)
    return g


def weight_gradients(graphs: list[LayerGraph]) -> None:
    """ZB's W: each layer's weight gradients (into .grad) from the output gradient B kept."""
    for graph in graphs:
        if graph.params and graph.grad_out is not None and graph.out.requires_grad:
            torch.autograd.backward(graph.out, graph.grad_out, inputs=graph.params)
