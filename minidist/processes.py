"""The launcher's processes: each rank (or mpiexec) in a process group of its own, dying with
the launcher, stopped as a whole.

A rank that outlived its launcher would hold its port, its share of the cores and its peers'
connections, and the next job would meet it. So `start` makes every child the leader of a new
process group (all it starts, mpiexec's ranks too, can be signalled at once) and, on Linux, asks
the kernel to send it SIGTERM when the launcher dies (PR_SET_PDEATHSIG, however the launcher
ends); `stop` sends each group SIGTERM, then SIGKILL after 3 s; `exit_on_sigterm` turns the
launcher's own SIGTERM into SystemExit, so its `finally` runs `stop`. Used by launch.py only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time


def exit_on_sigterm():
    """Turn SIGTERM into SystemExit(143) while launching, so the `finally` stops the ranks and
    removes the launcher's folder; the old handler (None off the main thread, where Python
    allows no handler)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def start(cmd: list[str], env: dict) -> subprocess.Popen:
    """Start a rank (or mpiexec) in its own process group, so it can be stopped as a whole,
    and (on Linux) have it receive SIGTERM if this launcher dies: no orphaned ranks."""
    return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)


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
