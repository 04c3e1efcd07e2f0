"""The stale-message drill: rank 0 sends 1.0, then 2.0, with tag 7, in two phases; rank 1
forgets the first phase's receive and takes 1.0 for 2.0. argv[1]: "send" (blocking) or "isend"
(the second message sent and never waited for). tests/test_leftovers.py runs it."""

import sys

import torch

import minidist

comm = minidist.init()
if comm.rank == 0:
    comm.send(torch.tensor([1.0]), 1, tag=7)  # phase 1: rank 1 should receive it here
    if sys.argv[1] == "send":
        comm.send(torch.tensor([2.0]), 1, tag=7)  # phase 2
    else:
        comm.isend(torch.tensor([2.0]), 1, tag=7)
elif comm.rank == 1:
    got = comm.recv(torch.zeros(1), 0, tag=7)  # meant for phase 2
    print(f"rank 1 got {got.item()}", flush=True)
