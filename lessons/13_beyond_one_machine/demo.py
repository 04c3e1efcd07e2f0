"""Lesson 13: minidist's own code on a simulated cluster of 64 GPUs: where the time goes.

python lessons/13_beyond_one_machine/demo.py                 # DGX H100 nodes (the default)
python lessons/13_beyond_one_machine/demo.py pcie-a100       # or another cluster preset

The simulated ranks are threads of one process; every message is real, only the clock is
simulated (minidist/cluster/simulate.py), so the answers do not depend on this machine's speed.
Under minidist run, rank 0 runs the simulation and the other ranks have nothing to do.
"""

import sys

import torch

import minidist
from minidist.cluster import hardware as cluster
from minidist.cluster.simulate import simulate
from minidist.collectives.algorithms import ring_all_reduce
from minidist.collectives.hierarchical import hierarchical_all_reduce, node_comms
from minidist.tensor_parallel.blocks import ParallelTransformerBlock


def flat(comm, n: int) -> None:
    ring_all_reduce(torch.ones(n), comm)


def hierarchical(comm, n: int, g: int) -> None:
    node_comm, cross_comm = node_comms(comm, g)
    hierarchical_all_reduce(torch.ones(n), node_comm, cross_comm)


def block(comm) -> None:
    """One transformer block (d=512, 16 heads, batch 4 x 256 tokens), forward and backward."""
    layer = ParallelTransformerBlock(512, 16, 2048, comm, seed=1)
    layer(torch.randn(4, 256, 512, generator=torch.Generator().manual_seed(2))).sum().backward()


def us(seconds: float) -> str:
    return f"{seconds * 1e6:10.1f}"


def main(name: str) -> None:
    c = cluster.preset(name)
    g = c.gpus_per_node
    print(f"{c.name}: {g} GPUs a node; inside {c.intra.name}, {c.intra.bandwidth / 1e9:g} GB/s;")
    print(f"across {c.inter.name}, {c.inter.bandwidth / 1e9:g} GB/s per GPU\n")
    print("all-reduce of float32 on 64 GPUs (8 nodes), simulated and by formula, microseconds")
    print(
        f"{'MiB':>6} {'flat ring':>10} {'formula':>10} {'hierarch.':>10} {'formula':>10} speed-up"
    )
    for mib in (0.25, 4, 1024):
        n = int(mib * 2**20) // 4  # float32 elements
        f_ring = cluster.ring_all_reduce_seconds(c, 64, 4 * n)
        f_hier = cluster.hierarchical_all_reduce_seconds(c, 64, 4 * n)
        if mib > 4:  # 1 GiB on 64 thread-ranks is too much for a laptop: the formulas alone
            ring, hier = f_ring, f_hier
            print(f"{mib:6g} {'':10} {us(f_ring)} {'':10} {us(f_hier)} {ring / hier:7.2f}x")
            continue
        ring = simulate(flat, c, 64, n).time
        hier = simulate(hierarchical, c, 64, n, g).time
        print(f"{mib:6g} {us(ring)} {us(f_ring)} {us(hier)} {us(f_hier)} {ring / hier:7.2f}x")
    print("\none tensor-parallel transformer block, forward and backward, microseconds")
    print(f"{'tp':>4} {'nodes':>6} {'step':>10} {'compute':>10} {'waiting':>10}")
    for tp in (2, g, 2 * g):
        report = simulate(block, c, tp, efficiency=0.5)
        compute = max(report.compute)
        nodes = -(-tp // g)
        print(f"{tp:4} {nodes:6} {us(report.time)} {us(compute)} {us(report.time - compute)}")
    print("\nat this toy width (d=512) the all-reduces cost more than the matmuls even on NVLink")
    print("(compute grows as d^2, traffic as d: see the README for GPT-3's width); across nodes")
    print("they cost five times more again. Keep tp inside a node.")


if __name__ == "__main__":
    if minidist.init().rank == 0:
        main(sys.argv[1] if len(sys.argv) > 1 else "dgx-h100")
