"""minidist under the launchers a user already has, and a job that ends as a whole where no
launcher stops it.

The ring (tests/scripts/ring.py) and the main job with --check (`python -m minidist.gpt.cli`,
2 ranks, a pipeline of 2 stages, 3 steps) run under torchrun in its three forms (one node,
--standalone, two agents meeting at a c10d rendezvous on this machine), under mpiexec by hand,
and under srun where Slurm answers. Ranks started by hand (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set; plain processes, no launcher) have nobody to stop them: there the rendezvous
store ends the job (minidist/comm/exits.py), so a rank that hangs, fails or leaves early ends
every process within seconds, and the error names it; as it does where a launcher serves the
store but stops no rank of another machine (torchrun's agents on several machines).

Every job runs under a deadline: one still running then is killed, its process group and all,
and the test fails saying so.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from minidist.launch.launcher import mpiexec, serve_store

SCRIPTS = Path(__file__).parent / "scripts"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` command
MAIN_JOB = [
    "-m",
    "minidist.gpt.cli",
    "--pp",
    "2",
    "--microbatches",
    "2",
    "--steps",
    "3",
    "--warmup",
    "1",
    "--batch",
    "4",
    "--seq-len",
    "16",
    "--d-model",
    "16",
    "--n-heads",
    "2",
    "--d-ff",
    "32",
    "--n-layers",
    "2",
    "--check",
    "--json",
]
DEADLINE = 60  # seconds any job here may take (measured: at most 17 on a busy 2-core machine)
# every rank: one thread (2 cores, several ranks), no progress bar, and a timeout that turns a
# launcher that never connects the ranks into an error well before the deadline
RANK_ENV = {"OMP_NUM_THREADS": "1", "MINIDIST_PROGRESS": "0", "MINIDIST_TIMEOUT": "20"}


def start(cmd: list[str], env: dict) -> subprocess.Popen:
    """cmd in a process group of its own (the deadline kills all it started), its output in a
    file (a pipe nobody reads while we wait for another process could fill and stall it)."""
    out = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    proc.output = out
    return proc


def finish(procs: list[subprocess.Popen], deadline: float = DEADLINE) -> list[tuple[int, str]]:
    """[(exit code, output)] of every process, in order, once all have ended. One still
    running after `deadline` seconds: every group is killed, and the test fails."""
    end = time.monotonic() + deadline
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    running = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in running:
        os.killpg(procs[i].pid, signal.SIGKILL)
        procs[i].wait()
    results = []
    for proc in procs:
        proc.output.seek(0)
        results.append((proc.returncode, proc.output.read()))
        proc.output.close()
    if running:
        text = "".join(out for _, out in results)
        pytest.fail(f"processes {running} still running after {deadline}s:\n{text[-4000:]}")
    return results


def free_port() -> int:
    """A port free a moment ago, for a job whose rank 0 (or torchrun's agent) binds it when it
    starts. Drawn below the range the OS takes the local ports of connections from
    (ip_local_port_range): there, between this check and the bind, any connection of another
    job could take it; here only a job that chose the same port. (`minidist run` has no such
    gap: it binds its store's port as it chooses it, launch/launcher.py.)"""
    low = 32768  # Linux's default start of that range
    if os.path.exists("/proc/sys/net/ipv4/ip_local_port_range"):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    draw = random.Random()  # seeded from the OS: parallel test workers draw apart
    while True:
        port = draw.randrange(min(20000, low // 2), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def rank_env(**more: str) -> dict:
    """This environment for a rank, minidist's launch variables removed (no MINIDIST_FAILURE_DIR:
    a rank must not think a `minidist run` watches it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINIDIST_", "TORCHELASTIC"))}
    env.update(RANK_ENV)
    env.update(more)
    return env


def by_hand(argv: list[str], n: int, **more: str) -> list[subprocess.Popen]:
    """n plain processes `python argv...` with the variables a user would set by hand (more:
    others, or other values)."""
    port = str(free_port())
    hand = {"WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} | more
    return [start([sys.executable, *argv], rank_env(RANK=str(r), **hand)) for r in range(n)]


def store_served_by(who: str, n: int) -> tuple[object, dict]:
    """(the store this test serves as a launcher would, the variables that send the ranks to
    it): who = "a launcher" (torchrun's agents on several machines: no launcher stops the
    others, the store still ends the job), or (None, {}) for "rank 0" (ranks by hand)."""
    if who == "rank 0":
        return None, {}
    store = serve_store(n, 60.0)
    return store, {"MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def program(name: str, tmp_path) -> list[str]:
    """The argv after `python` of the ring or the main job."""
    if name == "ring":
        return [str(SCRIPTS / "ring.py")]
    return [*MAIN_JOB, "--out", str(tmp_path)]


def check(name: str, results: list[tuple[int, str]], backend: str) -> None:
    """Every process ended with 0 and rank 0 printed the ring's token or a passed --check."""
    text = "".join(out for _, out in results)
    assert [code for code, _ in results] == [0] * len(results), text[-4000:]
    if name == "ring":
        assert f"ring of 2 ({backend}): token 2" in text, text[-4000:]
        return
    line = next((s for s in text.splitlines() if s.startswith('{"config"')), None)
    assert line is not None, text[-4000:]
    assert json.loads(line)["check"]["ok"], line


# ---- launchers -------------------------------------------------------------------------------


def torchrun_commands(form: str, argv: list[str]) -> list[list[str]]:
    """The torchrun commands of one job of 2 ranks: one, or one per agent."""
    if form == "one node":  # a port of its own: torchrun's default, 29500, is every job's
        port = str(free_port())
        where = ["--master-addr", "127.0.0.1", "--master-port", port]
        return [[*TORCHRUN, "--nproc-per-node", "2", *where, *argv]]
    if form == "standalone":  # torchrun serves a c10d rendezvous on a free port itself
        return [[*TORCHRUN, "--standalone", "--nproc-per-node", "2", *argv]]
    port = free_port()  # two agents, one rank each, as two machines would
    meet = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "x"]
    agent = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", *meet]
    return [[*agent, "--node-rank", str(node), *argv] for node in (0, 1)]


@pytest.mark.processes
@pytest.mark.parametrize("name", ["ring", "main job"])
@pytest.mark.parametrize("form", ["one node", "standalone", "two agents"])
def test_torchrun(form, name, tmp_path):
    """torchrun's agent serves the store on MASTER_PORT and says so to its workers: every rank,
    rank 0 too, joins it as a client (binding the port would find the agent there)."""
    argv = program(name, tmp_path)
    env = rank_env(TMPDIR=str(tmp_path))  # torchrun's agents leave a torchelastic_* folder
    procs = [start(cmd, env) for cmd in torchrun_commands(form, argv)]
    check(name, finish(procs), "gloo")


@pytest.mark.processes
@pytest.mark.parametrize("name", ["ring", "main job"])
def test_mpiexec_by_hand(name, tmp_path):
    argv = program(name, tmp_path)
    procs = [start([mpiexec(), "-n", "2", sys.executable, *argv], rank_env())]
    check(name, finish(procs), "mpi")


def slurm() -> str | None:
    """Why Slurm cannot run a job here (None: it can)."""
    if shutil.which("srun") is None:
        return "srun is not on PATH: no Slurm here"
    answer = subprocess.run(["sinfo", "-h"], capture_output=True, text=True, timeout=30)
    if answer.returncode != 0:
        return f"no Slurm controller answers (sinfo: {answer.stderr.strip()})"
    return None


SRUN = ["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable]


@pytest.mark.processes
@pytest.mark.parametrize("name", ["ring", "main job"])
def test_srun(name, tmp_path):
    why = slurm()
    if why is not None:
        pytest.skip(why)
    argv = program(name, tmp_path)
    check(name, finish([start([*SRUN, *argv], rank_env())]), "gloo")


# ---- ranks no launcher stops ------------------------------------------------------------------


def began(text: str) -> float:
    """When rank 1 began to misbehave (time.time(), as it printed it)."""
    found = re.search(r"rank 1 misbehaves at ([\d.]+)", text)
    assert found, text[-4000:]
    return float(found.group(1))


@pytest.mark.processes
@pytest.mark.parametrize("served_by", ["rank 0", "a launcher"])
def test_by_hand_a_hung_rank_ends_the_job_and_is_named(served_by):
    """Rank 1 sleeps outside the comm while rank 0 all-reduces (MINIDIST_TIMEOUT=2): rank 0
    times out, every rank hears it through the store and ends, and rank 0's error names rank 1
    as the one that never arrived, with its stack; whether rank 0 or a launcher serves it."""
    store, where = store_served_by(served_by, 2)
    argv = [str(SCRIPTS / "misbehave.py"), "hang"]
    results = finish(by_hand(argv, 2, MINIDIST_TIMEOUT="2", **where))
    del store  # served until every rank has ended
    ended, text = time.time(), "".join(out for _, out in results)
    assert [code for code, _ in results] == [1, 1], text
    assert "[rank 0] rank 1 hung: no progress while rank 0 waited for it" in text, text
    assert re.search(r'misbehave.py", line \d+, in <module>', text), text  # rank 1's stack
    assert "all_reduce(op=sum) #2 timed out after 2s" in text, text
    assert "[rank 1] stopped: the job failed: rank 0: CommTimeout" in text, text
    assert ended - began(text) < 2 + 8, f"ended {ended - began(text):.1f}s after rank 1 hung"


@pytest.mark.processes
@pytest.mark.parametrize("served_by", ["rank 0", "a launcher"])
def test_by_hand_a_failing_rank_ends_the_job(served_by):
    """Rank 1 raises while rank 2 sleeps outside the comm (no connection of its own closes to
    wake it) and ranks 0 and 3 wait in an all_reduce: all four end within seconds, whether
    rank 0 or a launcher serves the store."""
    store, where = store_served_by(served_by, 4)
    results = finish(by_hand([str(SCRIPTS / "misbehave.py"), "raise"], 4, **where))
    del store  # served until every rank has ended
    ended, text = time.time(), "".join(out for _, out in results)
    assert all(code == 1 for code, _ in results), text
    assert "[rank 1] ValueError: rank 1 gives up" in text, text
    assert "[rank 2] stopped: the job failed: rank 1: ValueError: rank 1 gives up" in text, text
    assert ended - began(text) < 8, f"ended {ended - began(text):.1f}s after rank 1 failed"


@pytest.mark.processes
def test_by_hand_a_rank_that_leaves_early_is_named_within_seconds():
    """Rank 1 returns while ranks 0 and 2 wait for it in an all_reduce: with a 20 s timeout
    they fail at once, naming it and the call, and the job ends. Each waiting rank names rank 1
    itself, or is stopped first by the other's failure, which names it (which comes first is
    the machine's timing: both are right)."""
    results = finish(by_hand([str(SCRIPTS / "misbehave.py"), "skip"], 3))
    ended, text = time.time(), "".join(out for _, out in results)
    assert [code for code, _ in results] == [1, 0, 1], text
    named = r"PeerFailed: rank \d of 3 \(gloo\): all_reduce\(op=sum\) #\d+ failed: rank 1 ended"
    itself = [r for r in (0, 2) if re.search(rf"\[rank {r}\] {named} \(exit code", text)]
    assert itself, text  # at least one waiting rank saw rank 1 leave
    for r in set((0, 2)) - set(itself):
        stopped = rf"\[rank {r}\] stopped: the job failed: rank {itself[0]}: {named}"
        assert re.search(stopped, text), text
    assert ended - began(text) < 8, f"ended {ended - began(text):.1f}s after rank 1 left"


@pytest.mark.processes
def test_by_hand_a_rank_running_on_after_rank_0_finished_is_named():
    """Rank 0 serves the store, so it stays until the others end: rank 1 still looping
    MINIDIST_TIMEOUT s after rank 0 finished is named hung, with its stack, and stopped."""
    results = finish(by_hand([str(SCRIPTS / "misbehave.py"), "loop"], 2, MINIDIST_TIMEOUT="2"))
    ended, text = time.time(), "".join(out for _, out in results)
    assert [code for code, _ in results] == [1, 1], text
    assert "[rank 0] rank 1 hung: still running 2s after rank 0 finished" in text, text
    assert re.search(r'misbehave.py", line \d+, in <module>', text), text
    assert ended - began(text) < 2 + 8, f"ended {ended - began(text):.1f}s after rank 1 looped"


@pytest.mark.processes
def test_mpiexec_by_hand_a_hung_rank_is_named():
    """MPI has no store: the rank that timed out asks the others for their state over a
    communicator of their own, names the one not waiting in the comm, then aborts the job."""
    cmd = [mpiexec(), "-n", "2", sys.executable, str(SCRIPTS / "misbehave.py"), "hang"]
    results = finish([start(cmd, rank_env(MINIDIST_TIMEOUT="2"))])
    ended, text = time.time(), results[0][1]
    assert results[0][0] != 0, text
    assert "[rank 0] rank 1 hung: no progress while rank 0 waited for it" in text, text
    assert re.search(r'misbehave.py", line \d+, in <module>', text), text  # rank 1's stack
    assert ended - began(text) < 2 + 8, f"ended {ended - began(text):.1f}s after rank 1 hung"


@pytest.mark.processes
def test_srun_a_hung_rank_ends_the_step_and_is_named():
    why = slurm()
    if why is not None:
        pytest.skip(why)
    cmd = [*SRUN, str(SCRIPTS / "misbehave.py"), "hang"]
    results = finish([start(cmd, rank_env(MINIDIST_TIMEOUT="2"))])
    text = results[0][1]
    assert results[0][0] != 0, text
    assert "rank 1 hung: no progress while rank 0 waited for it" in text, text
    assert time.time() - began(text) < 2 + 10, text
