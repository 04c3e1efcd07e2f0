"""The adapter that points `minidist conform` at ddp.py (this folder's from-scratch DDP):

    .venv/bin/minidist conform lessons/appendix_conformance/adapter.py --only dp

COMM = "torch": the kit hands each function a torch.distributed process group (gloo), so it
runs over gloo processes by default. Functions the adapter leaves out (the collectives, tensor
parallelism) are reported skipped.
"""

from ddp import DDP

COMM = "torch"


def data_parallel(comm, module):
    return DDP(module, comm)


def dp_after_backward(model):
    model.finish_gradient_synchronization()


def dp_no_sync(model):
    return model.no_sync()
