"""`minidist bench`: smoke tests on threads, and the raw library's column over mpi and gloo
processes (tiny sizes); speed is never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from minidist.cli import main

COLUMNS = ("time_us", "algbw", "busbw")


@pytest.mark.threads
def test_bench_allreduce_json_has_every_column(capsys):
    argv = ["bench", "allreduce", "-n", "3", "--backend", "threads", "--max-bytes", "4K"]
    assert main([*argv, "--iters", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["bench"], report["world_size"], report["dtype"]) == ("allreduce", 3, "float32")
    assert [row["nbytes"] for row in report["rows"]] == [1024, 4096]  # 1K, then 4x
    for row in report["rows"]:
        assert row["raw"] is None and row["ratio_vs"] == "library"  # no library under threads
        check_allreduce_row(row, 3)


def check_allreduce_row(row: dict, p: int) -> None:
    """Every column positive, busbw from algbw, the ratio from the columns it names."""
    for name in ("library", "naive", "recursive_doubling", "ring", "auto"):
        assert all(row[name][c] > 0 for c in COLUMNS), (name, row[name])
        bus_over_alg = row[name]["busbw"] / row[name]["algbw"]
        assert bus_over_alg == pytest.approx(2 * (p - 1) / p)  # busbw = algbw 2(p-1)/p
    best = min(("naive", "recursive_doubling", "ring", "auto"), key=lambda a: row[a]["time_us"])
    assert row["best"] == best
    ratio = row[row["ratio_vs"]]["time_us"] / row[best]["time_us"]
    assert row["ratio"] == pytest.approx(ratio)


def report(out: str) -> dict:
    """The JSON object rank 0 printed: the one line that holds it (the launcher passes on any
    other line a rank or the MPI library writes)."""
    lines = [line for line in out.splitlines() if line.startswith('{"bench"')]
    assert len(lines) == 1, f"expected one JSON line, got:\n{out}"
    return json.loads(lines[0])


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_bench_raw_library_column(backend, capfd):
    """The raw library (mpi4py's COMM_WORLD, torch.distributed's default group) in the same run:
    present and positive in both tables; each ratio computed from its columns."""
    argv = ["bench", "allreduce", "-n", "2", "--backend", backend, "--max-bytes", "1K"]
    assert main([*argv, "--iters", "2", "--json"]) == 0
    (row,) = report(capfd.readouterr().out)["rows"]
    assert row["ratio_vs"] == "raw" and all(row["raw"][c] > 0 for c in COLUMNS), row["raw"]
    check_allreduce_row(row, 2)
    argv[1] = "p2p"
    assert main([*argv, "--iters", "2", "--json"]) == 0
    (row,) = report(capfd.readouterr().out)["rows"]
    assert row["raw"]["time_us"] > 0 and row["raw"]["bw"] > 0, row
    assert row["ratio"] == pytest.approx(row["raw"]["time_us"] / row["time_us"])


@pytest.mark.threads
def test_bench_p2p_and_the_table(capsys):
    argv = ["bench", "p2p", "-n", "2", "--backend", "threads", "--max-bytes", "1K", "--iters", "2"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["nbytes"] for r in rows] == [1024] and rows[0]["time_us"] > 0 and rows[0]["bw"] > 0
    assert rows[0]["raw"] is None and rows[0]["ratio"] is None  # no library under threads
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "one-way(us)" in table and "raw(us)" in table and "1024" in table


@pytest.mark.pure
def test_gpu_check_skips_cleanly_without_a_gpu():
    """make gpu-check on a machine without CUDA: one line, exit 0."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    tool = os.path.join(root, "tools", "gpu_check.py")
    done = subprocess.run([sys.executable, tool], env=env, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "no GPU: skipped\n"), done.stderr


@pytest.mark.threads
def test_bench_moe_bytes_equal_the_formulas_and_drops_follow_capacity(capsys):
    """Tiny, on threads: every dispatch row's bytes equal (N - n_rr) D b, the MoE step's equal
    step_nbytes on every rank, and fewer assignments drop as the capacity factor grows."""
    argv = ["bench", "moe", "-n", "2", "--backend", "threads", "--tokens", "16", "32"]
    argv += ["--d-model", "8", "--experts", "4", "--cf", "0.5", "1", "2", "--trials", "4"]
    assert main([*argv, "--iters", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in got["dispatch"]] == [16, 32]
    for row in got["dispatch"]:
        assert row["sent"] == row["formula"] and row["sent_ok"] and row["same"], row
        assert row["library_us"] is None and row["hand_us"] > 0  # no library under threads
    assert got["step"]["sent"] == got["step"]["formula"] and got["step"]["sent_ok"], got["step"]
    drops = got["drops"]
    assert [d["capacity"] for d in drops] == [2, 4, 8]  # ceil(cf k n / E), n = 16, k = 1, E = 4
    assert [d["balanced"] for d in drops] == [0.5, 0.0, 0.0]
    for kind in ("uniform", "uniform_formula", "router"):
        assert [d[kind] for d in drops] == sorted((d[kind] for d in drops), reverse=True), kind


@pytest.mark.pure
def test_uniform_drop_formula_equals_enumerating_every_routing():
    """E E[(X - C)+] / (k n), X ~ Binomial(n, k/E), against all E^n routings of n tokens (k = 1)."""
    import itertools

    from minidist.expert_parallel.bench import uniform_drop

    n, e = 5, 3
    for cap in range(n + 1):
        total = 0
        for choice in itertools.product(range(e), repeat=n):
            total += sum(max(0, choice.count(x) - cap) for x in range(e))
        assert uniform_drop(n, 1, e, cap) == pytest.approx(total / e**n / n), cap


@pytest.mark.threads
def test_bench_cp_bytes_and_memory_equal_the_formulas(capsys):
    """Tiny, on threads: bytes sent, saved tensors and the peak in flight (k|v blocks, scores)
    equal the formulas on every rank, and the saved bytes fall as 1/cp."""
    argv = ["bench", "cp", "-n", "2", "--backend", "threads", "--seq", "8", "--batch", "1"]
    assert main([*argv, "--heads", "2", "--head-dim", "3", "--steps", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["cp"], r["layout"]) for r in rows] == [
        (1, "full"), (1, "plain"), (1, "zigzag"), (2, "plain"), (2, "zigzag")
    ]  # fmt: skip
    for row in rows[1:]:
        for key in ("fwd", "bwd", "saved", "kv", "scores"):
            assert row[key] == row[f"{key}_formula"], (key, row)
        assert row["exact"] and row["work"] == pytest.approx(row["work_formula"]), row
    assert rows[3]["saved"] * 2 == rows[1]["saved"]  # 1/cp
    assert rows[0]["scores"] >= 2 * (1 * 2 * 8 * 8 * 4)  # full: two (B, H, T, T) float32 or more


@pytest.mark.processes
def test_bench_moe_library_all_to_all(capfd):
    """MPI_Alltoallv, its counts and displacements in elements, delivers the rows the
    hand-written all-to-all does (the bench checks it every row). Gloo's all_to_all_single
    takes the row counts as they are; mpi only, to keep the process tier cheap."""
    argv = ["bench", "moe", "-n", "2", "--backend", "mpi", "--tokens", "8", "--d-model", "4"]
    argv += ["--experts", "2", "--cf", "1", "--trials", "1", "--iters", "1", "--json"]
    assert main(argv) == 0
    got = report(capfd.readouterr().out)
    (row,) = got["dispatch"]
    assert row["same"] and row["library_us"] > 0 and row["sent"] == row["formula"], row


@pytest.mark.processes
def test_bench_dp_times_torch_ddp_on_the_same_group(capfd):
    """bench dp's torch DDP column: PyTorch's DistributedDataParallel on the gloo group the
    bucketed rung uses, timed in the same interleaved rounds; the ratio from those columns.
    Threads have no torch process group: no column, no ratio."""
    argv = ["bench", "dp", "-n", "2", "--layers", "1", "--width", "8", "--batch", "2"]
    assert main([*argv, "--backend", "gloo", "--steps", "2", "--rounds", "3", "--json"]) == 0
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("{")]
    row = json.loads(lines[-1])
    assert row["torch_ddp"] > 0 and row["bucketed_library"] > 0
    assert row["ddp_ratio"] == pytest.approx(row["bucketed_library"] / row["torch_ddp"])
    low, high = row["ddp_spread"]  # the per-round ratios' middle half
    assert 0 < low <= high, row
    assert main([*argv, "--backend", "threads", "--steps", "1", "--rounds", "1", "--json"]) == 0
    row = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert row["torch_ddp"] is None and row["ddp_ratio"] is None and row["ddp_spread"] is None


@pytest.mark.processes
def test_bench_zero_times_fsdp2_on_the_same_group(capfd):
    """bench zero's FSDP2 column: fully_shard on the gloo group ZeRO-3 uses, its gradients equal
    to ZeRO-3's before both are timed in interleaved rounds; the ratio from those columns."""
    argv = ["bench", "zero", "-n", "2", "--backend", "gloo", "--layers", "2", "--width", "8"]
    assert main([*argv, "--steps", "1", "--precision", "fp32", "--json"]) == 0
    (result,) = report(capfd.readouterr().out)["results"]
    row = result["fsdp2"]
    assert row["zero3_ms"] > 0 and row["fsdp2_ms"] > 0 and row["grad_difference"] <= 1e-5, row
    assert row["ratio"] == pytest.approx(row["zero3_ms"] / row["fsdp2_ms"])
    assert 0 < row["spread"][0] <= row["spread"][1], row


@pytest.mark.processes
def test_bench_tp_times_torch_tensor_parallelism_on_the_same_group(capfd):
    """bench tp's torch column: the MLP under torch.distributed.tensor.parallel on the gloo
    group ParallelMLP uses, outputs and gradients equal before both are timed in interleaved
    rounds; the ratio from those columns."""
    argv = ["bench", "tp", "-n", "2", "--backend", "gloo", "--batch", "1", "--seq", "4"]
    assert main([*argv, "--d-model", "8", "--heads", "2", "--steps", "1", "--json"]) == 0
    (row,) = report(capfd.readouterr().out)["mlp"]
    assert row["tp"] == 2 and row["ours_ms"] > 0 and row["torch_ms"] > 0, row
    assert row["difference"] <= 1e-5 and row["ratio"] == pytest.approx(
        row["ours_ms"] / row["torch_ms"]
    )
    assert 0 < row["spread"][0] <= row["spread"][1], row


@pytest.mark.threads
def test_bench_zero_and_tp_have_no_torch_column_on_threads(capsys):
    """Threads have no torch process group: no FSDP2 or torch tensor-parallel column, no ratio;
    minidist's own MLP is still timed."""
    from minidist.testing import run_threads
    from minidist.zero.bench import beside_fsdp2

    argv = ["bench", "tp", "-n", "2", "--backend", "threads", "--batch", "1", "--seq", "4"]
    assert main([*argv, "--d-model", "8", "--heads", "2", "--steps", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["mlp"]
    assert row["ours_ms"] > 0 and row["torch_ms"] is None and row["ratio"] is None, row
    assert run_threads(beside_fsdp2, 2, None) == [None, None]  # before any model is built


@pytest.mark.pure
def test_the_ratio_spread_is_the_middle_half_of_the_per_round_ratios():
    """Round k's ratio is ours[k] / theirs[k]; the spread is their first and third quartiles
    (inclusive: quartiles of the values themselves), one round's ratio twice."""
    from minidist.bench import medians, ratio_spread, spread_words

    ours, theirs = [2.0, 3.0, 4.0, 5.0, 12.0], [2.0, 2.0, 2.0, 2.0, 2.0]
    assert ratio_spread(ours, theirs) == (1.5, 2.5)  # ratios 1, 1.5, 2, 2.5, 6
    assert ratio_spread([3.0], [2.0]) == (1.5, 1.5)
    assert medians({"ours": ours, "theirs": theirs, "none": None}) == {
        "ours": 4.0,
        "theirs": 2.0,
        "none": None,
    }
    assert spread_words((0.98, 1.094)) == " (rounds 0.98-1.09)" and spread_words(None) == ""
