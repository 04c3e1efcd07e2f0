"""`minidist plan` on bad input: every numeric flag range-checked, refused in one line with the
number and exit 2, at once and in bounded memory (minidist/cluster/cli.py: numbers, LIMITS).

Each case is one a user met: a GPU count of a billion grew the planner to 21 GB (a tuple of every
rank), a batch of 1e30 printed "101.1 days" with exit 0, 1e9 layers ran for minutes (every pipeline
depth up to the layers was tried), "abc" printed argparse's usage before its error, 1e12 GPUs
ended in a MemoryError. Timed and measured in this process, from the parsed flags to the refusal.
A picked layout that cannot run says why (--tp 3, --chunks 3 and --microbatch-size 3 were once
refused as "no layout runs" and nothing more), in text and in the JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tracemalloc

import pytest

from minidist.cluster import search as plan_search

try:
    from .test_plan import run_cli
except ImportError:  # run as a script
    from test_plan import run_cli

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    "args,line",
    [
        (["--gpus", "1000000000", "--batch", "1000000000"], "--gpus=1000000000 must be at most"),
        (["--batch", "1e30"], "--batch=1e30 must be at most 16777216"),
        (["--layers", "1e9"], "--layers=1e9 must be at most 10000"),
        (["--gpus", "abc"], "--gpus=abc is not a whole number"),
        (["--gpus", "1e12", "--batch", "1e12"], "--gpus=1e12 must be at most 1048576"),
        (["--tokens", "nan"], "--tokens=nan must be positive"),
        (["--tokens", "1e3"], "one step of --batch=512 x 2048 tokens is more than --tokens=1000"),
        (["--heads", "2.5"], "--heads=2.5 is not a whole number"),
        (["--tp", "0"], "--tp=0 must be at least 1"),
    ],
)
def test_bad_numbers_are_refused_in_a_line_at_once(args, line, capsys):
    tracemalloc.start()
    start = time.perf_counter()
    code, out, err = run_cli(capsys, *args)
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert code == 2 and line in err and not out, (code, out, err)
    assert all(row.startswith("minidist plan: ") for row in err.splitlines()), err  # no usage
    assert seconds < 1.0 and peak < 50e6, (seconds, peak)


def test_a_whole_number_may_be_written_with_an_exponent(capsys):
    code, out, err = run_cli(capsys, "--model", "llama-7b", "--gpus", "6.4e1", "--batch", "5.12e2")
    assert code == 0 and "on 64 x A100" in out, err


def test_pipeline_depths_are_the_divisors_not_every_number_up_to_the_layers():
    assert plan_search.divisors(720720, 10**9)[-3:] == [240240, 360360, 720720]
    assert len(plan_search.divisors(720720, 10**9)) == 240
    assert plan_search.divisors(64, 10) == [1, 2, 4, 8]
    assert plan_search.divisors(1, 1) == [1]


@pytest.mark.parametrize(
    "args,line",
    [
        (["--tp", "3"], "--tp=3 does not divide --gpus=64"),
        (["--chunks", "3", "--pp", "1"], "--chunks=3 interleaves pipeline stages: it needs --pp"),
        (["--dp", "4", "--pp", "4", "--tp", "2"], "= 32, which leaves no whole dp x pp x tp"),
        (["--model", "llama-7b", "--tp", "3", "--gpus", "96"], "heads=32 (kv heads 32) are not"),
        (["--microbatch-size", "3"], "layouts: batch=512 is not divisible by dp=2 x b=3"),
    ],
)
def test_a_picked_layout_that_cannot_run_is_refused_with_its_reason(args, line, capsys):
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and line in err, err
    assert "no layout" in err or len(err.splitlines()) == 1, err


def test_the_json_lists_the_refusal_reasons_with_their_counts(capsys):
    code, out, _ = run_cli(capsys, "--microbatch-size", "3", "--json")
    got = json.loads(out)
    assert code == 2 and got["layouts"] == []
    reasons = {r["reason"]: r["layouts"] for r in got["refused"]}
    assert reasons["batch=512 is not divisible by dp=2 x b=3"] > 0, reasons
    code, out, _ = run_cli(capsys, "--tp", "3", "--json")  # refused before any layout is priced
    got = json.loads(out)
    assert code == 2 and got["problems"] == ["--tp=3 does not divide --gpus=64"], got
    code, out, _ = run_cli(capsys, "--model", "llama-7b", "--json")  # runs: reasons all the same
    got = json.loads(out)
    assert code == 0 and got["layouts"] and got["refused"][0]["layouts"] > 0


@pytest.mark.parametrize("flag,value,key", [("--chunks", 3, "v"), ("--tp", 32, "tp")])
def test_a_pick_off_the_search_grid_is_priced(flag, value, key, capsys):
    # interleaving by 3 and tp over four nodes: outside the default grid, tried when asked
    code, out, err = run_cli(capsys, flag, str(value), "--json")
    assert code == 0, err
    assert {row["layout"][key] for row in json.loads(out)["layouts"]} == {value}


def test_minidist_plan_imports_no_torch():
    # `minidist plan` answers within a second because it imports only the planner: the command
    # line builds the parser of the subcommand it names (minidist/cli.py: build_parser), and
    # importing minidist imports no comm (minidist/__init__.py). Checked on the modules loaded,
    # in a fresh process (this one has torch), for a refusal and for a plan.
    program = (
        "import sys, contextlib, io\n"
        "from minidist import cli\n"
        "out, err = io.StringIO(), io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
        "    refused = cli.main(['plan', '--gpus', '1000000000', '--batch', '1000000000'])\n"
        "    planned = cli.main(['plan', '--model', 'llama-7b', '--gpus', '8'])\n"
        "torch = [m for m in sys.modules if m.split('.')[0] == 'torch']\n"
        "print(refused, planned, sorted(torch)[:3])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["2", "0", "[]"], (done.stdout, done.stderr)
