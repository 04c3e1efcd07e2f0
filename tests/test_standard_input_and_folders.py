"""What `minidist run` leaves to its caller: the standard input it did not read, and no folder.

Standard input goes to rank 0 alone and nothing reads ahead of it (launch/processes.py): inside a
shell `while read` loop the job takes no line but the one rank 0 reads. The launcher's folder
goes however the launcher ends: a launcher killed by SIGKILL leaves it to the next launch,
which removes every folder whose launcher's lock is free. (The suite as a whole leaves nothing
in its temporary folder: tests/conftest.py checks it at the end.)
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from minidist.launch import processes
from minidist.launch.watchdog import _alive  # the launcher's own test of a pid

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_standard_input_goes_to_rank_0_and_no_further(backend):
    """Three lines, a `while read` loop: the shell reads line 1, the job's rank 0 line 2 (rank 1
    reads nothing), the shell line 3, and the loop ends. mpiexec, forwarding its input to
    rank 0, read all of it: the shell's second `read` found nothing."""
    run = f"{sys.executable} -m minidist.cli run -n 2 --backend {backend}"
    loop = (
        f"printf 'l1\\nl2\\nl3\\n' | while read x; do "
        f'{run} {SCRIPTS / "read_line.py"} || exit 9; read y; echo "loop $x then $y"; done'
    )
    out = subprocess.run(["bash", "-c", loop], capture_output=True, text=True, timeout=120)
    said = out.stdout  # (mpiexec may print a rank's line and its newline apart)
    assert said.count("loop") == 1 and "loop l1 then l3\n" in said, said + out.stderr
    assert said.count("rank 0 read 'l2'") == said.count("rank 1 read ''") == 1, said


@pytest.mark.processes
def test_a_folder_left_by_a_killed_launcher_goes_at_the_next_launch(tmp_path):
    """kill -9 of the launcher: its ranks end (they get SIGTERM when it dies), its folder stays
    (no `finally` runs), and the next launch removes it."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "minidist.cli", "run", "-n", "2", "--backend", "gloo"]
    launcher = subprocess.Popen(
        [*cmd, str(SCRIPTS / "misbehave.py"), "loop"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    end = time.monotonic() + 60
    while time.monotonic() < end and not list(tmp_path.glob("minidist-*/rank1.pid")):
        time.sleep(0.1)
    pid = int(next(tmp_path.glob("minidist-*/rank1.pid")).read_text())
    launcher.kill()
    launcher.wait(timeout=10)
    while time.monotonic() < end and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), "the looping rank outlived its launcher"
    assert len(list(tmp_path.glob("minidist-run-*"))) == 1  # left behind, for now
    next_launch = [*cmd, str(SCRIPTS / "ring.py")]
    out = subprocess.run(next_launch, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())


@pytest.mark.pure
def test_a_folder_whose_launcher_lives_is_kept(tmp_path, monkeypatch):
    """remove_orphans takes a folder only when it can take its lock: never a live launcher's,
    never another name."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live, lock = processes.job_folder()
    dead = tmp_path / f"{processes.JOB_PREFIX}dead"
    dead.mkdir()
    (dead / "rank0.pid").write_text("1")
    other = tmp_path / "minidist-suite-x"
    other.mkdir()
    assert processes.remove_orphans(str(tmp_path)) == [str(dead)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([Path(live).name, other.name])
    held = os.open(live, os.O_RDONLY)  # the lock is the launcher's, not the folder's name
    with pytest.raises(BlockingIOError):
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(held)
    processes.release_folder(live, lock)
    other.rmdir()
    assert not list(tmp_path.iterdir())
