"""Data parallelism: 4 ranks train one MLP on different data and stay identical.

    python lessons/04_data_parallel/demo.py                                 # 4 thread-ranks
    minidist run -n 4 --backend mpi lessons/04_data_parallel/demo.py       # 4 processes

The task: learn a fixed random layer tanh(x W) from fresh batches x. Each step every rank runs
forward and backward on its quarter of the batch, buckets of gradients are all-reduced while
backward still runs, then every rank takes the same step. Rank 0 prints the loss (it falls),
checks the replicas agree bit for bit, and draws its timeline to out/dp_timeline.png.
"""

import os

import torch
from torch import nn

from minidist.comm.wrappers import ObservedComm, Tracer
from minidist.data_parallel.wrappers import DataParallelBucketed, shard
from minidist.launch.launcher import demo_init


def main(comm):
    tracer = Tracer()
    net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.Tanh())])
    mine = torch.Generator().manual_seed(100 + comm.rank)  # different on purpose: the wrapper
    with torch.no_grad():  # broadcasts rank 0's weights to all
        for q in net.parameters():
            q.uniform_(-0.06, 0.06, generator=mine)
    model = DataParallelBucketed(net, ObservedComm(comm, tracer), bucket_bytes=256 << 10)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)  # the same teacher and global batch on every rank
    teacher = torch.randn(256, 256, generator=g) / 16  # (D, D)
    for step in range(8):
        x = torch.randn(64, 256, generator=g)  # (B, D) global batch
        x_local = shard(x, comm)  # (B/p, D): this rank's rows
        with tracer.span("forward"):
            loss = (model(x_local) - torch.tanh(x_local @ teacher)).square().mean()
        with tracer.span("backward"):
            loss.backward()  # buckets launch from inside backward
        with tracer.span("wait"):
            model.finish_gradient_sync()
        opt.step()
        opt.zero_grad()
        total = comm.all_reduce(loss.detach().reshape(1), "avg").item()
        if comm.rank == 0:
            print(f"step {step}: loss {total:.5f}  ({len(model.buckets)} buckets)")
    flat = torch.cat([q.detach().reshape(-1) for q in net.parameters()])
    rows = comm.all_gather(torch.empty(comm.world_size * flat.numel()), flat)
    same = all(torch.equal(r, flat) for r in rows.view(comm.world_size, -1))
    if comm.rank == 0:
        print(f"replicas identical on all {comm.world_size} ranks: {same}")
        os.makedirs("out", exist_ok=True)
        draw(tracer.events, "out/dp_timeline.png")
        print("timeline of rank 0 -> out/dp_timeline.png")


def draw(events, path):
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    colours = {"forward": "tab:blue", "backward": "tab:green", "wait": "tab:gray"}
    fig = Figure(figsize=(10, 3))
    ax = fig.subplots()
    for e in events[-40:]:  # the last steps
        row = 0 if e["tid"] == 1 else 1  # compute spans vs communication
        colour = "tab:orange" if row == 1 else colours.get(e["name"], "tab:gray")
        ax.barh(row, e["dur"] / 1e3, left=e["ts"] / 1e3, color=colour, edgecolor="black")
    ax.set_yticks([0, 1], ["compute", "all-reduce"])
    ax.invert_yaxis()
    names = [*colours, "all-reduce of a bucket"]
    handles = [Patch(color=c) for c in [*colours.values(), "tab:orange"]]
    ax.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncols=4)
    ax.set(xlabel="time (ms)", title="rank 0: buckets reduced while backward runs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    comm = demo_init(__file__)  # plain `python demo.py`: 4 thread-ranks
    main(comm)
