"""Conformance checks of the capability "tp": column- and row-parallel linear layers and a
tensor-parallel MLP, restated from tests/test_tensor_parallel.py.

Equals: the same layers in one process with the full weights (nn.Linear, F.gelu): the output,
the input's gradient, and each rank's slice of every weight, bias and their gradients (the kit
slices them itself: column-parallel rows r*O/p..(r+1)*O/p of W and b, row-parallel columns
r*I/p..(r+1)*I/p of W and the whole bias). float64, rtol 1e-12 with atol 1e-13: the all-reduce
adds the partial products in another order than one matmul, and elements that cancel to near
zero keep the absolute rounding error of their O(1) terms. Inputs are non-contiguous, 3-d
(batch, tokens, features) or 2-d; sizes are odd multiples of p (e.g. 13 p inputs, 17 p outputs).
Cases: world sizes 1..8 on threads (1..4 over processes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from minidist.conform.checks import Check, compare_all, detached

RTOL, ATOL = 1e-12, 1e-13  # float64: see the module docstring
F64 = torch.float64


def full_linear(i: int, o: int, bias: bool, g: torch.Generator) -> nn.Linear:
    """An nn.Linear (o, i) drawn from g (not the global generator: thread-ranks share it)."""
    lin = nn.utils.skip_init(nn.Linear, i, o, bias, dtype=F64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(o, i, generator=g, dtype=F64))
        if bias:
            lin.bias.copy_(torch.randn(o, generator=g, dtype=F64))
    return lin


def rows(t, r: int, p: int):
    """Rank r's equal share of dim 0."""
    n = t.shape[0] // p
    return t[r * n : (r + 1) * n]


def cols(t, r: int, p: int):
    """Rank r's equal share of the last dim."""
    n = t.shape[-1] // p
    return t[..., r * n : (r + 1) * n]


def leaf(t: torch.Tensor) -> torch.Tensor:
    """t's values as a non-contiguous leaf that requires grad."""
    return t.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()


def problem(case: dict) -> dict:
    """The full problem from the seed: the layer(s), the input x and the upstream gradient gy."""
    p, g = case["p"], torch.Generator().manual_seed(case["seed"])
    shape = (case["b"] * case["t"],) if case["flat"] else (case["b"], case["t"])
    if case["layer"] == "mlp":
        d, ff = case["i"], case["o"] * p  # d_ff split over the ranks
        layers = [full_linear(d, ff, True, g), full_linear(ff, d, True, g)]
        i, o = d, d
    else:
        i, o = case["i"] * p, case["o"] * p
        layers = [full_linear(i, o, case["bias"], g)]
    x = torch.randn(*shape, i, generator=g, dtype=F64)  # (B, T, I) or (B*T, I)
    gy = torch.randn(*shape, o, generator=g, dtype=F64)  # dL/dy
    return {"layers": layers, "x": x, "gy": gy}


def forward(case: dict, layers: list, x: torch.Tensor) -> torch.Tensor:
    """The single-process layer(s)."""
    if case["layer"] == "mlp":
        return layers[1](F.gelu(layers[0](x)))
    return layers[0](x)


def split_input(case: dict) -> bool:
    """Whether a rank gets only its columns of x (a row-parallel layer with input_is_parallel)."""
    return case["layer"] == "row" and case["parallel_input"]


def split_output(case: dict) -> bool:
    """Whether a rank's output is only its columns of y (column-parallel, not gathered)."""
    return case["layer"] == "column" and not case["gather"]


def run_layer(rank, case: dict) -> dict:
    """The adapter's layer on this rank's input; its output, input gradient, parameters and
    their gradients."""
    a = rank.adapter
    p = rank.world_size
    r = rank.rank
    full = problem(case)
    x, gy = full["x"], full["gy"]
    if case["layer"] == "column":
        layer = a.column_parallel_linear(rank.comm, full["layers"][0], case["gather"])
    elif case["layer"] == "row":
        layer = a.row_parallel_linear(rank.comm, full["layers"][0], case["parallel_input"])
    else:
        layer = a.parallel_mlp(rank.comm, *full["layers"])
    x_in = leaf(cols(x, r, p) if split_input(case) else x)
    y = layer(x_in)
    y.backward(cols(gy, r, p) if split_output(case) else gy)
    out = {"y": detached(y), "dL/dx": detached(x_in.grad)}
    parts = {"fc1": layer.fc1, "fc2": layer.fc2} if case["layer"] == "mlp" else {"": layer}
    for prefix, part in parts.items():
        for name in ("weight", "bias"):
            q = getattr(part, name, None)
            key = f"{prefix}.{name}" if prefix else name
            out[key] = detached(q)
            out[f"dL/d{key}"] = None if q is None else detached(q.grad)
    return out


def expected(case: dict, r: int, ref: dict) -> dict:
    """What rank r must hold, sliced here from the single-process run."""
    p = case["p"]
    x = ref["x"]
    layers = ref["layers"]
    want = {
        "y": cols(ref["y"], r, p) if split_output(case) else ref["y"],
        "dL/dx": cols(x.grad, r, p) if split_input(case) else x.grad,
    }
    if case["layer"] == "mlp":
        fc1, fc2 = layers
        slices = {"fc1.weight": rows(fc1.weight, r, p), "fc1.bias": rows(fc1.bias, r, p)}
        slices |= {"fc2.weight": cols(fc2.weight, r, p), "fc2.bias": fc2.bias}
        grads = {"fc1.weight": rows(fc1.weight.grad, r, p), "fc1.bias": rows(fc1.bias.grad, r, p)}
        grads |= {"fc2.weight": cols(fc2.weight.grad, r, p), "fc2.bias": fc2.bias.grad}
    else:
        (lin,) = layers
        if case["layer"] == "column":
            slices = {"weight": rows(lin.weight, r, p)}
            grads = {"weight": rows(lin.weight.grad, r, p)}
            if lin.bias is not None:
                slices["bias"] = rows(lin.bias, r, p)
                grads["bias"] = rows(lin.bias.grad, r, p)
        else:
            slices = {"weight": cols(lin.weight, r, p)}
            grads = {"weight": cols(lin.weight.grad, r, p)}
            if lin.bias is not None:
                slices["bias"] = lin.bias
                grads["bias"] = lin.bias.grad
    want |= {k: v.detach() for k, v in slices.items()}
    want |= {f"dL/d{k}": v.detach() for k, v in grads.items()}
    return want


def judge_layer(case: dict, outputs: list) -> list:
    ref = problem(case)
    x = ref["x"].requires_grad_()
    y = forward(case, ref["layers"], x)
    y.backward(ref["gy"])
    ref["y"] = y.detach()
    problems = []
    for r, got in enumerate(outputs):
        want = expected(case, r, ref)
        pairs = {f"rank {r} {k}": (got.get(k), w) for k, w in want.items()}
        problems += compare_all(pairs, RTOL, ATOL)
    return problems


def cases_of(layer: str, **fixed_values):
    def cases(max_p: int):
        return st.fixed_dictionaries(
            {
                "p": st.integers(1, max_p),
                "i": st.sampled_from([1, 2, 13]),  # per rank (mlp: d_model, whole)
                "o": st.sampled_from([1, 3, 17]),  # per rank (mlp: d_ff per rank)
                "b": st.sampled_from([1, 2, 7]),
                "t": st.integers(1, 3),
                "bias": st.booleans(),
                "flat": st.booleans(),  # 2-d input (batch*tokens, features)
                "seed": st.integers(0, 10**6),
                "layer": st.just(layer),
                **{k: st.just(v) for k, v in fixed_values.items()},
            }
        )

    return cases


def hard(layer: str, **fixed_values) -> tuple:
    """Uneven multiples of p, with and without bias, 2-d and 3-d, on 1, 3, 4 and 8 ranks."""
    base = {"i": 13, "o": 17, "b": 7, "t": 3, "layer": layer} | fixed_values
    return tuple(
        base | {"p": p, "bias": i % 2 == 0, "flat": i % 3 == 0, "seed": 30 + i}
        for i, p in enumerate([1, 3, 4, 8])
    )


def layer_check(name: str, about: str, needs: str, layer: str, **fixed_values) -> Check:
    return Check(
        "tp",
        name,
        about,
        (needs,),
        run_layer,
        judge_layer,
        cases_of(layer, **fixed_values),
        hard(layer, **fixed_values),
    )


CHECKS = [
    layer_check(
        "column_parallel_linear",
        "y_local = x W_r^T + b_r, dL/dx summed over ranks, W, b and their grads sliced by rows "
        "(1e-12)",
        "column_parallel_linear",
        "column",
        gather=False,
    ),
    layer_check(
        "column_parallel_linear.gather_output",
        "gather_output=True: the whole y on every rank, in rank order; dL/dx and slices (1e-12)",
        "column_parallel_linear",
        "column",
        gather=True,
    ),
    layer_check(
        "row_parallel_linear",
        "input_is_parallel: x_local -> y summed over ranks, bias added once; dL/dx_local, W "
        "sliced by columns (1e-12)",
        "row_parallel_linear",
        "row",
        parallel_input=True,
    ),
    layer_check(
        "row_parallel_linear.split_input",
        "input_is_parallel=False: the layer splits the whole x itself; dL/dx whole (1e-12)",
        "row_parallel_linear",
        "row",
        parallel_input=False,
    ),
    layer_check(
        "parallel_mlp",
        "fc2(gelu(fc1(x))): y and dL/dx whole on every rank, fc1 by rows, fc2 by columns (1e-12)",
        "parallel_mlp",
        "mlp",
    ),
]
