"""The planner (cluster/plan.py) against minidist's own main job: bytes per dimension and memory.

The toy GPT of test_plan_simulated.py trains one step on threads, each sub-comm counted
(ObservedComm, as `minidist train` counts it) and its memory measured as `minidist train`
reports it (memory.py's storages: parameters, gradients, optimizer state; the activations
autograd saved, at their peak). The plan sees the same shape and layout in float32 (e=4).
Bytes: the first stage's ring bytes on each dimension equal plan.sent_nbytes to the byte, given
the rank's parameter count (the plan's own count leaves out biases, norms and positions), once
the job's bookkeeping is taken off (the 8-byte loss and a flag per parameter tensor on dp, with
each microbatch's reduce-scatter for ZeRO-2, a 64-byte header on pp, the cross-entropy's three
floats per token on tp). Layouts: dp x tp with ZeRO 0 and 2, dp x pp x tp with ZeRO 0 to 3 (a
pipeline with ZeRO-2 or 3 shards or gathers every microbatch, as sent_nbytes says). Memory: the plan
within 10% of the measured total (ZeRO-3: of the model state; see the test). Step time is not
a test (it is this machine's): tools/plan_validate.py measures it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from minidist.cluster import plan
from minidist.comm.wrappers import Counter, ObservedComm
from minidist.gpt.model import GPTConfig
from minidist.gpt.train import TrainConfig, build_job, train_step
from minidist.memory import storage_nbytes
from minidist.testing import run_threads

MODEL = GPTConfig(seq_len=16, d_model=32, n_heads=8, d_ff=128, n_layers=4)
SHAPE = plan.Shape("toy", 4, 32, 8, 128, 256, 16, dropout=False)
pytestmark = pytest.mark.threads


def wire_nbytes(counter: Counter, p: int, all_reduce: bool = True) -> float:
    """Bytes a rank sends with ring collectives, from the payloads a Counter saw: an
    all-reduce's input N costs 2 (p-1)/p N, a reduce-scatter's (p-1)/p N, an all-gather's
    shard (p-1) times itself; a send itself. Broadcasts (the loss) left out, and the
    all-reduces unless all_reduce (ZeRO-3's dp: they carry only the flags and the loss)."""
    n = counter.nbytes
    ring = n["all_reduce"] * 2 * (p - 1) / p if all_reduce else 0.0
    ring += n["reduce_scatter"] * (p - 1) / p
    return ring + n["all_gather"] * (p - 1) + n["send"]


def one_step(comm, config: TrainConfig) -> dict:
    """This rank's bytes per dimension, parameters and memory over one training step."""
    counters = {axis: Counter() for axis in ("dp", "pp", "tp")}
    job = build_job(comm, config, observe=lambda axis, c: ObservedComm(c, counters[axis]))
    params = [q for q in job.replicas.module.parameters() if q.requires_grad]
    before = job.replicas.step
    grads = {}

    def step():  # the gradients are whole (or their shards are) just before the step
        held = job.replicas.held_nbytes()
        grads["nbytes"] = held.get("grads", storage_nbytes([q.grad for q in params]))
        return before()

    job.replicas.step = step
    train_step(job)
    held = job.replicas.held_nbytes()
    layout, coords = config.layout, job.mesh.coords
    sizes = {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp}
    return {
        "coords": coords,
        "sent": {
            a: wire_nbytes(c, sizes[a], a != "dp" or config.zero != 3) for a, c in counters.items()
        },
        "numel": sum(q.numel() for q in params),
        "tensors": len(params),
        "state": held["params"] + grads["nbytes"] + held["optimizer"],
        "activations": job.stage.memory.peak,
    }


LAYOUTS = [(2, 1, 2, 0), (2, 1, 2, 2), (2, 2, 2, 0), (2, 2, 2, 1), (2, 2, 2, 2), (2, 2, 2, 3)]


@pytest.mark.parametrize("dp,pp,tp,zero", LAYOUTS)
def test_plan_bytes_and_memory_are_the_main_jobs(dp, pp, tp, zero):
    config = TrainConfig(
        dp=dp, pp=pp, tp=tp, zero=zero, microbatches=4, steps=1, batch=8 * dp, warmup=0
    )
    config = replace(config, model=MODEL)
    x = plan.Layout(dp, pp, tp, 1, zero, b=2, scatter=False)  # minidist sends whole activations
    for got in run_threads(one_step, dp * pp * tp, config):
        if got["coords"][1] != 0:
            continue  # the plan describes the first stage
        want = plan.sent_nbytes(SHAPE, x, config.batch, e=4, psi=got["numel"])
        ring = 2 * (dp - 1) / dp
        # the loss and a "used" flag per tensor (ZeRO-2: with every microbatch's reduce-scatter)
        flags = 0 if zero == 3 else ring * (8 + 4 * got["tensors"] * (4 if zero == 2 else 1))
        sent = dict(got["sent"], pp=got["sent"]["pp"] - (64 if pp > 1 else 0))  # the header
        if pp == 1:  # the last stage too: the cross-entropy's max, target logit and sum of exps
            sent["tp"] -= 4 * 3 * 2 * 16 * 4 * 2 * (tp - 1) / tp  # m b T values of 4 bytes
        assert sent == pytest.approx({**want, "dp": want["dp"] + flags}, rel=1e-12), got
        memory = plan.memory_bytes(SHAPE, x, config.batch, flash=False, e=4)
        planned, measured = sum(memory.values()), got["state"] + got["activations"]
        if zero == 3:  # the meter counts ZeRO-3's gathered weights that autograd saves at their
            # size when saved, though zero/gatherer.py frees them after use (resize_(0)): state only
            planned, measured = memory["model state"], got["state"]
        assert abs(planned / measured - 1) <= 0.10, (memory, got)
