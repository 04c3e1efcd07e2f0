"""The launcher's processes: each rank (or mpiexec) in a process group of its own, dying with
the launcher, stopped as a whole.

A rank that outlived its launcher would hold its port, its share of the cores and its peers'
connections, and the next job would meet it. So `start` makes every child the leader of a new
process group (all it starts, mpiexec's ranks too, can be signalled at once) and, on Linux, asks
the kernel to send it SIGTERM when the launcher dies (PR_SET_PDEATHSIG, however the launcher
ends); `stop` sends each group SIGTERM, then SIGKILL after 3 s; `exit_on_sigterm` turns the
launcher's own SIGTERM into SystemExit, so its `finally` runs `stop`. Starting and stopping are
launch/launcher.py's alone.

Standard input goes to rank 0 alone, and nothing reads ahead of it: a rank that reads no input
leaves the caller's lines where they were (`minidist run` inside a shell `while read` loop
takes none of the loop's lines). Rank 0 reads the launcher's own standard input, the same open
file, itself; every other rank reads /dev/null. gloo and nccl: rank 0 inherits it. mpi: mpiexec
would forward its standard input to rank 0, reading ahead whatever is there (it ate a loop's
remaining lines); so mpiexec gets /dev/null, and the launcher's standard input travels down to
the ranks as one more open file (MINIDIST_STDIN_FD), which rank 0 puts in place of its own
(`take_stdin`, before the script runs) and the others close. (The threads backend's ranks are
threads of `minidist run` itself: they share its standard input.)

The launcher's folder (rank files, lifelines: launch/watchdog.py) goes however the launcher ends.
Its `finally` removes it; a launcher killed by SIGKILL runs no `finally`, so each folder holds a
lock (flock) for as long as its launcher lives (the kernel drops it when the process dies, by
any signal), and every launch first removes the folders whose lock it can take (`job_folder`):
their launcher is gone. A folder is born locked: made under a hidden name, locked, then renamed.

What the processes of a job leave each other in a folder (a rank's traceback, a job for a pool,
a rank's result) is written with `write_whole`: aside, then renamed, so the process that polls
for the file finds nothing or all of it, never a file half written.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

STDIN_FD = "MINIDIST_STDIN_FD"  # the launcher's standard input, passed down to mpi's rank 0
JOB_PREFIX = "minidist-run-"  # a launcher's folder, in the temporary folder (TMPDIR)


def write_whole(path: str, data: bytes) -> None:
    """Write data to path at once whole: aside, then renamed (one atomic step on POSIX)."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def job_folder(prefix: str = JOB_PREFIX, min_age: float = 0.0) -> tuple[str, int]:
    """(a new folder for one launch, the descriptor that holds its lock): keep the descriptor
    open while the job runs, then remove the folder and close it (release_folder). First removes
    every folder of a launcher that is gone (remove_orphans). The test suite makes its own
    temporary folder the same way (prefix, min_age: tests/conftest.py)."""
    root = tempfile.gettempdir()
    remove_orphans(root, prefix, min_age)
    new = tempfile.mkdtemp(prefix="." + prefix, dir=root)  # hidden: no sweep looks here
    lock = os.open(new, os.O_RDONLY | os.O_DIRECTORY)  # not inherited by the ranks (Python's
    fcntl.flock(lock, fcntl.LOCK_EX)  # default): the lock lives exactly as long as we do
    folder = os.path.join(root, os.path.basename(new)[1:])
    os.rename(new, folder)  # born locked: a sweep never sees it unlocked
    return folder, lock


def release_folder(folder: str, lock: int) -> None:
    """Remove a launch's folder and drop its lock."""
    shutil.rmtree(folder, ignore_errors=True)
    os.close(lock)


def remove_orphans(root: str, prefix: str = JOB_PREFIX, min_age: float = 0.0) -> list[str]:
    """Remove the launchers' folders under root whose lock nobody holds (their launcher died
    without its `finally`: SIGKILL), and not changed for min_age seconds; the ones removed."""
    removed = []
    for entry in os.scandir(root):
        if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue  # another user's launcher: theirs to clean
            if time.time() - entry.stat().st_mtime < min_age:
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # removed meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its launcher runs
            os.close(fd)
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        os.close(fd)
        removed.append(entry.path)
    return removed


def exit_on_sigterm():
    """Turn SIGTERM into SystemExit(143) while launching, so the `finally` stops the ranks and
    removes the launcher's folder; the old handler (None off the main thread, where Python
    allows no handler)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def start(cmd: list[str], env: dict, stdin: str = "none") -> subprocess.Popen:
    """Start a rank (or mpiexec) in its own process group, so it can be stopped as a whole,
    and (on Linux) have it receive SIGTERM if this launcher dies: no orphaned ranks.

    stdin: "inherit" (the child reads this launcher's standard input: gloo's rank 0), "pass"
    (mpiexec: it reads /dev/null, and this launcher's standard input is handed down as an
    open file that rank 0 takes, see take_stdin), or "none" (/dev/null)."""
    how = dict(env=env, start_new_session=True, preexec_fn=_die_with_parent)
    if stdin == "inherit":
        return subprocess.Popen(cmd, **how)
    fd = _dup_stdin() if stdin == "pass" else None
    if fd is None:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, **how)
    how["env"] = dict(env, **{STDIN_FD: str(fd)})
    try:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=(fd,), **how)
    finally:
        os.close(fd)  # the child holds its own copy


def _dup_stdin() -> int | None:
    """A copy of this process's standard input (None where it has none open)."""
    try:
        return os.dup(0)
    except OSError:
        return None


def take_stdin() -> None:
    """In a rank started by mpiexec under `minidist run`, before its script: rank 0 reads the
    launcher's standard input (handed down as MINIDIST_STDIN_FD), the others /dev/null's."""
    fd = os.environ.pop(STDIN_FD, None)
    if fd is None:
        return
    if os.environ.get("PMI_RANK", "0") != "0":  # MPICH's rank; rank 0 takes the input
        os.close(int(fd))
        fd = str(os.open(os.devnull, os.O_RDONLY))
    os.dup2(int(fd), 0)  # sys.stdin has read nothing yet: it reads the new file from here on
    os.close(int(fd))


def _die_with_parent() -> None:
    # runs in the child between fork and exec: only a plain libc call, resolved beforehand
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _find_prctl():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None).prctl


_prctl = _find_prctl()


def wait(procs, seconds: float) -> None:
    """Return when every process has ended, or after `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.02)


def stop(procs) -> None:
    """SIGTERM every process group still alive, SIGKILL after 3 s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    wait(procs, 3)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
