"""A message no receive takes is an error, never exit 0 with the wrong numbers.

The drill (tests/scripts/stale.py): rank 0 sends 1.0, then 2.0, with tag 7; rank 1 forgets the
first receive and takes 1.0 for 2.0. Nothing at that receive tells it from a right one; at the
end of the program the message left over is named (comm/leftovers.py): on mpi by the receiver,
which takes what waits for it once every peer has said it is done; on gloo by the sender, whose
send never met a receive. Debug mode (CheckedComm) names it at the next collective, with its
tag and number, and sees receives posted under another tag than the messages sent.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minidist.comm.checked import CheckedComm
from minidist.testing import run_threads

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.processes
@pytest.mark.parametrize("backend,send", [("mpi", "send"), ("gloo", "isend")])
def test_a_message_left_unreceived_fails_the_job_naming_it(backend, send):
    cmd = [sys.executable, "-m", "minidist.cli", "run", "-n", "2", "--backend", backend]
    out = subprocess.run(
        [*cmd, str(SCRIPTS / "stale.py"), send], capture_output=True, text=True, timeout=120
    )
    text = out.stdout + out.stderr
    finder = 1 if backend == "mpi" else 0  # the receiver sees it on mpi, the sender on gloo
    assert "rank 1 got 1.0" in text  # the wrong number, as before ...
    assert out.returncode == 1, text  # ... but not exit 0
    assert f"minidist run: rank {finder} found messages never received at its exit" in text
    assert f"never received, found at exit ({backend}):\n  rank 0 -> rank 1, tag 7: " in text
    assert "1 x torch.float32" in text


def receives_under_another_tag(comm):
    """Rank 0 sends with tag 7, rank 1 posts its receive with tag 8: as many messages as
    receives, yet the next collective must name both tags."""
    checked = CheckedComm(comm)
    if comm.rank == 0:
        checked.isend(torch.ones(2), 1, tag=7)
    else:
        checked.irecv(torch.zeros(2), 0, tag=8)
    checked.barrier()


@pytest.mark.threads
def test_debug_mode_names_the_tag_and_the_message_by_number():
    with pytest.raises(AssertionError) as e:
        run_threads(receives_under_another_tag, 2, timeout=20, sends="buffered")
    text = str(e.value)
    assert "before collective #1 (barrier()) on threads: " in text, text
    assert (
        "rank 0 sent rank 1 1 messages with tag 7, rank 1 posted 0 receives with tag 7 from "
        "rank 0: message #1 is not received" in text
    ), text
    assert (
        "rank 0 sent rank 1 0 messages with tag 8, rank 1 posted 1 receives with tag 8 from "
        "rank 0: receive #1 has no message sent before this collective" in text
    ), text
