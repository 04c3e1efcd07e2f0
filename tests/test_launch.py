"""`minidist run` and `minidist.init()`: starting ranks, detecting how, and dying well."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import minidist
from minidist.launch import _torch_env, detect_backend

SCRIPTS = Path(__file__).parent / "scripts"


def minidist_run(*args: str, timeout: float = 120) -> tuple[int, str, float]:
    """Run `minidist run ...`; (exit code, stdout + stderr, seconds)."""
    start = time.monotonic()
    cmd = [sys.executable, "-m", "minidist.cli", "run", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


@pytest.mark.pure
@pytest.mark.parametrize(
    "env,backend",
    [
        ({}, "threads"),
        ({"MINIDIST_BACKEND": "mpi", "RANK": "0", "WORLD_SIZE": "2"}, "mpi"),
        ({"PMI_RANK": "1", "PMI_SIZE": "4"}, "mpi"),  # mpiexec (MPICH hydra)
        ({"OMPI_COMM_WORLD_RANK": "0"}, "mpi"),  # Open MPI's mpirun
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "gloo"),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}, "gloo"),  # srun
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "threads"),  # a one-task allocation
    ],
)
def test_detect_backend(env, backend):
    if backend == "gloo" and torch.cuda.is_available():
        backend = "nccl"  # torchrun and srun ranks use NCCL where there are GPUs
    assert detect_backend(env) == backend


@pytest.mark.pure
def test_slurm_variables_give_rank_world_and_rendezvous():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "4242", "MASTER_ADDR": "n0"}
    assert _torch_env(env) == (5, 8, "n0", 29500 + 242)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "7"}
    assert _torch_env(torchrun) == (1, 2, "a", 7)


@pytest.mark.pure
def test_bad_backend_and_rank_count_are_refused():
    with pytest.raises(ValueError, match="backend='carrier-pigeon' is not one of"):
        minidist.init(backend="carrier-pigeon")
    code, out, _ = minidist_run("-n", "0", "--backend", "gloo", str(SCRIPTS / "ring.py"))
    assert code != 0 and "-n 0: the number of ranks must be at least 1" in out
    code, out, _ = minidist_run("-n", "2", "--backend", "smoke", str(SCRIPTS / "ring.py"))
    assert code == 2 and "invalid choice: 'smoke'" in out


@pytest.mark.pure
def test_plain_python_is_a_world_of_one():
    comm = minidist.init()
    assert (comm.rank, comm.world_size, comm.backend) == (0, 1, "threads")


@pytest.mark.threads
def test_run_threads_backend():
    code, out, _ = minidist_run("-n", "4", "--backend", "threads", str(SCRIPTS / "ring.py"))
    assert code == 0, out
    assert "ring of 4 (threads): token 4" in out


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_run_processes(backend):
    code, out, _ = minidist_run("-n", "3", "--backend", backend, str(SCRIPTS / "ring.py"))
    assert code == 0, out
    assert f"ring of 3 ({backend}): token 3" in out


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo", "threads"])
def test_a_failing_rank_stops_the_rest_and_is_named(backend):
    # ranks 0 and 1 wait for rank 2 with the default 60 s timeout: only the launcher saves them
    code, out, seconds = minidist_run("-n", "3", "--backend", backend, str(SCRIPTS / "fail.py"))
    assert code != 0
    assert "minidist run: rank 2 failed" in out
    assert 'raise ValueError("boom on rank 2")' in out and "ValueError: boom on rank 2" in out
    assert seconds < 30, f"took {seconds:.1f}s to stop"


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_killed_rank_stops_the_rest_and_is_named(backend):
    args = ("-n", "3", "--backend", backend, str(SCRIPTS / "fail.py"), "kill")
    code, out, seconds = minidist_run(*args)
    assert code != 0
    assert "minidist run: rank 2 failed" in out and "(no traceback:" in out
    assert seconds < 30, f"took {seconds:.1f}s to stop"


@pytest.mark.processes
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_close_all_ends_the_worker_threads_of_every_group():
    """At exit (init registers close_all) no Gloo worker may still be running: one that frees a
    finished operation's tensors while the interpreter shuts down aborts the process."""
    code, out, _ = minidist_run("-n", "4", "--backend", "gloo", str(SCRIPTS / "close_all.py"))
    assert code == 0, out
    counts = re.findall(r"rank \d threads: (\d+) (\d+) (\d+)", out)
    assert len(counts) == 4, out
    for before, with_groups, after in counts:
        assert int(with_groups) > int(before) and after == before, out
