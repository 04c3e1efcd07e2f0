"""What ZeRO costs: the paper's bytes per rank and bytes sent per step as formulas, and the
bytes a ZeRO object's rank holds, counted (tests and benches set the two side by side).

Equals: model_state_nbytes and sent_nbytes are the formulas of zero/stages.py's docstring (the
paper's section 5, figure 1; sent with ring collectives); memory_nbytes counts what a rank of ZeRO1,
ZeRO2 or ZeRO3 holds now, by storage (memory.storage_nbytes), and tests/test_zero.py asserts
that the counts equal the formulas, stage by stage, in float64 and in mixed precision.
Communication: none (formulas, and counting this rank's tensors).
Memory: none.
Paper: Rajbhandari et al., ZeRO (SC 2020), sections 3.1, 5 and 7.   Lesson: lessons/07_zero/.
Run: minidist bench zero -n 2 (measured beside these formulas).
"""

from __future__ import annotations

import torch

from minidist.memory import storage_nbytes


def model_state_nbytes(
    stage: int, numel: int, p: int, b: int, k: float, m: int = 0
) -> dict[str, float]:
    """The paper's bytes per rank (section 5, figure 1) for numel elements: parameters and
    gradients of b bytes, k b bytes of optimizer state per element (K = k b; stage 0: data
    parallelism). Exact when p divides every unit's size, else shards carry < p pad elements.

    m > 0: mixed precision as this project holds it: the optimizer steps a master copy of m
    bytes per element and keeps its k states in m bytes (K = (1 + k) m: the paper's 12 for
    float32 Adam); the gradient shard is kept in m bytes too, so microbatches accumulate in
    float32. Stage 1 holds the model's gradients until the sync, then the shard (the larger
    counts); stage 0 is amp.MixedPrecisionOptimizer, which keeps a whole float32 buffer."""
    full, shard = numel * b, numel * b / p
    if not m:
        return {
            "params": shard if stage >= 3 else full,
            "grads": shard if stage >= 2 else full,
            "optimizer": k * (shard if stage >= 1 else full),
        }
    master = numel * m / p if stage >= 1 else numel * m
    return {
        "params": shard if stage >= 3 else full,
        "grads": {0: full + master, 1: max(full, master)}.get(stage, master),
        "optimizer": (1 + k) * master,
    }


def sent_nbytes(stage: int, numel: int, p: int, b: int, r: int = 0) -> float:
    """Bytes each rank sends per step with ring collectives (the used-flags not counted): the
    all-gathers move the parameters' b bytes per element, the reduce-scatter (stage 0: the
    all-reduce) the gradients' r bytes (mixed precision's reduce dtype; default b)."""
    r = r or b
    if stage == 0:
        return 2 * (p - 1) / p * numel * r
    return (p - 1) / p * numel * ((2 if stage == 3 else 1) * b + r)


def memory_nbytes(zero) -> dict[str, int]:
    """Bytes of model state a ZeRO object's rank holds now, counted by storage: params, grads,
    optimizer (elementwise state and, with mixed precision, the master shard, as the paper
    counts it; Adam's 0-d step counters left out) and buffers (in flight)."""
    units = zero.units
    state = [v for s in zero.optimizer.state.values() for v in s.values()]
    state = [v for v in state if torch.is_tensor(v) and v.dim() > 0] + [u.master for u in units]
    return {
        "params": storage_nbytes([u.flat for u in units] + [u.shard for u in units]),
        "grads": storage_nbytes(
            [q.grad for u in units for q in u.params] + [u.grad_shard for u in units]
        ),
        "optimizer": storage_nbytes(state),
        "buffers": storage_nbytes([t for u in units for t in (u.grad_flat, u.recv, u.landing)]),
    }
