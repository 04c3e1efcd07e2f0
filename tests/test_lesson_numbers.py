"""The numbers the lesson READMEs quote from their demos are what the code prints now.

A README quotes a demo in a fenced block that opens with the command,
`$ .venv/bin/python lessons/NN_name/demo.py`, followed by lines of its output, exactly as
printed; a line `...` stands for lines left out. Lessons 11 and 12 run their demo here, on 4 and
8 thread-ranks (a few seconds; the threads backend reduces in rank order and the demos run torch
on one thread, so every run prints the same). Lesson 13's demo simulates 64 ranks, about 10 s,
so its block is checked row by row, each row recomputed with the functions the demo calls.
The prose around each block quotes some of the same numbers, and is checked beside it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import statistics

import pytest
import torch

from minidist.cluster import hardware as cluster
from minidist.cluster.simulate import simulate
from minidist.testing import run_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUOTE = re.compile(r"```\n\$ \.venv/bin/python (lessons/[\w/]+/demo\.py)\n(.*?)```", re.S)
# the lessons whose README quotes its demo, and the tests below that keep the quotes true
CHECKED = {"11_large_batches", "12_3d_parallel", "13_beyond_one_machine"}


def readme(lesson: str) -> str:
    with open(os.path.join(ROOT, "lessons", lesson, "README.md")) as f:
        return f.read()


def prose(lesson: str) -> str:
    """The README with every run of whitespace made one space, so a sentence may wrap anywhere."""
    return " ".join(readme(lesson).split())


def quotes(lesson: str) -> list[list[str]]:
    """The output lines of each block of the README that quotes the lesson's own demo."""
    found = QUOTE.findall(readme(lesson))
    assert all(demo == f"lessons/{lesson}/demo.py" for demo, _ in found), found
    return [shown.rstrip("\n").split("\n") for _, shown in found]


def missing(shown: list[str], printed: list[str]) -> str:
    """'' if shown is printed, its runs between `...` lines consecutive and in order; else the
    first line that is not where the quote says it is."""
    runs, run = [], []
    for line in shown:
        if line == "...":
            runs.append(run)
            run = []
        else:
            run.append(line)
    runs.append(run)
    at = 0
    for k, run in enumerate(runs):
        if not run:
            continue
        # a run with no `...` before it starts the output, one with none after it ends it
        starts = [at] if k == 0 else range(at, len(printed) - len(run) + 1)
        hit = next((i for i in starts if printed[i : i + len(run)] == run), None)
        if hit is None or (k == len(runs) - 1 and hit + len(run) != len(printed)):
            return run[0] if hit is None else run[-1]
        at = hit + len(run)
    return ""


def demo_module(lesson: str):
    path = os.path.join(ROOT, "lessons", lesson, "demo.py")
    spec = importlib.util.spec_from_file_location(f"demo_{lesson}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def demo_output(lesson: str, world_size: int) -> list[str]:
    """What the lesson's demo prints when started plainly: main(comm) on world_size thread-ranks."""
    main = demo_module(lesson).main
    threads = torch.get_num_threads()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):  # rank 0 prints; the other ranks say nothing
            run_threads(main, world_size, timeout=300.0)
    finally:
        torch.set_num_threads(threads)  # the demo sets one thread for the whole process
    return out.getvalue().rstrip("\n").split("\n")


@pytest.fixture(scope="module")
def lesson_11():
    return demo_output("11_large_batches", 4)


@pytest.fixture(scope="module")
def lesson_12():
    return demo_output("12_3d_parallel", 8)


@pytest.mark.pure
def test_every_quoted_demo_is_checked():
    lessons = sorted(d for d in os.listdir(os.path.join(ROOT, "lessons")) if d[:2].isdigit())
    quoting = {lesson for lesson in lessons if QUOTE.search(readme(lesson))}
    assert quoting <= CHECKED, f"add a check here for the demo quotes of {quoting - CHECKED}"
    assert CHECKED <= quoting, f"these READMEs lost their demo quotes: {CHECKED - quoting}"


@pytest.mark.pure
def test_a_quote_with_left_out_lines():
    printed = ["a", "b", "c", "d"]
    assert missing(["a", "b", "..."], printed) == ""
    assert missing(["...", "c", "d"], printed) == ""
    assert missing(["...", "b", "...", "d"], printed) == ""
    assert missing(["a", "c", "..."], printed) == "a"  # not consecutive
    assert missing(["b", "..."], printed) == "b"  # the output does not start with it
    assert missing(["...", "c"], printed) == "c"  # nor end with it
    assert missing(["...", "c", "...", "b", "..."], printed) == "b"  # out of order


@pytest.mark.threads
def test_lesson_11_quotes_what_its_demo_prints(lesson_11):
    blocks = quotes("11_large_batches")
    assert blocks, "lesson 11 lost its quote of the demo"
    for shown in blocks:
        assert not missing(shown, lesson_11), (missing(shown, lesson_11), lesson_11)
    curves = {}
    for line in lesson_11:
        m = re.match(r"  (small|large \+ warm-up|large, no warm-up) +([\d. ]+)$", line)
        if m:
            curves[m[1]] = m[2].split()  # held-out losses, as printed
    small = curves["small"]
    warm = curves["large + warm-up"]
    cold = curves["large, no warm-up"]
    text = prose("11_large_batches")
    peak = max(cold, key=float)
    assert f"jumped to a loss of {peak} after its first steps" in text, peak
    end = f"({cold[-1]} against {warm[-1]} with warm-up and {small[-1]} for the small batch)"
    assert end in text, end


@pytest.mark.threads
def test_lesson_12_quotes_what_its_demo_prints(lesson_12):
    blocks = quotes("12_3d_parallel")
    assert len(blocks) == 2, "lesson 12 quotes its byte table and its loss table"
    for shown in blocks:
        assert not missing(shown, lesson_12), (missing(shown, lesson_12), lesson_12)


@pytest.mark.threads
def test_lesson_12_tp_bytes_read_as_the_formula(lesson_12):
    """20 a on stage 0, 20 a + m 3 b T x on stage 1, with the demo's sizes, and the ratios."""
    text = prose("12_3d_parallel")
    # the demo's: float64, T = 16, D = 32, b = 2, m = 4
    m = 4
    b = 2
    T = 16
    D = 32
    e = 8
    x = 8
    assert "(float64, T = 16, D = 32, b = 2, m = 4: a = 8 KiB;" in text
    a = b * T * D * e
    assert a == 8 * 1024
    rows = {}
    for line in lesson_12:
        r = re.match(r"  rank (\d+) \(\d+, (\d+), \d+\) +dp +(\d+) .*pp +(\d+) .*tp +(\d+) ", line)
        if r:
            rows[int(r[2])] = [int(r[k]) for k in (3, 4, 5)]  # stage -> dp, pp, tp bytes
    loss = 3 * b * T * x
    assert rows[0][2] == m * (4 * a + a), rows[0]
    assert rows[1][2] == m * (4 * a + a + loss), rows[1]
    assert f"(4 a + a) = 20 a = {rows[0][2]:,} bytes" in text
    assert f"3 b T x = {loss} bytes" in text
    assert f"(4 a + a + 3 b T x) = 20 a + {m} x {loss} = {rows[1][2]:,} bytes" in text
    dp = sorted(f"{tp / dp:.1f}" for dp, pp, tp in rows.values())
    pp = sorted(f"{tp / pp:.1f}" for dp, pp, tp in rows.values())
    assert f"tp moves {dp[0]}-{dp[1]} times the dp bytes and {pp[0]}-{pp[1]} times" in text


def lesson_13_rows() -> dict[str, list[str]]:
    """The quoted block's rows by their first column (MiB, or tp), split into columns."""
    (shown,) = quotes("13_beyond_one_machine")
    rows = {}
    for line in shown:
        cells = line.split()
        if cells and re.fullmatch(r"[\d.]+", cells[0]):
            rows[cells[0]] = cells
    return rows


@pytest.mark.threads
@pytest.mark.parametrize("mib", [0.25, 4, 1024])
def test_lesson_13_all_reduce_row_is_the_simulation_and_the_formula(mib):
    demo = demo_module("13_beyond_one_machine")
    c = cluster.preset("dgx-h100")
    n = int(mib * 2**20) // 4  # float32 elements, as the demo counts them
    f_ring = cluster.ring_all_reduce_seconds(c, 64, 4 * n)
    f_hier = cluster.hierarchical_all_reduce_seconds(c, 64, 4 * n)
    if mib > 4:  # the demo prices 1 GiB by the formulas alone
        want = [f"{mib:g}", demo.us(f_ring), demo.us(f_hier), f"{f_ring / f_hier:.2f}x"]
    else:
        ring = simulate(demo.flat, c, 64, n).time
        hier = simulate(demo.hierarchical, c, 64, n, c.gpus_per_node).time
        cells = [ring, f_ring, hier, f_hier]
        want = [f"{mib:g}", *(demo.us(s) for s in cells), f"{ring / hier:.2f}x"]
    assert lesson_13_rows()[f"{mib:g}"] == [w.strip() for w in want]


@pytest.mark.threads
@pytest.mark.parametrize("tp", [2, 8, 16])
def test_lesson_13_tensor_parallel_row_is_the_simulation(tp):
    demo = demo_module("13_beyond_one_machine")
    c = cluster.preset("dgx-h100")
    report = simulate(demo.block, c, tp, efficiency=0.5)
    compute = max(report.compute)
    nodes = -(-tp // c.gpus_per_node)
    want = [str(tp), str(nodes), *(demo.us(s) for s in (report.time, compute))]
    want.append(demo.us(report.time - compute))
    assert lesson_13_rows()[str(tp)] == [w.strip() for w in want]


@pytest.mark.pure
def test_lesson_13_prose_reads_its_tables():
    text = prose("13_beyond_one_machine")
    ratios = [
        round(c.intra.bandwidth / c.inter.bandwidth)
        for c in map(cluster.preset, ("dgx-h100", "dgx-a100", "pcie-a100"))
    ]
    assert ratios == [9, 12, 20]
    sentence = (
        f"So a byte costs {ratios[0]}x more to send to another node than to a GPU of the same "
        f"node on a DGX H100, {ratios[1]}x on a DGX A100, and {ratios[2]}x on a PCIe box"
    )
    assert sentence in text
    rows = lesson_13_rows()
    across = float(rows["16"][4]) / float(rows["8"][4])  # waiting at tp 16 over tp 8
    assert f"across two nodes they cost {across:.1f} times more" in text


@pytest.mark.pure
def test_lesson_13_summary_of_the_published_runs_is_its_table():
    """The summary's median error and counts, from the table test_published_runs pins."""
    # | run | GPUs | layout | reported s | predicted s | error | ranking gap |
    layout = r"tp\d+ pp\d+ dp\d+ \w+(?: cp\d+)?(?: fp8)?"
    row = rf"^\| .+ \| \d+ \| {layout} \| [\d.]+ \| [\d.]+ \| (\S+) \| (.+) \|$"
    rows = re.findall(row, readme("13_beyond_one_machine"), re.M)
    assert len(rows) == 56
    errors = [abs(float(e.rstrip("%"))) for e, _ in rows if e != "calibration"]
    gaps = [g for _, g in rows if g != "does not fit"]
    close = sum(float(g.rstrip("%")) <= 5 for g in gaps)
    within = [sum(e <= limit for e in errors) for limit in (15, 25)]
    text = prose("13_beyond_one_machine")
    summary = (
        f"On the {len(errors)} runs that are not calibrations, the predicted step time of the "
        f"published layout is off by a median of {statistics.median(errors):.1f}% "
        f"({within[0]} within 15%, {within[1]} within 25%)"
    )
    assert summary in text, summary
    assert f"first, or one within 5% of it, for {close} runs" in text


@pytest.mark.pure
def test_lesson_02_alpha_beta_table_is_the_formulas():
    text = prose("02_collectives")
    a = 3e-6
    B = 10e9
    p = 4
    assert "(next section: a = 3 us," in text and "B = 10 GB/s," in text
    for size, unit, scale in (("1 KiB", "us", 1e6), ("64 MiB", "ms", 1e3)):
        S = 1024 if size == "1 KiB" else 64 * 2**20
        naive = 2 * (p - 1) * a + 2 * (p - 1) * S / B
        doubling = 2 * a + 2 * S / B  # log2(4) = 2 rounds
        ring = 2 * (p - 1) * a + 2 * (p - 1) / p * S / B
        cells = " | ".join(f"{t * scale:.1f} {unit}" for t in (naive, doubling, ring))
        assert f"| {size} | {cells} |" in text, cells
    assert f"S = 8 a B = {8 * a * B / 1024:.0f} KiB for p = 4" in text
