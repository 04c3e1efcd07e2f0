"""The cut model put back together: the full parameters on world rank 0 (parameters_full),
each rank's part of them (local_parameters); a layer made full from its slices (flat_full),
and every stage's layers sent to world rank 0 (to_stage_zero). Shared by the check against one
process (reference.py, --check) and the checkpoints (resume.save). Which elements of a layer
each rank holds was recorded when the layer was cut (Job.elements, and the axes it was cut
over: Job.cut_over): nothing here builds a layer.

Communication: flat_full, an all_gather of the values with their element numbers over each
comm the layer was cut over (tp; ep for a block with experts); to_stage_zero, one pp send per
stage (tp rank 0 of replica 0).
Memory: the full model, in float64, on world rank 0 (to_stage_zero's result).
Lesson: lessons/12_3d_parallel/.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minidist.gpt import model as gpt

if TYPE_CHECKING:
    from minidist.gpt.train import Job


def layers(job: Job) -> dict[int, torch.nn.Module]:
    """{layer number: the layer} of this rank (a recomputed block with its wrapper: the same
    parameters, in the same order)."""
    found = [x for chunk in job.chunks for x in chunk]
    return dict(zip(sum(job.layer_ids, []), found, strict=True))


def cut_comms(job: Job, i: int) -> list:
    """The comms layer i was cut over, in turn (its Job.cut_over axes on the mesh)."""
    return [getattr(job.mesh, f"{axis}_comm") for axis in job.cut_over[i]]


def parameters_full(job: Job) -> list[torch.Tensor] | None:
    """The full model's parameters, flattened per layer, in float64, on world rank 0 (None
    elsewhere). Each layer is put back together over the comms it was cut over (all_gather),
    then every stage of replica 0 sends its layers to stage 0 (pp send/recv)."""
    mesh, config = job.mesh, job.config
    d, _, _ = mesh.coords
    sizes = gpt.layer_costs(config.model)
    with job.replicas.gathered():
        mine = {
            i: flat_full(sizes[i], job.elements[i], list(x.parameters()), cut_comms(job, i))
            for i, x in layers(job).items()
        }
    if d != 0 or mesh.cp_coord != 0:
        return None  # every replica (and every cp rank) holds the same model
    found = to_stage_zero(job, {i: x[None] for i, x in mine.items()})  # (1, n_i)
    return None if found is None else [found[i][0] for i in range(config.model.n_layers + 2)]


def local_parameters(job: Job) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer i: (which full elements this rank holds, their values in float64 on the CPU)}
    for every layer of this rank (ZeRO-3's inside gathered()): to compare every rank with
    parameters_full or train_full, as `full[i][where]`. No communication beyond gathered()."""
    found = {}
    with job.replicas.gathered():
        for i, layer in layers(job).items():
            mine = torch.cat([q.detach().double().cpu().reshape(-1) for q in layer.parameters()])
            found[i] = (job.elements[i], mine)
    return found


def to_stage_zero(job: Job, mine: dict[int, torch.Tensor]) -> dict[int, torch.Tensor] | None:
    """Every layer's tensor (rows, n_i), full, on world rank 0 (None elsewhere), from this
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
    numel = gpt.layer_costs(config.model)  # parameters per layer
    for other in range(1, config.pp):
        ids = sorted(sum(gpt.stage_layer_ids(config.model, config.pp, config.chunks, other), []))
        sizes = [rows * numel[i] for i in ids]
        flat = torch.empty(sum(sizes), dtype=torch.float64, device=job.device)
        flat = mesh.pp_comm.recv(flat, other).cpu()
        found.update({i: x.view(rows, -1) for i, x in zip(ids, flat.split(sizes), strict=True)})
    return found


def flat_full(n: int, elements: torch.Tensor, tensors: list, comms: list) -> torch.Tensor:
    """A layer's n full elements, flat (float64), from every rank's slices: tensors are this
    rank's, one per parameter of its cut of the layer, in order (values, or an optimizer's
    state of the same shapes), and elements which full elements they are. An all_gather of the
    values with their element numbers over each comm the layer was cut over, in turn."""
    values = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    both = torch.stack([elements.to(values.device).double(), values])  # (2, n_local)
    for comm in comms:
        if comm.world_size > 1:
            every = both.new_empty(comm.world_size, *both.shape)  # (p, 2, n_local)
            comm.all_gather(every, both)
            both = every.transpose(0, 1).reshape(2, -1)  # (2, p n_local)
    both, flat = both.cpu(), torch.empty(n, dtype=torch.float64)
    flat[both[0].long()] = both[1]  # replicated ones: equal
    return flat
