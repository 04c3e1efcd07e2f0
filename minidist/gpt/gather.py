"""The cut model put back together: the full parameters on world rank 0 (parameters_full),
each rank's part of them (local_parameters); which elements of a layer's full parameters each
tp rank holds (element_numbers), a layer made full from its tp slices (flat_full), and every
stage's layers sent to world rank 0 (to_stage_zero). Shared by the check against one process
(reference.py, --check) and the checkpoints (resume.save, restore).

Communication: flat_full, an all_gather over tp of the values with their element numbers;
to_stage_zero, one pp send per stage (tp rank 0 of replica 0).
Memory: the full model, in float64, on world rank 0 (to_stage_zero's result).
Lesson: lessons/12_3d_parallel/.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minidist.gpt import model as gpt

if TYPE_CHECKING:
    from minidist.gpt.train import Job


def parameters_full(job: Job) -> list[torch.Tensor] | None:
    """The whole model's parameters, flattened per layer, in float64, on world rank 0 (None
    elsewhere). Each tp group puts its layers back together (all_gather), then every stage
    of replica 0 sends its layers to stage 0 (pp send/recv)."""
    mesh, config = job.mesh, job.config
    d, _, _ = mesh.coords
    with job.replicas.gathered():
        layers = [gpt.unwrap(x) for chunk in job.chunks for x in chunk]
        mine = [
            flat_full(config.model, i, list(x.parameters()), mesh.tp_comm, _ep(job, i))
            for i, x in zip(sum(job.layer_ids, []), layers, strict=True)
        ]
    if d != 0 or mesh.cp_coord != 0:
        return None  # every replica (and every cp rank) holds the same model
    ids = sum(job.layer_ids, [])
    found = to_stage_zero(job, {i: x[None] for i, x in zip(ids, mine, strict=True)})  # (1, n_i)
    return None if found is None else [found[i][0] for i in range(config.model.n_layers + 2)]


def local_parameters(job: Job) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer i: (which full elements this rank holds, their values in float64 on the CPU)}
    for every layer of this rank (ZeRO-3's inside gathered()): to compare every rank with
    parameters_full or train_full, as `whole[i][where]`. No communication beyond gathered()."""
    found = {}
    with job.replicas.gathered():
        layers = [gpt.unwrap(x) for chunk in job.chunks for x in chunk]
        for i, layer in zip(sum(job.layer_ids, []), layers, strict=True):
            where, _ = element_numbers(job.config.model, i, job.mesh.tp_comm, _ep(job, i))
            mine = torch.cat([q.detach().double().cpu().reshape(-1) for q in layer.parameters()])
            found[i] = (where, mine)
    return found


def _ep(job: Job, i: int):
    """The comm layer i's experts are cut over: ep_comm for a block with experts, else None."""
    return (
        job.mesh.ep_comm
        if job.config.model.experts and 1 <= i <= job.config.model.n_layers
        else None
    )


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
    """Elements of layer i's full parameters."""
    return sum(q.numel() for q in gpt.layer_full(model, i, torch.float64).parameters())


def element_numbers(
    model: gpt.GPTConfig, i: int, tp_comm, ep_comm=None
) -> tuple[torch.Tensor, int]:
    """Which elements of layer i's full parameters (laid end to end, n in all) this tp rank
    (and ep rank) holds, in the order of its own parameters: cut a full layer whose
    parameters hold their own element numbers, the same way the model is cut, and read them."""
    probe = gpt.layer_full(model, i, torch.float64)
    n = 0
    with torch.no_grad():
        for q in probe.parameters():
            q.copy_(torch.arange(n, n + q.numel(), dtype=torch.float64).view_as(q))
            n += q.numel()
    cut = gpt.parallel_layer(probe, tp_comm, ep_comm).parameters()  # slicing: no communication
    return torch.cat([q.detach().reshape(-1) for q in cut]).long(), n


def flat_full(model: gpt.GPTConfig, i: int, tensors: list, tp_comm, ep_comm=None) -> torch.Tensor:
    """Layer i's whole tensors, flat (float64), from every tp (and ep) rank's slices: tensors
    are this rank's, one per parameter of its cut of layer i, in order (values, or an
    optimizer's state of the same shapes). An all_gather of the values with their element
    numbers over tp, then (a block with experts cut over ep) over ep."""
    where, n = element_numbers(model, i, tp_comm, ep_comm)
    values = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    both = torch.stack([where.to(values.device).double(), values])  # (2, n_local)
    for comm in (tp_comm, ep_comm):
        if comm is not None and comm.world_size > 1:
            every = both.new_empty(comm.world_size, *both.shape)  # (p, 2, n_local)
            comm.all_gather(every, both)
            both = every.transpose(0, 1).reshape(2, -1)  # (2, p n_local)
    both, flat = both.cpu(), torch.empty(n, dtype=torch.float64)
    flat[both[0].long()] = both[1]  # replicated ones: equal
    return flat
