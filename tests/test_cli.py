"""Every command refuses bad input before anything starts: exit code 2, one line per reason,
no traceback, no rank started, nothing written."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from minidist import cli
from minidist.gpt import cli as train_cli
from minidist.gpt import resume
from minidist.gpt.train import TrainConfig

SCRIPTS = Path(__file__).parent / "scripts"
RING = str(SCRIPTS / "ring.py")

BAD = [  # (argv, a piece of the one line that must say why)
    ("run -n 0 RING", "-n 0: must be at least 1"),
    ("run -n 2 /no/such/script.py", "/no/such/script.py: no such script"),
    ("bench allreduce -n 0", "-n 0: must be at least 1"),
    ("bench allreduce --iters -3", "--iters -3: must be at least 1"),
    ("bench p2p -n 1", "bench p2p needs at least 2 ranks"),
    ("bench allreduce --min-bytes 4096 --max-bytes 16", "--min-bytes 4096 is more than"),
    ("bench dp --steps 0", "--steps 0: must be at least 1"),
    ("bench dp --rounds 0", "--rounds 0: must be at least 1"),
    ("bench zero -n 2 0", "-n 0: must be at least 1"),
    ("bench sgd --chance 2", "--chance 2.0: a probability"),
    ("bench sgd --lr nan", "--lr nan: must be a finite number > 0"),
    ("bench moe -n 3 --experts 4", "--experts 4 must be a multiple of -n 3 and at least --k 1"),
    ("bench moe --cf 0", "--cf 0.0: must be a finite number > 0"),
    ("bench cp --seq 256 --head-dim 32", "--head-dim 32 equals a chunk's m = T/c for T in [256]"),
    ("bench cp --seq 0", "--seq 0: must be at least 1"),
    ("bench tp --d-model 15 --heads 2", "--d-model 15 is not divisible by --heads 2"),
    ("bench pipeline --microbatches 1,,4", "--microbatches 1,,4: counts of at least 1"),
    ("bench pipeline --microbatches 0", "--microbatches 0: counts of at least 1"),
    ("bench sgd --rows 10 --batch 4", "--rows 10 per worker is not divisible by --batch 4"),
    ("bench batch --base-batch 15", "--base-batch 15 is not divisible by -n 2"),
    ("bench batch --micro 3", "is not divisible by --micro 3"),
    ("bench batch --eval-every 100", "--eval-every 100 is not a multiple of the large batch 128"),
    ("bench batch --warmup 1000", "--warmup 1000 is more than the large runs' 128 steps"),
    ("bench allreduce -n 2 --max-bytes 1000G", "GiB are free"),
    ("run -n 100000 --backend threads RING", "-n 100000: threads runs at most 256 ranks"),
    ("train --dp 4 --pp 100 --batch 400", "--dp x --pp x --tp x --cp 400: mpi runs at most"),
    ("schedule --stages 0", "--stages 0: must be at least 1"),
    ("schedule --stages -1", "--stages -1: must be at least 1"),
    ("schedule --microbatches 0", "--microbatches 0: must be at least 1"),
    ("schedule --schedule interleaved --chunks 0", "--chunks 0: must be at least 1"),
    ("schedule --chunks 2", "--chunks 2 needs --schedule interleaved (not 1f1b)"),
    ("schedule --png /no/such/folder/x.png", "no folder /no/such/folder"),
    ("train --dp 0", "--dp 0: must be at least 1"),
    ("train --tp 0", "--tp 0: must be at least 1"),
    ("train --microbatches 0", "--microbatches 0: must be at least 1"),
    ("train --n-heads 0", "--n-heads 0: must be at least 1"),
    ("train --chunks 0", "--chunks 0: must be at least 1"),
    ("train --batch 0", "--batch 0: must be at least 1"),
    ("train --batch -16", "--batch -16: must be at least 1"),
    ("train --lr -1", "--lr -1.0: must be a finite number > 0"),
    ("train --lr nan", "--lr nan: must be a finite number > 0"),
    ("train --d-model 0", "--d-model 0: must be at least 1"),
    ("train --seq-len 0", "--seq-len 0: must be at least 1"),
    ("train --seq-len 200000", "seq_len=200000: the text has"),
    ("train --save-every -3", "--save-every -3: must be at least 0"),
    ("train --stop-at -1", "--stop-at -1: must be at least 0"),
    ("train --stop-at 61", "--stop-at 61 is beyond --steps 60"),
    ("train --steps 3", "steps=3 is below the warm-up of 5 steps: raise --steps or lower --warmup"),
    ("train --tp 3", "d_ff=256 is not divisible by tp=3"),
    ("train --resume /no/such.pt", "--resume /no/such.pt: cannot read"),
]


def _argv(line: str) -> list[str]:
    return [RING if word == "RING" else word for word in line.split()]


@pytest.mark.pure
@pytest.mark.parametrize("line,why", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_before_anything_starts(line, why, capsys, monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError(f"{line}: ranks were started")

    for module in ("minidist.cli", "minidist.launch.launcher"):  # minidist run; start_ranks
        monkeypatch.setattr(f"{module}.launch", started)
        monkeypatch.setattr(f"{module}.run_threads", started)
    assert cli.main(_argv(line)) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert any(why in x for x in lines), err
    assert all(x.startswith(f"minidist {line.split()[0]}: ") for x in lines), err
    assert "Traceback" not in err


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.pure
def test_files_and_checkpoints_are_checked_in_the_parent(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x80\x04not a pickle")
    other = tmp_path / "other"
    other.mkdir()
    config = TrainConfig(steps=60, batch=16, lr=3e-3, warmup=5, seed=0)
    crafted = tmp_path / "crafted.pt"  # a valid header over a pickle that runs code
    resume._write_atomically(str(crafted), {"config": {}, "run": print})
    cases = [
        (f"--out {a_file}", f"--out {a_file}: a file, not a folder"),
        (f"--save {a_file}", f"--save {a_file}: a file, not a folder"),
        (f"--resume {garbage}", f"--resume {garbage}: not a minidist checkpoint (no header)"),
        (f"--resume {crafted}", f"--resume {crafted}: not a minidist checkpoint: its contents"),
        (f"--resume {other}", f"--resume {other}: no checkpoint"),
    ]
    before = _files(tmp_path)
    for flags, why in cases:
        assert cli.main(["train", *flags.split()]) == 2, flags
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert _files(tmp_path) == before  # nothing written
    # another model's checkpoint: the file and every differing field named
    payload = {"config": asdict(config)}
    payload["config"]["model"] = dict(payload["config"]["model"], d_model=32, n_layers=2)
    payload["config"]["lr"] = 1.0
    resume._write_atomically(str(other / "step-0000005.pt"), payload)
    assert cli.main(["train", "--resume", str(other)]) == 2
    err = capsys.readouterr().err
    name = other / "step-0000005.pt"
    for field in ("model d_model=32 there, 64 here", "model n_layers=2 there, 4 here", "lr=1.0"):
        assert f"minidist train: --resume {name}: {field}" in err, err


@pytest.mark.pure
def test_a_killed_save_leaves_nothing_at_the_next(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    stale = tmp_path / f"step-0000003.pt.tmp{dead}"
    stale.write_bytes(b"half a checkpoint")
    mine = tmp_path / f"step-0000004.pt.tmp{os.getpid()}"  # a save in progress: kept
    mine.write_bytes(b"")
    resume._write_atomically(str(tmp_path / "step-0000005.pt"), {"config": {}})
    assert sorted(p.name for p in tmp_path.iterdir()) == [mine.name, "step-0000005.pt"]


@pytest.mark.processes
def test_the_commands_refuse_bad_input_as_processes(tmp_path):
    """The same through real processes: rc 2, one line, no traceback, nothing written (the
    launcher's folder would be under TMPDIR)."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    for line in ("run -n 0 RING", "train --seq-len 0", "schedule --stages 0"):
        cmd = [sys.executable, "-m", "minidist.cli", *_argv(line)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.pure
def test_nccl_without_a_gpu_is_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: nccl can start")
    assert cli.main(["run", "-n", "2", "--backend", "nccl", RING]) == 2
    assert capsys.readouterr().err == (
        "minidist run: --backend nccl needs a CUDA GPU, and torch sees none: use gloo or mpi\n"
    )


BENCHES = ["allreduce", "p2p", "dp", "tp", "pipeline", "zero", "sgd", "batch", "moe", "cp"]


@pytest.mark.pure
@pytest.mark.parametrize("what", BENCHES)
def test_every_benchmark_refuses_no_ranks_and_too_many_ranks_in_one_line(what, capsys, monkeypatch):
    """-n 0, and more ranks than this machine runs (cli.most_ranks: 256 threads, 4 processes per
    core): one line, exit 2, no rank started; the defaults have no problem."""
    monkeypatch.setattr("minidist.launch.launcher.launch", None)  # a rank started: TypeError
    monkeypatch.setattr("minidist.launch.launcher.run_threads", None)
    most = cli.most_ranks("mpi")[0]
    cases = [("0", "threads", "-n 0: must be at least 1")]
    cases += [("100000", "threads", "-n 100000: threads runs at most 256 ranks on this machine")]
    cases += [(str(most + 1), "mpi", f"-n {most + 1}: mpi runs at most {most} ranks")]
    for n, backend, why in cases:
        extra = ["2", n] if what == "zero" else [n]  # zero: a list of world sizes
        assert cli.main(["bench", what, "-n", *extra, "--backend", backend]) == 2, (what, n)
        err = capsys.readouterr().err
        assert err.startswith(f"minidist bench: {why}") and err.count("\n") == 1, err
    parser = argparse.ArgumentParser()
    cli._add_bench(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", what])
    assert cli.numeric_problems(args) + cli.command_problems(args) == []


@pytest.mark.pure
def test_the_default_run_has_no_problems():
    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train"])
    assert cli.numeric_problems(args) == [] and train_cli.problems(args, []) == []


@pytest.mark.threads
def test_a_diverging_run_fails_with_a_message(tmp_path):
    """A nan loss ends the run on every rank (the loss is the same on all) instead of training
    on to rc 0 with nan parameters."""
    flags = "--lr 1e30 --steps 4 --warmup 1 --d-model 8 --n-heads 2 --d-ff 8 --n-layers 1"
    flags += f" --seq-len 8 --batch 2 --microbatches 1 --json --out {tmp_path}"
    with pytest.raises(FloatingPointError, match=r"step \d: the loss is nan: training diverged"):
        train_cli.rank_main(flags.split())


@pytest.mark.pure
def test_the_progress_bar_is_for_a_terminal(monkeypatch):
    """A log gets no line of carriage returns: the parent tells the ranks whether its stderr is
    a terminal (MINIDIST_PROGRESS); by hand (mpiexec, nothing set) the bar shows."""
    config = TrainConfig(steps=3)
    monkeypatch.setenv("MINIDIST_PROGRESS", "0")
    assert train_cli._progress(config, True, 0) is None
    for value in ("1", None):
        if value is None:
            monkeypatch.delenv("MINIDIST_PROGRESS")
        else:
            monkeypatch.setenv("MINIDIST_PROGRESS", value)
        bar = train_cli._progress(config, True, 0)
        assert bar is not None and bar.total == 3
        bar.close()
    assert train_cli._progress(config, False, 0) is None  # not rank 0, or --json


def _parsers(parser: argparse.ArgumentParser):
    """parser and every subcommand's parser below it, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


@pytest.mark.pure
def test_help_shows_every_default():
    """`minidist X --help` names each option's default (switches that are off, and options
    whose default is None, have nothing to show)."""
    missing = []
    for parser in _parsers(cli.build_parser()):
        text = " ".join(parser.format_help().split())  # argparse wraps lines anywhere
        for action in parser._actions:
            note = cli.default_note(action)
            if note and " ".join(note.split()) not in text:
                missing.append(f"{parser.prog} {action.option_strings[0]}: {note}")
    assert not missing, "\n".join(missing)
