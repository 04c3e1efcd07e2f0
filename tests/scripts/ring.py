"""Pass a token around the ring once; rank 0 prints what came back."""

import torch

import minidist

comm = minidist.init()
token = torch.zeros(1)
if comm.world_size == 1:
    print("ring of 1: token 0")
elif comm.rank == 0:
    comm.send(token + 1, 1)
    comm.recv(token, comm.world_size - 1)
    print(f"ring of {comm.world_size} ({comm.backend}): token {int(token.item())}")
else:
    comm.recv(token, comm.rank - 1)
    comm.send(token + 1, (comm.rank + 1) % comm.world_size)
