"""Rank 2 raises (or, with 'kill', dies by SIGKILL) while the others wait for it forever."""

import os
import signal
import sys

import torch

import minidist

comm = minidist.init()
comm.barrier()
if comm.rank == 2:
    if sys.argv[1:] == ["kill"]:
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("boom on rank 2")
comm.recv(torch.zeros(1), 2)  # never arrives; the default timeout is 60 s
