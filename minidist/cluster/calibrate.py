"""This computer as a cluster for the planner: measured, so `minidist plan --cluster this`
predicts what `minidist train` takes here.

Equals: nothing; measurements. tools/plan_validate.py sets the plan beside `minidist train`
(target: within 25%; lesson 13 gives the ratios).
What is measured, none of it a training step:
  link     alpha and B fitted to `minidist bench p2p --json` (cluster.calibrated)
  memory   a core's copy bandwidth: plan.step prices the elementwise work
           (plan.elementwise_nbytes) and the optimizer (16 bytes a parameter, read and
           written) with it
  compute  a core's FLOP/s on the job's own layer, per (microbatch size b, tp): one block's
           forward and backward as the job builds it (ParallelTransformerBlock, at tp = 1 too:
           its f, g and parallel linears cost time on one rank) on (b, s, h), cut over tp as a
           rank runs it, every rank of the layout running at once as threads (they share the
           memory: a second matmul loop beside one slowed it 9%), one torch thread in all;
           its FLOPs as plan.Shape counts them (the layer's matmuls and attention scores, 1/tp
           of them) over the slowest rank's median CPU seconds (of 21 passes, fewer where they
           would take more than BUDGET_SECONDS), less the elementwise bytes at
           the copy bandwidth. The LayerNorms, GELU, softmax (exp, erf: more than memory
           traffic on a CPU), torch's per-op overhead and a tp slice's smaller matmuls stay in
           that rate, which a bare matmul leaves out (a 256 x 256 matmul ran 20-60% faster a
           FLOP).
Ladder: copy_bandwidth, block_rate (the two measurements) -> Machine (a rate per (b, tp),
measured once each) -> Machine.cluster_for(layout): the cluster plan.step prices it on.
Lesson: lessons/13_beyond_one_machine/.   Run: minidist plan --cluster this --calibration FILE
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from minidist.cluster import hardware as clusters
from minidist.cluster import plan, profiles
from minidist.cluster import search as plan_search
from minidist.comm.threads import ThreadsWorld
from minidist.launch.thread_ranks import run_thread_ranks
from minidist.tensor_parallel.blocks import ParallelTransformerBlock
from minidist.transformer import TransformerBlock

BUDGET_SECONDS = 2.0  # about the CPU a rank spends timing one block: 3 to `repeats` passes


def copy_bandwidth(nbytes: int = 1 << 26, repeats: int = 5) -> float:
    """A core's memory bandwidth (B/s): a copy of nbytes reads and writes each byte once."""
    a, b = torch.empty(nbytes // 4), torch.ones(nbytes // 4)
    with one_thread():
        return 2 * nbytes / _cpu_median(lambda: a.copy_(b), repeats)


def block_rate(
    shape: plan.Shape, b: int, tp: int, world: int, memory_bw: float, repeats: int = 21
) -> float:
    """A core's FLOP/s on one block of shape as a rank of tp runs it, forward and backward, on
    (b, s, h): its training FLOPs (plan.Shape's count, one layer, 1/tp) over the slowest of
    `world` ranks' median CPU seconds, less the elementwise bytes at memory_bw (plan.step
    prices them apart). ValueError if the shape is not minidist's block (a gated MLP, grouped
    queries) or the block ran faster than its elementwise bytes allow."""
    if problems(shape):
        raise ValueError(problems(shape)[0])
    flops = 3 * b * shape.seq * shape.layers_flops_per_token() / shape.layers / tp  # a layer
    one = plan.Layout(1, 1, tp, b=b)
    memory = plan.elementwise_nbytes(shape, one, False, 4) / shape.layers / memory_bw
    with one_thread():
        seconds = max(_on_threads(world, tp, shape, b, repeats))
    if seconds <= memory:
        raise ValueError(
            f"{shape.name}: a block at b={b}, tp={tp} took {seconds * 1e3:.2f} ms, less than its "
            f"elementwise bytes at {memory_bw / 1e9:.1f} GB/s ({memory * 1e3:.2f} ms)"
        )
    return flops / (seconds - memory)


def problems(shape: plan.Shape) -> list[str]:
    """Why this machine cannot time shape's block (minidist's own: GPT-2's), if it cannot."""
    if shape.glu or shape.kv_heads not in (0, shape.heads):
        kv = shape.kv_heads or shape.heads
        return [
            f"{shape.name}: --cluster this times minidist's own block, which has no gated MLP "
            f"(glu={shape.glu}) and no grouped queries (kv heads {kv} of {shape.heads})"
        ]
    return []


def _on_threads(world: int, tp: int, shape: plan.Shape, b: int, repeats: int) -> list[float]:
    """Each of `world` ranks' median CPU seconds of its block slice, all running at once."""
    threads_world = ThreadsWorld(world)  # the default timeout

    def abort_words(r: int, e: BaseException) -> str:
        return f"rank {r} failed timing its block: {type(e).__name__}"

    run = run_thread_ranks(
        _block_seconds, threads_world, tp, shape, b, repeats, abort_words=abort_words
    )
    if run.errors:  # raised here, in the caller's thread: the first, the cause
        raise next(iter(run.errors.values()))[0]
    return run.results


def _block_seconds(comm, tp: int, shape: plan.Shape, b: int, repeats: int) -> float:
    """This rank's median CPU seconds of its slice of a block, forward and backward, on the tp
    group of its neighbours (as the mesh puts tp ranks: adjacent)."""
    tp_comm = comm.split(comm.rank // tp)
    # the weights and inputs do not change the time (threads share torch's generator)
    block = TransformerBlock(shape.hidden, shape.heads, shape.ffn)
    block = ParallelTransformerBlock.from_full(block, tp_comm)
    x = torch.randn(b, shape.seq, shape.hidden, requires_grad=True)  # (b, s, h)
    start = time.thread_time()
    block(x).sum().backward()  # the first call allocates: not timed
    first = torch.tensor([time.thread_time() - start], dtype=torch.float64)
    comm.all_reduce(first, "max")  # one count on every rank: a tp group meets in every pass
    repeats = max(3, min(repeats, int(BUDGET_SECONDS / first.item())))  # a large block: fewer
    return _cpu_median(lambda: block(x).sum().backward(), repeats)


def _cpu_median(work, repeats: int) -> float:
    """The median CPU seconds of work() in this thread (another job's load does not count)."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        work()
        times.append(time.thread_time() - start)
    return statistics.median(times)


class one_thread:
    """torch on one thread inside (a rank of this machine has one core); the setting is the
    process's, not a thread's: set it once around every rank."""

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


# the rates are measured ones; minidist's main job syncs gradients after the pipeline step
MEASURED = plan.Efficiency(compute=1.0, network=1.0)
MINIDIST = profiles.PROFILES["minidist"]


class Machine:
    """This computer, one rank a core: the link of a `minidist bench p2p --json` file, a
    core's copy bandwidth and memory (the RAM's share), and a compute rate per (b, tp) of one
    shape, measured once each (block_rate: all the layout's ranks at once)."""

    def __init__(self, path: str, shape: plan.Shape, repeats: int = 21):
        with open(path) as f:
            rows = json.loads(f.readline())["rows"]  # the object is one line; mpiexec may add more
        cores = os.cpu_count() or 1
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        link = clusters.calibrated(rows)
        base = clusters.this_machine(link, float("inf"), cores)  # the rate: per layout
        gpu = replace(base.gpu, memory=ram / cores, memory_bw=copy_bandwidth())
        self.cluster = replace(base, gpu=gpu)
        self.shape = shape
        self.repeats = repeats
        self.rates: dict[tuple[int, int], float] = {}

    def cluster_for(self, layout: plan.Layout) -> clusters.Cluster:
        """The cluster whose core runs at the rate measured for this layout's (b, tp)."""
        key = (layout.b, layout.tp)
        if key not in self.rates:
            world, bw = layout.dp * layout.pp * layout.tp, self.cluster.gpu.memory_bw
            self.rates[key] = block_rate(self.shape, *key, world, bw, self.repeats)
        return replace(self.cluster, gpu=replace(self.cluster.gpu, peak_flops=self.rates[key]))

    def measured(self) -> dict:
        """What was measured: the link, the copy bandwidth, a GFLOP/s per (b, tp) timed."""
        c = self.cluster
        return {
            "latency_us": c.intra.latency * 1e6,
            "bandwidth_gb_s": c.intra.bandwidth / 1e9,
            "copy_gb_s": c.gpu.memory_bw / 1e9,
            "gflop_s": {f"b={b} tp={tp}": rate / 1e9 for (b, tp), rate in self.rates.items()},
        }

    def search(self, gpus: int, batch: int, allowed=None) -> tuple[list, list]:
        """plan_search.search on this machine as `minidist train` runs: float32 (e = 4), attention
        that keeps its scores, whole activations between stages (no scatter), no sequence
        parallelism or selective recompute (the job has neither: --checkpointing is full),
        MEASURED efficiencies, minidist's profile (gradients synced after the step); every
        layout that fits priced at its own (b, tp)'s rate."""

        def runs(x: plan.Layout) -> bool:
            return not x.sp and x.recompute != "selective" and (allowed is None or allowed(x))

        shape, base = self.shape, self.cluster
        ok, refused = plan_search.search(
            shape, base, gpus, batch, MEASURED, False, runs, 4, False, profile=MINIDIST
        )
        first = {(q.layout.b, q.layout.tp): q.layout for q in ok}  # one per rate to measure
        quiet = not sys.stderr.isatty()
        for x in tqdm(first.values(), "timing the block per (b, tp)", disable=quiet, leave=False):
            self.cluster_for(x)
        ok = [self._priced(q.layout, gpus, batch) for q in ok]
        return sorted(ok, key=lambda q: q.seconds), refused

    def _priced(self, layout: plan.Layout, gpus: int, batch: int) -> plan.Plan:
        cluster = self.cluster_for(layout)
        return plan.evaluate(
            self.shape, layout, cluster, gpus, batch, MEASURED, False, e=4, profile=MINIDIST
        )
