"""The cluster as data: GPUs, nodes, the network, and what a message costs on each link.

Equals: nothing to equal: this module is numbers and formulas. Each number of a preset is a
fact from a public spec sheet or price list, with its source beside it, or says that it is an
assumption. The formulas are the alpha-beta model of lesson 02 with one (alpha, beta) pair per
link class; tests/test_cluster.py asserts them against minidist's own byte counts.
Communication (p ranks on n nodes of g GPUs, rank r on node r // g; N bytes):
    flat ring all-reduce     2 (p-1) steps of N/p bytes: in a node 2 (p-1) (a + N/(p B));
                             across nodes about 2 (p-1)/p N / B of the network, which carries
                             every step (ring_all_reduce_seconds: the longer of two bounds)
    tree all-reduce          a pipelined reduce up and broadcast down a tree of depth
                             log2(p): 2 (log2(p) a + N/B); latency-optimal, moves N per link
    hierarchical all-reduce  reduce-scatter in the node, all-reduce the N/g shard across
                             nodes (every GPU on its own NIC at once), all-gather in the node:
                             2 (g-1) (a_in + N/(g B_in)) + 2 (n-1) (a_out + N/(g n B_out))
Bytes each rank sends: flat ring 2 (p-1)/p N (on the network if its right neighbour is on
another node); hierarchical 2 (g-1)/g N inside the node and 2 (n-1)/n N/g across.
Matmuls: the share of peak their 256 x 128 output tiles keep in waves over the SMs (wave_share).
Ladder: the data (GPU, Link, Cluster, presets) -> the cost of one message (message_seconds)
-> collectives on a topology (ring_seconds: any ring of ranks; ring, tree, hierarchical
all-reduce) -> calibrated(): this machine from `minidist bench p2p --json`.
Paper: Thakur, Rabenseifner, Gropp (IJHPCA 2005) for the alpha-beta costs; Jeaugey, "Massively
Scale Your Deep Learning Training with NCCL 2.4" (NVIDIA blog, 2019) for trees in NCCL.
Lesson: lessons/02_collectives/ (the alpha-beta model).   Run: see tests/test_cluster.py.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

GB = 1e9  # spec sheets count decimal gigabytes


@dataclass(frozen=True)
class GPU:
    """One accelerator: dense bf16 peak (FLOP/s), memory (bytes), memory bandwidth (B/s),
    board power (W), streaming multiprocessors (0: matmuls of any shape run at one rate), dense
    FP8 peak (FLOP/s; 0: no FP8 tensor cores), calibration: whose fitted efficiencies the
    planner gives it ("A100", "H100"; "": by its name, cluster/plan.py's calibrated())."""

    name: str
    peak_flops: float
    memory: float
    memory_bw: float
    watts: float
    sms: int = 0
    fp8_flops: float = 0.0
    calibration: str = ""


@dataclass(frozen=True)
class Link:
    """A link class: latency (s) per message and bandwidth (B/s, one direction, per GPU)."""

    name: str
    latency: float
    bandwidth: float


@dataclass(frozen=True)
class Cluster:
    """Nodes of gpus_per_node GPUs: `intra` between two GPUs of a node, `inter` from a GPU to
    a GPU of another node (its share of the node's NICs). oversubscription > 1 divides the
    network's bandwidth when every node sends at once (a tapered fabric). node_watts: one
    node at full load (GPUs, CPUs, NICs, fans); usd_per_gpu_hour: the rental price; pue: the
    data centre's total power over its IT power. nics: the node's network cards for the
    compute fabric, each of bandwidth inter.bandwidth x gpus_per_node / nics (a DGX: one per
    GPU, rail-optimized; cluster/network.py runs one NCCL channel on each). channels: the rings
    a collective runs across nodes (0: NCCL's, one a card its GPUs reach; 1: one ring, as
    minidist's own ring_all_reduce and cluster/simulate.py's library collectives run)."""

    name: str
    gpu: GPU
    gpus_per_node: int
    intra: Link
    inter: Link
    node_watts: float
    usd_per_gpu_hour: float
    pue: float
    oversubscription: float = 1.0
    nics: int = 1
    channels: int = 0

    def node_of(self, rank: int) -> int:
        """The node rank r sits on: ranks fill a node before the next (as mpiexec and torchrun
        place them by default)."""
        return rank // self.gpus_per_node

    def link(self, a: int, b: int) -> Link:
        """The link a message from rank a to rank b crosses."""
        if self.node_of(a) == self.node_of(b):
            return self.intra
        bw = self.inter.bandwidth / self.oversubscription
        return replace(self.inter, bandwidth=bw)


def message_seconds(cluster: Cluster, a: int, b: int, nbytes: float) -> float:
    """alpha + nbytes / beta of the link from rank a to rank b."""
    link = cluster.link(a, b)
    return link.latency + nbytes / link.bandwidth


def wave_share(gpu: GPU, rows: int, products: list[tuple[int, int]]) -> float:
    """The share of the GPU's matmul rate that products of `rows` x k by k x n (each (k, n)
    in products) reach, forward and backward, after tile and wave quantization: a product's
    output is cut into 256 x 128 tiles, the SMs take one tile each at a time, and the last
    wave and the tiles on the edges run part empty (NVIDIA, "Matrix Multiplication Background
    User's Guide", Deep Learning Performance documentation: tile and wave quantization, with
    256 x 128 tiles on the A100's 108 SMs). Each product runs three times, as many FLOPs each:
    forward (rows x n out), the input's gradient (rows x k) and the weight's (k x n); the share
    is their FLOPs over their time. 1 if gpu.sms is 0."""
    if gpu.sms == 0:
        return 1.0

    def filled(a: int, b: int) -> float:
        tiles = math.ceil(a / 256) * math.ceil(b / 128)
        return a * b / (math.ceil(tiles / gpu.sms) * gpu.sms * 256 * 128)

    work = sum(3 * k * n for k, n in products)
    time = sum(
        k * n * (1 / filled(rows, n) + 1 / filled(rows, k) + 1 / filled(k, n)) for k, n in products
    )
    return work / time


def _slowest(cluster: Cluster, p: int) -> Link:
    """The slowest link a ring over ranks 0..p-1 crosses (the network once p > g)."""
    return cluster.link(0, p - 1) if p > cluster.gpus_per_node else cluster.intra


@functools.lru_cache(maxsize=4096)
def ring_seconds(cluster: Cluster, ranks: tuple[int, ...], steps: int, chunk: float) -> float:
    """steps of a ring over ranks (in ring order), each rank sending chunk bytes to the next
    every step: the longer of two bounds.
    chain: each step waits for the chunk the previous step brought, so `steps` hops in a row
        each cost alpha + chunk / B of its own link (the dearest such run of hops);
    stream: the slowest link carries `steps` chunks back to back, then one latency.
    Inside a node the chain is the whole story: steps (alpha + c / B), lesson 02's formula.
    Across nodes the network link rarely idles, so the stream wins for large messages (NCCL's
    model likewise counts 2 (n-1) network latencies in an all-reduce, not 2 (p-1):
    tuning.cc). Equal to cluster/simulate.py's events where one bound dominates; where the two meet,
    short of them by up to 1% (nodes of 8) or 3.4% (nodes of 2: fast and slow hops alternate)."""
    p = len(ranks)
    if p == 1 or steps == 0:
        return 0.0
    # lab 13.1 begin: the chain (the dearest `steps` hops in a row) and the stream; the longer
    links = [cluster.link(a, b) for a, b in zip(ranks, ranks[1:] + ranks[:1], strict=True)]
    cost = [x.latency + chunk / x.bandwidth for x in links]  # hop i: ranks[i] -> ranks[i+1]
    laps, rest = divmod(steps, p)
    window = worst = sum(cost[:rest])  # the run of `rest` hops from hop 0, then slide it
    for i in range(1, p):
        window += cost[(i + rest - 1) % p] - cost[i - 1]
        worst = max(worst, window)
    chain = laps * sum(cost) + (worst if rest else 0.0)
    slow = min(links, key=lambda x: x.bandwidth)
    stream = steps * chunk / slow.bandwidth + slow.latency
    return max(chain, stream)
    # lab 13.1 end


def ring_all_reduce_seconds(cluster: Cluster, p: int, nbytes: float) -> float:
    """Ranks 0..p-1 (nodes filled in order) all-reduce nbytes around the ring: 2 (p-1) steps of
    nbytes / p (ring_seconds). Inside one node: 2 (p-1) (alpha + N/(p B)); across nodes about
    2 (p-1)/p N / B of the network, which carries every step."""
    return ring_seconds(cluster, tuple(range(p)), 2 * (p - 1), nbytes / p)


def tree_all_reduce_seconds(cluster: Cluster, p: int, nbytes: float) -> float:
    """A pipelined reduce then broadcast along a tree: 2 (log2(p) a + N / B), a and B of the
    slowest link. Fewer latencies than the ring (log2 p, not 2 (p-1)), twice the ring's time
    per byte at large p: trees win for small messages and many ranks."""
    if p == 1:
        return 0.0
    link = _slowest(cluster, p)
    return 2 * (math.ceil(math.log2(p)) * link.latency + nbytes / link.bandwidth)


def hierarchical_all_reduce_seconds(cluster: Cluster, p: int, nbytes: float) -> float:
    """Reduce-scatter inside each node, all-reduce each 1/g shard across the nodes (the g
    GPUs of a node at once, each through its own share of the NICs), all-gather inside."""
    g = min(p, cluster.gpus_per_node)
    if p % g:
        raise ValueError(f"p={p} ranks do not fill whole nodes of {g} GPUs")
    n = p // g
    # lab 13.2 begin: the two rings inside the node, plus the ring of n across nodes on 1/g
    inside = 2 * (g - 1) * (cluster.intra.latency + nbytes / g / cluster.intra.bandwidth)
    if n == 1:
        return inside
    net = cluster.link(0, g)  # the ring across nodes is on the network, however few they are
    return inside + 2 * (n - 1) * (net.latency + nbytes / g / n / net.bandwidth)
    # lab 13.2 end


def hierarchical_sent_nbytes(p: int, g: int, nbytes: float) -> dict[str, float]:
    """Bytes one rank sends in the hierarchical all-reduce: inside its node and across, for
    nbytes divisible by p (else chunks differ by one element)."""
    n = p // g
    return {"intra": 2 * (g - 1) / g * nbytes, "inter": 2 * (n - 1) / n * nbytes / g}


def calibrated(rows: list[dict], name: str = "this machine") -> Link:
    """A Link fitted to `minidist bench p2p --json`'s rows ({nbytes, time_us}): the least
    squares line time = a + nbytes / B through every size."""
    xs = [float(r["nbytes"]) for r in rows]
    ys = [r["time_us"] * 1e-6 for r in rows]
    if len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError(f"need at least two message sizes to fit a and B, got {sorted(xs)}")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope /= sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        raise ValueError("time does not grow with size in these rows: too noisy to fit B")
    return Link(name, max(0.0, my - slope * mx), 1 / slope)


# ---- presets: each number with its source ------------------------------------------------
# [A100]  NVIDIA A100 Tensor Core GPU datasheet (2021): bf16 dense 312 TFLOP/s; 80 GB HBM2e;
#         2,039 GB/s (SXM) and 1,935 GB/s (PCIe); 400 W (SXM), 300 W (PCIe); NVLink 600 GB/s
#         per GPU, both directions together. 108 SMs: NVIDIA A100 Tensor Core GPU Architecture
#         whitepaper (2020).
# [H100]  NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5: bf16 989 TFLOP/s dense (1,979
#         with sparsity), FP8 1,979 dense (3,958 with sparsity); 80 GB HBM3, 3.35 TB/s; up to
#         700 W; NVLink 900 GB/s both directions. 132 SMs (SXM5): NVIDIA H100 Tensor Core GPU
#         Architecture whitepaper (2022). The A100 has no FP8 (its datasheet lists none).
# [H200]  NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: 141 GB HBM3e, 4.8 TB/s; bf16 989
#         TFLOP/s dense, FP8 1,979 dense (3,958 with sparsity); up to 700 W; NVLink 900 GB/s.
#         Its SMs are taken as the H100 SXM5's (the same peak: an assumption, the datasheet does
#         not count them).
# [DGXA]  NVIDIA DGX A100 datasheet (2020): 8 A100 on 6 NVSwitches; 8 single-port ConnectX-6
#         200 Gb/s HDR InfiniBand for compute; 6.5 kW max. Rail-optimized: NVIDIA DGX
#         SuperPOD reference architecture with DGX A100 (RA-09950-001, 2020), one HDR card a GPU
#         into the compute fabric.
# [DGXH]  NVIDIA DGX H100 / DGX H200 datasheets (2023, 2024): 8 GPUs on 4 NVSwitches; 8
#         ConnectX-7 400 Gb/s (InfiniBand NDR); about 10.2 kW max. NVIDIA DGX BasePOD reference
#         architecture, "Core Components": "Four OSFP ports serving eight single-port NVIDIA
#         ConnectX-7 VPI ... up to 400 Gb/s InfiniBand/Ethernet"; DGX H100 User Guide, 1.2.3
#         Network Modules, table 6: each of the eight ConnectX-7 ports serves one GPU.
# [NCCL]  NCCL's tuning model, src/graph/tuning.cc (hwLat, ring, LL protocol): per-hop
#         latency 0.47 us on NVLink, 1.0 us on PCIe, 2.7 us on the network.
# [PCIE]  PCI Express 4.0 x16: 16 GT/s x 16 lanes, 128b/130b coding: 31.5 GB/s per direction.
# [AWS]   AWS EC2 Capacity Blocks for ML price list (US East, in force until 2025-01-01),
#         effective accelerator hourly rate: p4d (8 A100 40 GB) $1.844, p5 (8 H100) $4.916,
#         p5e (8 H200) $5.408 per GPU-hour. No 80 GB A100 is listed: p4d's price stands in.
# [PUE]   Uptime Institute Global Data Center Survey 2023: average annual PUE 1.58; Google's
#         fleet-wide trailing twelve-month PUE 1.10 (Google Environmental Report 2023).

A100_SXM = GPU("A100-SXM4-80GB", 312e12, 80 * GB, 2039 * GB, 400, 108)  # [A100]
A100_PCIE = GPU("A100-PCIe-80GB", 312e12, 80 * GB, 1935 * GB, 300, 108)  # [A100]
H100_SXM = GPU("H100-SXM5-80GB", 989e12, 80 * GB, 3350 * GB, 700, 132, 1979e12)  # [H100]
H200_SXM = GPU("H200-SXM-141GB", 989e12, 141 * GB, 4800 * GB, 700, 132, 1979e12)  # [H200]

NVLINK3 = Link("NVLink 3 + NVSwitch", 0.47e-6, 300 * GB)  # [A100] 600/2 per direction, [NCCL]
NVLINK4 = Link("NVLink 4 + NVSwitch", 0.47e-6, 450 * GB)  # [H100] 900/2 per direction, [NCCL]
PCIE4 = Link("PCIe 4.0 x16", 1.0e-6, 31.5 * GB)  # [PCIE], [NCCL]
HDR_IB = Link("InfiniBand HDR 200 Gb/s per GPU", 2.7e-6, 25 * GB)  # [DGXA], [NCCL]
NDR_IB = Link("InfiniBand NDR 400 Gb/s per GPU", 2.7e-6, 50 * GB)  # [DGXH], [NCCL]
# one 100 Gb/s Ethernet port shared by the node's 8 GPUs: 12.5 GB/s / 8 each when all send
ETH100_SHARED8 = Link("100 GbE, one port per 8 GPUs", 2.7e-6, 12.5 * GB / 8)  # [NCCL] latency

PRESETS = {
    # 8 cards a node, one a GPU: [DGXA], [DGXH]
    "dgx-a100": Cluster("DGX A100 80GB", A100_SXM, 8, NVLINK3, HDR_IB, 6500, 1.844, 1.10, nics=8),
    "dgx-h100": Cluster("DGX H100", H100_SXM, 8, NVLINK4, NDR_IB, 10200, 4.916, 1.10, nics=8),
    "dgx-h200": Cluster("DGX H200", H200_SXM, 8, NVLINK4, NDR_IB, 10200, 5.408, 1.10, nics=8),
    # an assumption, not a spec: the host of the PCIe box draws 1 kW beside its 8 x 300 W GPUs,
    # and it rents at p4d's price; the data centre is the survey's average (1.58 [PUE])
    "pcie-a100": Cluster(
        "8x A100 PCIe, 100 GbE", A100_PCIE, 8, PCIE4, ETH100_SHARED8, 3400, 1.844, 1.58
    ),
}


def this_machine(link: Link, flops: float, cores: int, watts: float = 65.0) -> Cluster:
    """This CPU machine as a one-node cluster of `cores` ranks: `link` fitted by calibrated()
    to `minidist bench p2p`, `flops` a rank's measured matmul rate. Power and price are
    assumptions (a 65 W desktop part, free to use): set them for a real comparison."""
    cpu = GPU("CPU core", flops, 0.0, 0.0, watts / cores)
    return Cluster("this machine", cpu, cores, link, link, watts, 0.0, 1.0)


def preset(name: str) -> Cluster:
    """A preset by name, or a clear error listing the names."""
    if name not in PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
