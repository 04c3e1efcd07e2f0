"""`minidist run` and `minidist.init()`: starting ranks, detecting how, and dying well."""

from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.launch.init import _torch_env, detect_backend
from minidist.launch.launcher import launch, serve_store

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
    assert code == 2 and out == "minidist run: -n 0: must be at least 1\n"
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


DRILLS = [  # (what rank 1 does, backends, exit code, what the report must say)
    ("exit3", ("mpi", "threads"), 3, "rank 1 failed (exit code 3)"),
    ("sleep", ("mpi", "threads"), 1, "rank 1 hung (exit code 1)"),
    ("loop", ("gloo", "threads"), 1, "rank 1 hung (exit code 1)"),
    ("early", ("gloo",), 1, "rank 1 failed (exit code 1):\nTraceback"),
]


@pytest.mark.processes
@pytest.mark.parametrize(
    "what,backend,code,says",
    [(w, b, c, s) for w, backends, c, s in DRILLS for b in backends],
)
def test_the_watchdog_names_the_rank_that_exited_or_hung(what, backend, code, says, tmp_path):
    """Rank 1 exits early, sleeps while the others wait, loops after they finished, or fails
    before init: it is named (a hung one with its stack), all ranks are stopped within seconds
    of the 3 s timeout, its exit code is the job's, and the launcher leaves no folder."""
    env = dict(os.environ, MINIDIST_TIMEOUT="3", TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "minidist.cli", "run", "-n", "3", "--backend", backend]
    out = subprocess.run(
        [*cmd, str(SCRIPTS / "misbehave.py"), what],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    ended, text = time.time(), out.stdout + out.stderr
    began = re.search(r"rank 1 misbehaves at ([\d.]+)", text)
    seconds = ended - float(began.group(1)) if began else 0.0  # early: before it can print
    assert out.returncode == code, text
    assert f"minidist run: {says}" in text, text
    if "hung" in says:  # its stack, at the line where it loops
        assert re.search(r'misbehave.py", line \d+,? in <module>', text), text
    assert "no traceback: killed" not in text
    assert seconds < 3 + 12, f"the job ended {seconds:.1f}s after rank 1 misbehaved"
    assert not list(tmp_path.glob("minidist-*")), "the launcher left its folder"


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_rank_that_leaves_early_is_named_within_seconds(backend):
    """Rank 1 returns (exit code 0) while the others wait for it in an all_reduce: under the
    default 60 s timeout they fail within a second, naming it, its exit code and the call, and
    the launcher says it left early (not that a waiting rank failed or hung)."""
    cmd = [sys.executable, "-m", "minidist.cli", "run", "-n", "3", "--backend", backend]
    out = subprocess.run(
        [*cmd, str(SCRIPTS / "misbehave.py"), "skip"], capture_output=True, text=True, timeout=120
    )
    ended, text = time.time(), out.stdout + out.stderr
    began = re.search(r"rank 1 misbehaves at ([\d.]+)", text)
    assert out.returncode == 1, text
    assert "minidist run: rank 1 left early (exit code 0):" in text, text
    waited = rf"rank [02] of 3 \({backend}\): all_reduce\(op=sum\) #\d+ failed: rank 1 ended"
    assert re.search(waited + r" \(exit code 0\) while this rank waited for it", text), text
    assert began and ended - float(began.group(1)) < 10, f"took {ended - float(began.group(1))}s"


@pytest.mark.threads
def test_the_launchers_store_holds_its_port_from_the_moment_it_is_chosen():
    """No port race at start: the store gloo and nccl ranks meet at is bound by the launcher as
    the OS chooses its port (port 0) and never released before the ranks join it, so another
    job (its store, any connection's local end) cannot take it meanwhile: a bind fails."""
    store = serve_store(2, 5.0)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))
    rank = dist.TCPStore("127.0.0.1", store.port, 2, False, datetime.timedelta(seconds=5))
    rank.set("joined", "1")  # a rank joins it as a client
    assert store.get("joined") == b"1"


PLAIN_TORCH = """
import os, socket, torch, torch.distributed as dist
if os.environ["RANK"] == "0":  # the launcher holds the port: rank 0 cannot serve it
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
            raise SystemExit("rank 0 could bind MASTER_PORT: nobody serves the store there")
        except OSError:
            pass
dist.init_process_group("gloo")  # env://, as torchrun's workers: a client of the launcher's store
x = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(x)
assert x.item() == 3, x
dist.destroy_process_group()
"""


@pytest.mark.processes
def test_gloo_ranks_join_the_store_the_launcher_serves(tmp_path):
    """Under minidist run every gloo rank, rank 0 too, is a client of the launcher's store, as
    under torchrun: even a plain torch.distributed script (env://) runs unchanged."""
    script = tmp_path / "plain_torch.py"
    script.write_text(PLAIN_TORCH)
    outcome = launch([str(script)], 2, "gloo", timeout=60)
    assert outcome.returncode == 0, outcome.report()


KILLED = [0, 1, 2]  # one job of 3 ranks per victim, all at once: the busier, the closer


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_the_rank_killed_first_is_blamed_every_time(backend):
    """Blame from evidence, not from order: a rank dies by SIGKILL and the others, noticing at
    once, fail on their own with exit code 3 a moment later (tests/scripts/kill.py). In a
    close race on a busy machine the launcher must name the killed rank every time: it counts
    a rank that left no words from the last moment its lifeline was seen open, and the others
    from when they wrote theirs."""
    script = str(SCRIPTS / "kill.py")

    def job(victim: int):
        return victim, launch([script, str(victim)], 3, backend, timeout=60)

    with ThreadPoolExecutor(len(KILLED)) as pool:
        outcomes = list(pool.map(job, KILLED))
    for victim, outcome in outcomes:
        assert not outcome.timed_out, outcome.report()
        assert outcome.failed_rank == victim, f"rank {victim} was killed:\n{outcome.report()}"
        # mpiexec keeps its ranks' exit statuses: only the gloo launcher sees the signal
        seen = "killed by signal 9" if backend == "gloo" else "it ended without one: killed?"
        assert f"(no traceback: {seen})" in outcome.report(), outcome.report()


@pytest.mark.processes
def test_sigterm_to_the_launcher_stops_the_ranks_and_leaves_nothing(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "minidist.cli", "run", "-n", "2", "--backend", "gloo"]
    launcher = subprocess.Popen(
        [*cmd, str(SCRIPTS / "misbehave.py"), "loop"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    end = time.monotonic() + 60
    while time.monotonic() < end and not list(tmp_path.glob("minidist-*/rank1.pid")):
        time.sleep(0.1)
    pid = int(next(tmp_path.glob("minidist-*/rank1.pid")).read_text())
    launcher.terminate()
    assert launcher.wait(timeout=30) == 143
    assert not list(tmp_path.glob("minidist-*")), "the launcher left its folder"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the looping rank is gone too


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
