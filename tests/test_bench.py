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
