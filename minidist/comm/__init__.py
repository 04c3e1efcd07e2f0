"""Communicators: one `Comm` protocol, interchangeable backends, and wrappers.

    threads     ThreadsWorld(n).comm(rank)          ranks as threads; CPU or CUDA tensors
    mpi         MPIComm()                           mpi4py; start with mpiexec
    gloo, nccl  torchdist.init_process_group(...)   torch.distributed; start with torchrun

Most code gets its comm from `minidist.init()` (see minidist/launch/launcher.py). Wrappers:
`ObservedComm(comm, Counter())` counts bytes, `ObservedComm(comm, Tracer())` records a timeline,
`CheckedComm(comm)` turns mismatched collectives into errors (debug mode).
"""

from .checked import CheckedComm
from .protocol import (
    OPS,
    CollectiveMismatch,
    Comm,
    CommError,
    CommTimeout,
    Work,
)
from .threads import ThreadsComm, ThreadsWorld
from .wrappers import Counter, ObservedComm, Tracer, write_chrome_trace

__all__ = [
    "OPS",
    "CheckedComm",
    "CollectiveMismatch",
    "Comm",
    "CommError",
    "CommTimeout",
    "Counter",
    "ObservedComm",
    "ThreadsComm",
    "ThreadsWorld",
    "Tracer",
    "Work",
    "write_chrome_trace",
]
