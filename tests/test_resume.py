"""Checkpoints of the main job: resume equals the uninterrupted run (bitwise in the same layout,
float64 1e-12 in another: re-sharding), damaged files are refused by name, a crash mid-save
leaves the previous checkpoint whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from minidist.gpt import model as gpt
from minidist.gpt import resume
from minidist.gpt.gather import local_parameters, parameters_full
from minidist.gpt.reference import train_full
from minidist.gpt.train import TrainConfig, build_job, train_step
from minidist.testing import check_all, run_ranks, run_threads

TINY = gpt.GPTConfig(seq_len=8, d_model=16, n_heads=4, d_ff=32, n_layers=2)


def run(comm, config: TrainConfig, until: int, save: str | None = None, start: str | None = None):
    """Train to step `until` (from a checkpoint if start), saving there if save: (losses,
    the full parameters on rank 0, this rank's own elements of them)."""
    job = build_job(comm, config)
    if start is not None:
        resume.restore(job, resume.load(start))
    losses = []
    while job.step < until:
        losses.append(train_step(job)[0])
    if save is not None:
        resume.save(job, save)
    return losses, parameters_full(job), local_parameters(job)


def interrupted_and_resumed(tmp_path, before: dict, after: dict, precision: dict) -> tuple:
    """(the uninterrupted run's losses and full parameters, every rank of the resumed run's
    (losses, own elements))."""
    a = TrainConfig(steps=5, batch=8, warmup=1, model=TINY, **precision, **before)
    b = TrainConfig(steps=5, batch=8, warmup=1, model=TINY, **precision, **after)
    path = str(tmp_path / "step-0000002.pt")
    losses, whole, _ = run_threads(run, a.layout.world_size, a, 5)[0]
    run_threads(run, a.layout.world_size, a, 2, path)
    resumed = run_threads(run, b.layout.world_size, b, 5, None, path)
    return (losses, whole), [(again, local) for again, _, local in resumed]


def compare_every_rank(whole: list, ranks: list, atol: float) -> None:
    """Every element each rank of the resumed run holds, against the uninterrupted run."""
    for r, (_, local) in enumerate(ranks):
        for i, (where, mine) in local.items():
            worst = (mine - whole[i][where]).abs().max().item()
            assert worst <= atol, f"rank {r}, layer {i}: differs by {worst:.3g} > {atol:g}"


@pytest.mark.threads
@pytest.mark.parametrize(
    "layout,precision",
    [(dict(dp=2, pp=2, tp=2, microbatches=2), dict(dtype="float64")),
     (dict(dp=2, zero=3, tp=2), dict(dtype="float64")),
     (dict(dp=2, zero=2, pp=2, microbatches=2), dict(amp="fp16")),
     (dict(dp=2, tp=2), dict(amp="bf16"))],
)  # fmt: skip
def test_resume_in_the_same_layout_is_bitwise_the_uninterrupted_run(tmp_path, layout, precision):
    (losses, whole), ranks = interrupted_and_resumed(tmp_path, layout, layout, precision)
    for again, _ in ranks:
        assert again == losses[2:]  # the same floats: same layout, same order of every sum
    compare_every_rank(whole, ranks, atol=0)


@pytest.mark.threads
@pytest.mark.parametrize(
    "before,after",
    [(dict(dp=2, pp=2, tp=2, microbatches=2), dict(tp=4)),
     (dict(dp=2, zero=3, tp=2), dict(dp=4, zero=1)),
     (dict(pp=4, microbatches=4, schedule="gpipe"), dict(dp=2, pp=2, zero=2, microbatches=2))],
)  # fmt: skip
def test_resume_in_another_layout_reshards(tmp_path, before, after):
    """float64: losses 1e-12 relative, parameters 1e-10 absolute (test_train.py says why)."""
    (losses, whole), ranks = interrupted_and_resumed(tmp_path, before, after, dict(dtype="float64"))
    for again, _ in ranks:
        torch.testing.assert_close(
            torch.tensor(again), torch.tensor(losses[2:]), rtol=1e-12, atol=0
        )
    compare_every_rank(whole, ranks, atol=1e-10)


def resumed_in_another_layout_in_ranks(comm, folder: str) -> None:
    """World 4: train 2 steps as dp=2 x tp=2 with ZeRO-3, save; resume as dp=2 x pp=2 with
    ZeRO-2 and train to step 5. Every rank compares its losses and its own elements with one
    process (the recipe: each computes train_full itself), as test_train does."""
    torch.set_num_threads(1)  # this rank's own process: one core each
    common = dict(steps=5, batch=8, warmup=1, model=TINY, dtype="float64")
    before = TrainConfig(dp=2, tp=2, zero=3, **common)
    after = TrainConfig(dp=2, pp=2, zero=2, microbatches=2, **common)
    path = resume.step_path(folder, 2)
    job = build_job(comm, before)
    while job.step < 2:
        train_step(job)
    resume.save(job, path)
    job = build_job(comm, after)
    resume.restore(job, resume.load(path))
    losses = [train_step(job)[0] for _ in range(3)]
    reference = train_full(after)
    context = f"resumed at step 2 as {after.layout}"
    expected = torch.tensor(reference["losses"][2:], dtype=torch.float64)
    check_all(
        comm,
        {"losses": (torch.tensor(losses, dtype=torch.float64), expected)},
        rtol=1e-12,
        context=context,
    )
    pairs = {
        f"layer {i} parameters": (mine, reference["parameters"][i][where])
        for i, (where, mine) in local_parameters(job).items()
    }
    check_all(comm, pairs, atol=1e-10, context=context)


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_resume_in_another_layout_processes(tmp_path, backend):
    """Save and re-shard over real processes: every rank checked against one process."""
    run_ranks(resumed_in_another_layout_in_ranks, 4, backend, str(tmp_path), timeout=180)


def two_checkpoints(tmp_path) -> list[str]:
    config = TrainConfig(dp=2, steps=4, batch=4, warmup=1, model=TINY)
    paths = [resume.step_path(str(tmp_path), k) for k in (1, 2)]

    def save_twice(comm):
        job = build_job(comm, config)
        for path in paths:
            train_step(job)
            resume.save(job, path)

    run_threads(save_twice, 2)
    return paths


@pytest.mark.threads
def test_damaged_checkpoints_are_refused_by_name_and_the_previous_one_loads(tmp_path):
    older, newer = two_checkpoints(tmp_path)
    assert resume.checkpoints(str(tmp_path)) == [older, newer]
    raw = open(newer, "rb").read()
    with open(newer, "wb") as f:
        f.write(raw[: len(raw) // 2])  # truncated, as by a full disk or a copy cut short
    with pytest.raises(resume.CheckpointError, match="truncated"):
        resume.load(newer)
    with pytest.raises(resume.CheckpointError, match=f"newest intact one is {older}"):
        resume.load_latest(str(tmp_path))
    assert resume.load(older)["step"] == 1
    with open(newer, "wb") as f:
        f.write(raw[:-1] + bytes([raw[-1] ^ 1]))  # one bit flipped
    with pytest.raises(resume.CheckpointError, match="damaged"):
        resume.load(newer)
    with open(newer, "wb") as f:
        f.write(b"hello")
    with pytest.raises(resume.CheckpointError, match="not a minidist checkpoint"):
        resume.load(newer)


@pytest.mark.threads
def test_a_crash_mid_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    older, newer = two_checkpoints(tmp_path)
    before = open(newer, "rb").read()

    def crash(fd):
        raise OSError("the machine went down")

    monkeypatch.setattr(os, "fsync", crash)  # dies after writing, before the rename
    config = TrainConfig(dp=2, steps=4, batch=4, warmup=1, model=TINY)

    def save_again(comm):
        job = build_job(comm, config)
        train_step(job)
        if comm.rank == 0:
            with pytest.raises(OSError, match="went down"):
                resume.save(job, newer)
        else:
            resume.save(job, newer)

    run_threads(save_again, 2)
    assert open(newer, "rb").read() == before  # untouched
    assert sorted(os.listdir(tmp_path)) == ["step-0000001.pt", "step-0000002.pt"]  # no leftovers
    resume.load(newer)


@pytest.mark.threads
def test_a_checkpoint_of_another_model_or_run_is_refused(tmp_path):
    _, newer = two_checkpoints(tmp_path)
    payload = resume.load(newer)

    def restore_into(comm, config):
        resume.restore(build_job(comm, config), payload)

    other_model = TrainConfig(steps=4, batch=4, warmup=1, model=gpt.GPTConfig(n_layers=1))
    with pytest.raises(Exception, match="model n_layers=.* there, 1 here"):
        run_threads(restore_into, 1, other_model)
    other_run = TrainConfig(steps=9, batch=4, warmup=1, model=TINY)
    with pytest.raises(Exception, match="steps=4 there, 9 here"):
        run_threads(restore_into, 1, other_run)
    other_decay = TrainConfig(steps=4, batch=4, warmup=1, weight_decay=0.0, model=TINY)
    with pytest.raises(Exception, match="weight_decay=0.1 there, 0.0 here"):
        run_threads(restore_into, 1, other_decay)
    del payload["config"]["weight_decay"]  # a checkpoint from before the flag: decay everywhere
    with pytest.raises(Exception, match="weight_decay=None there, 0.1 here"):
        run_threads(restore_into, 1, TrainConfig(steps=4, batch=4, warmup=1, model=TINY))


@pytest.mark.processes
def test_cli_interrupted_then_resumed_in_another_layout_matches_one_process(tmp_path):
    """minidist train over gloo: stop at step 3 with a checkpoint (dp=2), resume it as tp=2
    (every weight re-sliced) with --check: losses and parameters equal one process's full run;
    --weight-decay reaches every rank, the one process and the checkpoint."""
    common = [
        "--steps",
        "6",
        "--batch",
        "8",
        "--dtype",
        "float64",
        "--d-model",
        "16",
        "--weight-decay",
        "0.2",
        "--seq-len",
        "8",
        "--d-ff",
        "32",
        "--n-layers",
        "2",
        "--backend",
        "gloo",
        "--out",
        str(tmp_path / "out"),
    ]
    cli = [sys.executable, "-m", "minidist.cli", "train", *common]
    first = subprocess.run(
        cli + ["--dp", "2", "--stop-at", "3", "--save", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert first.returncode == 0, first.stderr
    assert resume.checkpoints(str(tmp_path)) == [str(tmp_path / "step-0000003.pt")]
    assert resume.load(str(tmp_path / "step-0000003.pt"))["config"]["weight_decay"] == 0.2
    second = subprocess.run(
        cli + ["--tp", "2", "--microbatches", "2", "--resume", str(tmp_path), "--check", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["first_step"] == 3 and len(summary["losses"]) == 3
    assert len(summary["step_seconds"]) == len(summary["step_cpu_seconds"]) == 3  # its steps
    assert summary["check"]["ok"], summary["check"]
