"""Split the world every way, run collectives on each part, then close_all: each rank prints
how many threads its process had before init, with the groups, and after close_all."""

import os
import sys

import torch

import minidist
from minidist.comm import torchdist
from minidist.testing import subworlds


def threads() -> int:
    return len(os.listdir("/proc/self/task"))  # the process's native threads, torch's included


before = threads()
comm = minidist.init()
for k, sub in subworlds(comm).items():
    if comm.rank < k:
        sub.all_reduce(torch.ones(1000))
        sub.iall_reduce(torch.ones(10)).wait()
    comm.barrier()
with_groups = threads()
torchdist.close_all()
sys.stdout.write(f"rank {comm.rank} threads: {before} {with_groups} {threads()}\n")  # one write
sys.stdout.flush()
