"""The single-process check of the main job: the program every dp x pp x tp layout must equal
(train_whole), the distributed model put back together (whole_parameters), each rank's part of
it (local_parameters), and the difference.

Equals: train_whole is the reference itself: nn.Sequential(whole_layers) on the whole batch,
the same batches, AdamW (with the same weight-decay groups: train.decay_groups), learning-rate
schedule and precision as train.py's ranks.
Communication (whole_parameters, once): an all_gather over tp of each layer's slices and their
element numbers, and one send per stage to stage 0 over pp, on replica 0.
Memory: the whole model, in float64, on world rank 0.
Lesson: lessons/12_3d_parallel/.   Run: minidist train --dp 2 --pp 2 --tp 2 --check
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from minidist.amp import LossScaler, MixedPrecisionOptimizer
from minidist.gpt import model as gpt
from minidist.gpt.data import batch_at, load_bytes
from minidist.gpt.train import DTYPES, Job, TrainConfig, decay_groups, make_optimizer
from minidist.lr import WarmupDecay


def whole_parameters(job: Job) -> list[torch.Tensor] | None:
    """The whole model's parameters, flattened per layer, in float64, on world rank 0 (None
    elsewhere). Each tp group puts its layers back together (all_gather), then every stage
    of replica 0 sends its layers to stage 0 (pp send/recv)."""
    mesh, config = job.mesh, job.config
    d, _, _ = mesh.coords
    with job.replicas.gathered():
        layers = [gpt.unwrap(x) for chunk in job.chunks for x in chunk]
        mine = [_whole_flat(config.model, i, x, mesh.tp_comm)
                for i, x in zip(sum(job.layer_ids, []), layers, strict=True)]  # fmt: skip
    if d != 0:
        return None  # every replica holds the same model
    ids = sum(job.layer_ids, [])
    found = to_stage_zero(job, {i: x[None] for i, x in zip(ids, mine, strict=True)})  # (1, n_i)
    return None if found is None else [found[i][0] for i in range(config.model.n_layers + 2)]


def local_parameters(job: Job) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer i: (which whole elements this rank holds, their values in float64 on the CPU)}
    for every layer of this rank (ZeRO-3's inside gathered()): to compare every rank with
    whole_parameters or train_whole, as `whole[i][where]`. No communication beyond gathered()."""
    found = {}
    with job.replicas.gathered():
        layers = [gpt.unwrap(x) for chunk in job.chunks for x in chunk]
        for i, layer in zip(sum(job.layer_ids, []), layers, strict=True):
            where, _ = element_numbers(job.config.model, i, job.mesh.tp_comm)
            mine = torch.cat([q.detach().double().cpu().reshape(-1) for q in layer.parameters()])
            found[i] = (where, mine)
    return found


def to_stage_zero(job: Job, mine: dict[int, torch.Tensor]) -> dict[int, torch.Tensor] | None:
    """Every layer's tensor (rows, n_i), whole, on world rank 0 (None elsewhere), from this
    stage's layers `mine` (already put back together over tp): tp rank 0 of each other stage
    sends its layers, in layer order, to stage 0 (one pp send each). Call on replica 0."""
    mesh, config = job.mesh, job.config
    _, s, t = mesh.coords
    if t != 0:
        return None
    if s != 0:
        mesh.pp_comm.send(torch.cat([mine[i].reshape(-1) for i in sorted(mine)]).to(job.device), 0)
        return None
    rows, found = next(iter(mine.values())).shape[0], dict(mine)
    for other in range(1, config.pp):
        ids = sorted(sum(gpt.stage_layer_ids(config.model, config.pp, config.chunks, other), []))
        sizes = [rows * layer_numel(config.model, i) for i in ids]
        flat = torch.empty(sum(sizes), dtype=torch.float64, device=job.device)
        flat = mesh.pp_comm.recv(flat, other).cpu()
        found.update({i: x.view(rows, -1) for i, x in zip(ids, flat.split(sizes), strict=True)})
    return found


def layer_numel(model: gpt.GPTConfig, i: int) -> int:
    """Elements of layer i's whole parameters."""
    return sum(q.numel() for q in gpt.whole_layer(model, i, torch.float64).parameters())


def element_numbers(model: gpt.GPTConfig, i: int, tp_comm) -> tuple[torch.Tensor, int]:
    """Which elements of layer i's whole parameters (laid end to end, n in all) this tp rank
    holds, in the order of its own parameters: cut a whole layer whose parameters hold their
    own element numbers, the same way the model is cut, and read the slices."""
    probe = gpt.whole_layer(model, i, torch.float64)
    n = 0
    with torch.no_grad():
        for q in probe.parameters():
            q.copy_(torch.arange(n, n + q.numel(), dtype=torch.float64).view_as(q))
            n += q.numel()
    cut = gpt.parallel_layer(probe, tp_comm).parameters()  # slicing only: no communication
    return torch.cat([q.detach().reshape(-1) for q in cut]).long(), n


def _whole_flat(model: gpt.GPTConfig, i: int, layer: nn.Module, tp_comm) -> torch.Tensor:
    """Layer i's whole parameters, flat (float64), from every tp rank's slices."""
    return whole_flat(model, i, list(layer.parameters()), tp_comm)


def whole_flat(model: gpt.GPTConfig, i: int, tensors: list, tp_comm) -> torch.Tensor:
    """Layer i's whole tensors, flat (float64), from every tp rank's slices: tensors are this
    rank's, one per parameter of its cut of layer i, in order (values, or an optimizer's
    state of the same shapes). An all_gather of the values with their element numbers."""
    where, n = element_numbers(model, i, tp_comm)
    values = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    both = torch.empty(tp_comm.world_size, 2, len(values), dtype=torch.float64,
                       device=values.device)  # fmt: skip
    tp_comm.all_gather(both, torch.stack([where.to(values.device).double(), values]))
    both, flat = both.cpu(), torch.empty(n, dtype=torch.float64)
    flat[both[:, 0].reshape(-1).long()] = both[:, 1].reshape(-1)  # replicated ones: equal
    return flat


def train_whole(config: TrainConfig, data=None, on_step: Callable | None = None) -> dict:
    """The single-process program every layout must equal: the whole model on the whole
    batch, same batches, same AdamW, same schedule, same precision."""
    data = load_bytes() if data is None else data
    layers = gpt.whole_layers(config.model, DTYPES[config.dtype])
    model, opt = nn.Sequential(*layers), make_optimizer(config)
    groups = lambda tensors: opt(decay_groups(model, tensors))  # noqa: E731  # as every rank
    if config.amp != "fp32":
        scaler = LossScaler(2.0**16) if config.amp == "fp16" else LossScaler(1.0, dynamic=False)
        optimizer = MixedPrecisionOptimizer(model, groups, config.precision, scaler)
    else:
        optimizer, scaler = groups(None), LossScaler(1.0, dynamic=False)
    schedule = WarmupDecay(optimizer, config.warmup, config.steps)
    losses, skipped, start = [], [], time.perf_counter()
    for step in range(config.steps):
        ids, targets = batch_at(data, step, config.batch, config.model.seq_len, config.seed)
        loss = gpt.loss_whole(model(ids), targets)
        (loss * scaler.scale).backward()
        if isinstance(optimizer, MixedPrecisionOptimizer):
            stepped = optimizer.step()
        else:
            optimizer.step()
            stepped = True
        optimizer.zero_grad()
        schedule.step()
        losses.append(loss.item())
        if not stepped:
            skipped.append(step)
        if on_step is not None:
            on_step(step, loss.item())
    seconds = time.perf_counter() - start
    params = [torch.cat([q.detach().double().reshape(-1) for q in x.parameters()]) for x in layers]
    return {"losses": losses, "skipped": skipped, "seconds": seconds, "parameters": params}


# the largest relative differences --check accepts, and why:
# float64: sums in another order (losses); AdamW's division by sqrt(v) + eps lets the last bits
#   of near-eps gradient elements move a parameter by ~1e-12 of the largest (see test_train).
# float32: the same, 2^29 times coarser, grown over the steps: measured 1e-7 (loss) and 3e-4
#   (parameters) after 60 steps of the demo.
# bf16/fp16: the model's own rounding (2^-8, 2^-11) in another order; the parameters compared
#   are the rounded model copies, so only the loss curve is judged (measured ~3e-4, bf16).
TOLERANCES = {"float64": (1e-12, 1e-10), "float32": (1e-5, 2e-3), "amp": (1e-2, None)}


def differences(result: dict, reference: dict, config: TrainConfig | None = None) -> dict:
    """The largest relative difference of the loss curves and of the final parameters (each
    layer's largest difference over its largest value); with config, "ok": within TOLERANCES."""
    first = result.get("first_step", 0)  # a resumed run: its steps only
    a = torch.tensor(result["losses"], dtype=torch.float64)
    b = torch.tensor(reference["losses"][first : first + len(a)], dtype=torch.float64)
    loss = ((a - b).abs() / b.abs().clamp_min(1e-30)).max().item()
    params = max(
        ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
        for x, y in zip(result["parameters"], reference["parameters"], strict=True)
    )
    found = {"loss": loss, "parameters": params}
    found["same_skipped_steps"] = result["skipped"] == [
        k for k in reference["skipped"] if k >= first
    ]
    if config is not None:
        loss_tol, param_tol = TOLERANCES["amp" if config.amp != "fp32" else config.dtype]
        found["tolerance"] = {"loss": loss_tol, "parameters": param_tol}
        found["ok"] = loss <= loss_tol and (param_tol is None or params <= param_tol)
    return found
