"""Lesson 12: one rank grid, three kinds of parallelism, the same training as one process.

python lessons/12_3d_parallel/demo.py                                   # 8 ranks as threads
minidist run -n 8 --backend mpi lessons/12_3d_parallel/demo.py         # or -n 4, --backend gloo
"""

import torch

from minidist.comm import Counter, ObservedComm
from minidist.gpt.loop import run, train_step
from minidist.gpt.model import GPTConfig, stage_layer_ids
from minidist.gpt.reference import train_full
from minidist.gpt.train import TrainConfig, build_job, predicted_nbytes
from minidist.launch.launcher import demo_init
from minidist.mesh import Layout

AXES = ("dp", "pp", "tp")
STEPS, M = 4, 4  # steps; microbatches per step


def layout_for(world: int) -> Layout:
    """tp first (inside the node), then pp, dp for the rest: 8 -> 2x2x2, 4 -> 1x2x2."""
    tp = 2 if world % 2 == 0 else 1
    pp = 2 if (world // tp) % 2 == 0 else 1
    return Layout(world // (tp * pp), pp, tp)


def show_grid(layout: Layout, say) -> None:
    say(
        f"world {layout.world_size} = dp {layout.dp} x pp {layout.pp} x tp {layout.tp}; "
        f"grid = torch.arange({layout.world_size}).view(dp, pp, tp):"
    )
    for d, replica in enumerate(layout.grid[:, :, 0, :].tolist()):  # (dp, pp, tp): cp = 1
        say(f"  replica d={d}: " + "  ".join(f"stage s={s} {row}" for s, row in enumerate(replica)))
    say("rank  (d,s,t)  tp group   pp group   dp group")
    for rank in range(layout.world_size):
        groups = "".join(f" {str(layout.group(rank, a)):10}" for a in ("tp", "pp", "dp"))
        say(f"{rank:4}  {str(layout.coords(rank)):8}{groups}".rstrip())


def main(comm) -> None:
    torch.set_num_threads(1)
    say = print if comm.rank == 0 else lambda *_: None
    layout = layout_for(comm.world_size)
    show_grid(layout, say)
    model = GPTConfig(seq_len=16, d_model=32, n_heads=4, d_ff=64, n_layers=2)
    config = TrainConfig(
        dp=layout.dp,
        pp=layout.pp,
        tp=layout.tp,
        microbatches=M,
        steps=STEPS,
        batch=layout.dp * M * 2,
        warmup=1,
        dtype="float64",
        model=model,
    )
    counters = {axis: Counter() for axis in AXES}
    job = build_job(comm, config, observe=lambda axis, sub: ObservedComm(sub, counters[axis]))
    mine = torch.tensor([job.mesh.dp_comm.rank, job.mesh.pp_comm.rank, job.mesh.tp_comm.rank])
    every = torch.empty(comm.world_size, 3, dtype=torch.int64)
    comm.all_gather(every, mine)  # each rank's place in its three sub-comms
    say(f"sub-comm ranks (dp, pp, tp) of each rank, as make_mesh split them: {every.tolist()}")
    for stage in range(layout.pp):  # layer 0: the embedding, 1..L blocks, L+1: the head
        ids = stage_layer_ids(model, layout.pp, 1, stage)[0]
        say(f"stage {stage} holds layers {ids}, each weight cut in {layout.tp} along tp")
    for counter in counters.values():
        counter.reset()  # count the steps, not the set-up
    losses = run(job, train_step, STEPS)["losses"]  # the main job's own loop
    if comm.rank == 0:
        reference = train_full(config)["losses"]
        say(f"loss, {STEPS} steps, float64   {layout.dp}x{layout.pp}x{layout.tp}       one process")
        for step, (a, b) in enumerate(zip(losses, reference, strict=True)):
            say(f"  step {step}   {a:.15f}   {b:.15f}   rel. diff {abs(a - b) / b:.1e}")
    sent = [sum(n for op, n in counters[a].nbytes.items() if op != "recv") // STEPS for a in AXES]
    formula = [-1 if v is None else v for v in predicted_nbytes(job).values()]
    table = torch.empty(comm.world_size, 6, dtype=torch.int64)
    comm.all_gather(table, torch.tensor(sent + formula))
    say(
        "bytes handed to each sub-comm per step, measured (formula: train.predicted_nbytes);"
        " '-': a group of one rank moves nothing"
    )
    for rank, row in enumerate(table.tolist()):
        cells = "  ".join(
            f"{a} {row[i]:7d} ({row[i + 3]:7d})"
            if getattr(layout, a) > 1
            else f"{a} {'-':>7} {'':9}"
            for i, a in enumerate(AXES)
        )
        say(f"  rank {rank} {str(layout.coords(rank)):9} {cells}")


if __name__ == "__main__":
    comm = demo_init(__file__, n=8)  # plain `python demo.py`: 8 thread-ranks
    main(comm)
