"""Rank `victim` dies by SIGKILL; the others notice at once and fail on their own (exit code 3),
as a rank would that saw its peer vanish: a race the launcher must settle by evidence, naming
the victim, whose process ended first (tests/test_launch.py)."""

import os
import select
import signal
import sys

import torch

import minidist

victim = int(sys.argv[1])
comm = minidist.init()
pids = torch.zeros(comm.world_size, dtype=torch.int64)
comm.all_gather(pids, torch.tensor([os.getpid()]))
if comm.rank == victim:
    os.kill(os.getpid(), signal.SIGKILL)
# a pidfd turns readable when the whole process has ended, its last thread too (its main
# thread alone shows as a zombie in /proc earlier, while other threads still hold its files)
ended = select.poll()
ended.register(os.pidfd_open(int(pids[victim])), select.POLLIN)
ended.poll()
sys.exit(3)
