"""`minidist sample`: text from a trained model, the same from any layout's checkpoint, drawn
deterministically by the documented rules; a bad checkpoint or flag is one line, exit code 2."""

from __future__ import annotations

import json

import pytest
import torch

from minidist import cli
from minidist.gpt import resume, sample

SMALL = ["--d-model", "16", "--n-heads", "4", "--d-ff", "32", "--n-layers", "2", "--seq-len", "8"]


def trained(folder, *layout: str) -> str:
    """A checkpoint folder after 3 float64 steps of `minidist train` in layout, on threads."""
    argv = ["train", "--backend", "threads", "--steps", "3", "--warmup", "1", "--batch", "8"]
    argv += ["--dtype", "float64"]
    argv += [*SMALL, *layout, "--save", str(folder), "--out", str(folder / "out")]
    assert cli.main(argv) == 0
    return str(folder)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sample")
    return {
        "dp2": trained(root / "dp2", "--dp", "2"),
        "tp2_pp2": trained(root / "tp2_pp2", "--tp", "2", "--pp", "2", "--microbatches", "2"),
    }


@pytest.mark.threads
def test_every_layouts_checkpoint_is_the_same_model_and_the_same_text(checkpoints, capsys):
    """dp=2 and tp=2 x pp=2 train the same model (float64, 1e-12): each checkpoint loads into
    the one-process model without a communicator, and both give the same text."""
    (_, a), (_, b) = (sample.from_checkpoint(path) for path in checkpoints.values())
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # float32 copies of the same
    texts = []
    for path in checkpoints.values():
        assert cli.main(["sample", "--resume", path, "--tokens", "40", "--prompt", "Thy"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    assert texts[0].startswith("Thy") and len(texts[0].encode()) >= 40


@pytest.mark.threads
def test_the_draws_follow_the_documented_rules(checkpoints):
    model, net = sample.from_checkpoint(checkpoints["dp2"])
    prompt = b"When I"

    def greedy(n: int) -> bytes:
        ids = list(prompt)
        for _ in range(n):
            logits = net(torch.tensor([ids[-model.seq_len :]]))[0, -1]
            ids.append(int(logits.argmax()))
        return bytes(ids[len(prompt) :])

    want = greedy(12)
    assert sample.generate(net, model.seq_len, prompt, 12, temperature=0) == want
    assert sample.generate(net, model.seq_len, prompt, 12, temperature=1.5, top_k=1) == want
    drawn = [sample.generate(net, model.seq_len, prompt, 30, seed=s) for s in (0, 0, 1)]
    assert drawn[0] == drawn[1] and drawn[0] != drawn[2]  # seeded: the same seed, the same text
    assert all(len(x) == 30 for x in drawn)


@pytest.mark.threads
def test_the_context_is_the_last_seq_len_bytes(checkpoints):
    """A prompt longer than seq_len is cut to its last seq_len bytes: what came before changes
    nothing (positions only go to seq_len)."""
    model, net = sample.from_checkpoint(checkpoints["dp2"])
    tail = b"abcdefgh"[: model.seq_len]
    assert sample.generate(net, model.seq_len, b"xyz" + tail, 5, temperature=0) == (
        sample.generate(net, model.seq_len, b"qq" + tail, 5, temperature=0)
    )


@pytest.mark.pure
def test_bad_checkpoints_and_flags_are_one_line(tmp_path, capsys):
    damaged = tmp_path / "step-0000001.pt"
    damaged.write_bytes(resume.MAGIC + b"0 5\nhello")
    assert cli.main(["sample", "--resume", str(damaged)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(damaged) in err[0] and "damaged" in err[0]
    assert cli.main(["sample", "--resume", str(tmp_path / "none")]) == 2
    assert "cannot read" in capsys.readouterr().err
    for flags, why in (
        (["--tokens", "0"], "--tokens 0: must be at least 1"),
        (["--temperature", "-1"], "--temperature -1.0: must be a finite number >= 0"),
        (["--top-k", "0"], "--top-k 0: must be at least 1"),
    ):
        assert cli.main(["sample", "--resume", str(damaged), *flags]) == 2
        assert why in capsys.readouterr().err


@pytest.mark.pure
def test_a_layer_of_the_wrong_size_is_refused():
    model = sample.gpt.GPTConfig(d_model=8, n_heads=2, d_ff=16, n_layers=1, seq_len=4)
    flats = [torch.zeros(3) for _ in range(model.n_layers + 2)]
    with pytest.raises(resume.CheckpointError, match="layer 0 holds 3 values where"):
        sample.load_flat(model, flats)


@pytest.mark.threads
def test_train_ends_with_the_text_its_checkpoint_gives(tmp_path, capsys):
    """`minidist train` ends with --sample bytes written by the model it trained: the same text
    as `minidist sample` on the checkpoint it saved (the same draws, seed 0)."""
    argv = ["train", "--backend", "threads", "--steps", "2", "--warmup", "1", "--batch", "4"]
    argv += [*SMALL, "--tp", "2", "--save", str(tmp_path), "--out", str(tmp_path / "out")]
    assert cli.main([*argv, "--json", "--sample", "25"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    model, net = sample.from_checkpoint(str(tmp_path))
    assert summary["sample"] == sample.text(model, net, sample.PROMPT, 25, seed=0)
    assert len(summary["sample"].encode()) >= 25
