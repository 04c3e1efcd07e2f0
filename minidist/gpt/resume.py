"""Checkpoints of the main job: save, resume exactly, and load into another dp x pp x tp layout.

Equals: a run saved at step k and resumed equals the uninterrupted run: the same losses and
parameters (bitwise in the same layout; in another layout, as any two layouts agree: float64
1e-12). The batches depend only on (seed, step), so the data needs no state.
Communication (save, once): per layer, an all_gather over tp of the values and the optimizer
state with their element numbers (gather.flat_full); each stage of replica 0 sends its
layers to stage 0 (pp); ZeRO first consolidates over dp (zero_state.consolidate). Load: none, but
ZeRO's load_state_dict (rank 0 of dp sends each rank its pieces).
Memory: the full model and its optimizer state, in float64, on world rank 0 while saving.
Lesson: lessons/12_3d_parallel/.   Run: minidist train ... --save DIR, then --resume DIR

What a file holds: the layout-free state (each layer's full parameters, AdamW's exp_avg and
exp_avg_sq, flat in float64, which holds float32 exactly; AdamW's step; the loss scaler's and
the learning-rate schedule's state; the step; the config). Each rank takes its own slices when
it loads (Job.elements: which full elements it holds, recorded when the model was cut, so no
layer is built again), so any layout can load any checkpoint of the same model.
On disk: a header line with a SHA-256 of the rest, then torch.save's bytes. Written to a
temporary file in the same folder, flushed to disk, then renamed over the final name: a crash
mid-save leaves the previous checkpoint whole (its temporary file is swept at the next save),
and a damaged file is refused by name.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from dataclasses import asdict

import torch

from minidist.gpt import model as gpt
from minidist.gpt.gather import cut_comms, flat_full, to_stage_zero
from minidist.gpt.train import Job
from minidist.replicas import MOMENTS

MAGIC = b"minidist-checkpoint 1 sha256="
KEYS = ("value", *MOMENTS)  # per parameter element, in this order
SAME_RUN = ("steps", "batch", "lr", "weight_decay", "warmup", "seed")  # a resumed run keeps these


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: damaged, truncated, or for another model."""


def step_path(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step:07d}.pt")


def checkpoints(folder: str) -> list[str]:
    """The checkpoint files in folder, oldest step first."""
    if not os.path.isdir(folder):
        return []
    names = sorted(n for n in os.listdir(folder) if re.fullmatch(r"step-\d{7}\.pt", n))
    return [os.path.join(folder, n) for n in names]


# ---- the state of one rank, by parameter name of the replicas' module ------------------------


def _layers_with_names(job: Job):
    """(layer number, the layer, its parameters' names in the replicas' module)."""
    ids = iter(sum(job.layer_ids, []))
    for c, chunk in enumerate(job.chunks):
        for j, layer in enumerate(chunk):
            yield next(ids), layer, [f"{c}.{j}.{n}" for n, _ in layer.named_parameters()]


# ---- save ------------------------------------------------------------------------------------


def save(job: Job, path: str) -> None:
    """Write job's state to path (collective: every rank calls; world rank 0 writes)."""
    config = job.config
    local = job.replicas.state()  # collective over dp for ZeRO
    if local is None or job.mesh.grad_comm.rank != 0:
        return  # not replica 0: every replica holds the same
    state, adam_step, scaler = local
    sizes, mine = gpt.layer_costs(config.model), {}
    for i, layer, names in _layers_with_names(job):
        rows = []
        for key in KEYS:
            tensors = [
                _or_zeros(state[n][key], q) for n, q in zip(names, layer.parameters(), strict=True)
            ]
            rows.append(flat_full(sizes[i], job.elements[i], tensors, cut_comms(job, i)))
        mine[i] = torch.stack(rows)  # (3, n_i)
    mine = to_stage_zero(job, mine)  # over pp, to world rank 0
    if mine is None:
        return
    payload = {
        "config": asdict(config),
        "step": job.step,
        "adam_step": adam_step,
        "scaler": scaler,
        "schedule": job.schedule.state_dict(),
        "layers": {i: dict(zip(KEYS, mine[i], strict=True)) for i in sorted(mine)},
    }
    _write_atomically(path, payload)


def _or_zeros(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Optimizer state not made yet (before the first step) is zeros, as AdamW starts it."""
    return torch.zeros_like(like, dtype=torch.float64) if t is None else t.to(like.device)


def _write_atomically(path: str, payload: dict) -> None:
    """Header + bytes into a temporary file beside path, fsync, rename over path."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    header = MAGIC + hashlib.sha256(data).hexdigest().encode() + f" {len(data)}\n".encode()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sweep(os.path.dirname(os.path.abspath(path)))  # what a killed save left behind
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header + data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
        os.replace(tmp, path)  # atomic: readers see the old file or the new, never half
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---- load ------------------------------------------------------------------------------------


def load(path: str) -> dict:
    """The payload of a checkpoint file, verified; a CheckpointError naming the file if it is
    missing, truncated or damaged."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    head, _, data = raw.partition(b"\n")
    if not head.startswith(MAGIC):
        raise CheckpointError(f"{path}: not a minidist checkpoint (no header)")
    digest, _, size = head[len(MAGIC) :].decode(errors="replace").partition(" ")
    if not size.isdigit() or len(data) != int(size):
        raise CheckpointError(f"{path}: truncated: {len(data)} bytes of {size or '?'}")
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"{path}: damaged: its SHA-256 does not match its header")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # a crafted or foreign pickle behind a valid header
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(
            f"{path}: not a minidist checkpoint: its contents cannot be "
            f"loaded safely ({type(e).__name__}: {first})"
        ) from e


def load_latest(folder: str) -> tuple[str, dict]:
    """(path, payload) of the newest checkpoint in folder; if it is damaged, the error also
    names the newest intact one, to resume from explicitly."""
    found = checkpoints(folder)
    if not found:
        raise CheckpointError(f"{folder}: no checkpoint (step-NNNNNNN.pt) in it")
    try:
        return found[-1], load(found[-1])
    except CheckpointError as e:
        for older in reversed(found[:-1]):
            try:
                load(older)
            except CheckpointError:
                continue
            raise CheckpointError(f"{e}; the newest intact one is {older}") from e
        raise


def load_any(path: str) -> tuple[str, dict]:
    """(path, payload): path a checkpoint file, or a folder (its newest checkpoint)."""
    return load_latest(path) if os.path.isdir(path) else (path, load(path))


def differences(saved: dict, now: dict) -> list[str]:
    """The fields (as asdict(TrainConfig)) in which a checkpoint's run and this one differ
    where they must not: the model's shape, and SAME_RUN. The layout may change (that is
    re-sharding)."""
    model = [
        f"model {k}={v!r} there, {now['model'].get(k)!r} here"
        for k, v in saved["model"].items()
        if now["model"].get(k) != v
    ]
    return model + [
        f"{k}={saved.get(k)!r} there, {now[k]!r} here" for k in SAME_RUN if saved.get(k) != now[k]
    ]


def problems(path: str, config) -> list[str]:
    """Why the checkpoint at path (a file, or a folder: its newest) cannot continue a run of
    config (a TrainConfig), each naming the file; [] if it can. The parent reads it once
    before any rank starts."""
    try:
        found, payload = load_any(path)
    except CheckpointError as e:
        return [str(e)]
    if not isinstance(payload, dict) or not isinstance(payload.get("config"), dict):
        return [f"{found}: not a minidist checkpoint (no config in it)"]
    return [f"{found}: {why}" for why in differences(payload["config"], asdict(config))]


def sweep(folder: str) -> list[str]:
    """Remove the temporary files of saves that were killed (step-*.pt.tmpPID of a process
    that is gone) from folder; the paths removed."""
    removed = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        match = re.fullmatch(r"step-\d{7}\.pt\.tmp(\d+)", name)
        if match and not _alive(int(match.group(1))):
            removed.append(os.path.join(folder, name))
            os.remove(removed[-1])
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def restore(job: Job, payload: dict) -> None:
    """Put a loaded state into a freshly built job of any layout (the same model): every rank
    takes its slices; collective over dp for ZeRO."""
    changed = differences(payload["config"], asdict(job.config))
    if changed:
        raise CheckpointError("the checkpoint cannot continue this run: " + "; ".join(changed))
    mine: dict[str, dict[str, torch.Tensor]] = {}
    for i, layer, names in _layers_with_names(job):
        sizes = [q.numel() for q in layer.parameters()]
        for key in KEYS:
            cut = payload["layers"][i][key][job.elements[i]].split(sizes)
            for name, q, x in zip(names, layer.parameters(), cut, strict=True):
                mine.setdefault(name, {})[key] = x.view(q.shape)
    job.replicas.load(mine, payload["adam_step"], payload["scaler"])
    job.schedule.load_state_dict(payload["schedule"])
    job.step = payload["step"]
