"""`minidist bench`: a smoke test on the threads backend (tiny sizes); speed is never asserted."""

from __future__ import annotations

import json

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
        for name in ("library", "naive", "recursive_doubling", "ring", "auto"):
            assert all(row[name][c] > 0 for c in COLUMNS), (name, row[name])
            bus_over_alg = row[name]["busbw"] / row[name]["algbw"]
            assert bus_over_alg == pytest.approx(2 * (3 - 1) / 3)  # busbw = algbw 2(p-1)/p
        assert row["ratio"] > 0 and row["best"] in ("naive", "recursive_doubling", "ring", "auto")


@pytest.mark.threads
def test_bench_p2p_and_the_table(capsys):
    argv = ["bench", "p2p", "-n", "2", "--backend", "threads", "--max-bytes", "1K", "--iters", "2"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["nbytes"] for r in rows] == [1024] and rows[0]["time_us"] > 0 and rows[0]["bw"] > 0
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "one-way(us)" in table and "1024" in table
