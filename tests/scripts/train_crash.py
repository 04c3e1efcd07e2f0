"""The main job on 4 ranks (dp=1, pp=2, tp=2), at a small model's size (the drill is about
dying, not training); rank 2 is killed (SIGKILL) in its third step, in the middle of the
pipeline, while the others wait on it."""

import os
import signal

import minidist
from minidist.gpt.model import GPTConfig
from minidist.gpt.train import TrainConfig, build_job, train_step
from minidist.pipeline.schedules import FORWARD

comm = minidist.init()
model = GPTConfig(seq_len=16, d_model=16, n_heads=4, d_ff=32, n_layers=2)
config = TrainConfig(pp=2, tp=2, microbatches=4, steps=10, batch=8, model=model)
job = build_job(comm, config)
original = job.stage.table[FORWARD]  # what the executor calls for a forward


def forward(op):
    if comm.rank == 2 and job.step == 2 and op.microbatch == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies without a word, as an OOM kill would
    original(op)


job.stage.table[FORWARD] = forward
for _ in range(config.steps):
    train_step(job)
