"""Messages left unreceived at the end of a program: found at exit, named, and the exit code 1.

A message no receive takes hides a bug: the run ends with exit code 0, or a later receive with
the same tag takes it in place of the message meant for it (rank 0 sends 1.0, then 2.0; rank 1
forgets the first receive and computes with 1.0). Once a rank's program has ended, no receive
of its will ever take anything: what is still waiting for it, or what it still waits to hand
over, was never received. What each backend can see then:

- mpi, the receiver: at exit every rank sends every other rank one empty message on COMM_WORLD
  with EXIT_TAG, a tag no user message has, and waits to hear from all (MPI_Finalize waits for
  all ranks anyway). Messages from one rank to another do not overtake each other, so once a
  rank has heard from a peer, everything that peer sent it has arrived: whatever waits on any
  of its comms (MPI_Improbe, ANY_SOURCE and ANY_TAG) was never received. It takes each one
  (MPI_Mrecv: a peer blocked in a large send goes free) and names it. Cost: 2(p-1) empty
  messages per rank, once, at exit.
- gloo, nccl, the sender: a Gloo send completes only once its receive is posted. A send still
  pending when its rank ends (an isend never waited for) is given EXIT_WAIT seconds (the
  comm's timeout if shorter) to complete; one that fails or does not complete was never
  received, and it would be lost with this process in any case. The receiver sees nothing.
- threads: the world sees every mailbox (ThreadsWorld.unreceived; `minidist run` and the test
  harness fail the run).
On every backend, a message to self still kept (SelfMessages) was never received either.

The comms looked at are those still alive at exit (after a garbage collection): a comm a
program dropped takes its messages with it. Found messages are printed, one line each, as the
threads world prints them; written to rank{r}.unreceived in `minidist run`'s folder (the
launcher reads it when the job has ended: launch/launcher.py); and the process ends with exit code
1. A program that abandons messages on purpose (a parameter server that drops a worker mid-request
never reads its gradient) sets MINIDIST_UNRECEIVED=allow: they are printed, and that is all.

    [rank 1] 1 message(s) sent but never received, found at exit (mpi):
    [rank 1]   rank 0 -> rank 1, tag 7: 1 x torch.float32
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
import weakref

from .protocol import DTYPES, dtype_name
from .tagged import label

EXIT_WAIT = 2.0  # seconds a pending Gloo send gets at exit to meet its receive
_comms: weakref.WeakSet = weakref.WeakSet()  # every mpi and gloo comm alive: see watch


def watch(comm) -> None:
    """Look at comm's messages when this process ends. Registers the exit check (once: it is
    taken off and put back, so that it runs before what was registered earlier, e.g. MPI's
    finalize and torchdist.close_all, which both need the comms whole)."""
    _comms.add(comm)
    atexit.unregister(check_at_exit)
    atexit.register(check_at_exit)


def check_at_exit() -> None:
    """The exit check: report what no receive took (check), and end with exit code 1 if
    anything was found, unless MINIDIST_UNRECEIVED=allow."""
    backend = check()
    if backend is None or os.environ.get("MINIDIST_UNRECEIVED") == "allow":
        return
    if backend == "mpi":
        from mpi4py import MPI

        MPI.Finalize()  # the others wait for this rank in theirs
    os._exit(1)  # the exit code; nothing left to run that needs the comms


def check() -> str | None:
    """Find what no receive took on the comms alive, as at the end of a program, and report it:
    printed, and left in `minidist run`'s folder unless MINIDIST_UNRECEIVED=allow. The backend's
    name if anything was found, else None. What is reported is forgotten (an mpi message taken,
    a gloo send or a message to self dropped): no later check names it again. Collective on mpi
    (each rank hears from every other). Run at exit, and by a pool of ranks (launch/pool.py)
    after each of its jobs, each of which ends as a program does."""
    gc.collect()  # comms the program dropped (and their messages) go first
    comms = list(_comms)
    if not comms:
        return None
    backend = comms[0].backend
    found = _mpi_leftovers(comms) if backend == "mpi" else _gloo_leftovers(comms)
    found += [line for comm in comms for line in _self_leftovers(comm)]
    if not found:
        return None
    rank = _world_rank(comms[0], comms[0].rank)
    text = f"{len(found)} message(s) sent but never received, found at exit ({backend}):\n"
    text += "".join(f"  {line}\n" for line in found)
    sys.stdout.flush()
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    sys.stderr.flush()
    folder = os.environ.get("MINIDIST_FAILURE_DIR")
    if folder and os.environ.get("MINIDIST_UNRECEIVED") != "allow":
        # minidist run: its launcher reads this when the job has ended
        path = os.path.join(folder, f"rank{rank}.unreceived")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    return backend


def _world_rank(comm, rank: int) -> int:
    ranks = getattr(comm, "world_ranks", None)  # mpi: each rank's rank in COMM_WORLD
    if ranks is not None:
        return ranks[rank]
    return comm._global(rank) if hasattr(comm, "_global") else rank


def _line(src: int, dst: int, tag: int, what: str, why: str = "") -> str:
    return f"rank {src} -> rank {dst}, {label(tag).removeprefix('with ')}: {what}{why}"


def _mpi_leftovers(comms) -> list[str]:
    """Every message waiting for this rank on any of comms, taken, one line each (see the
    module docstring: first hear from every peer that it is done)."""
    from mpi4py import MPI

    # the mpi backend's tag encoding, read from its comm: leftovers is imported by mpi.py
    codes = comms[0].codes
    exit_tag = comms[0].exit_tag

    world = MPI.COMM_WORLD
    peers = [r for r in range(world.Get_size()) if r != world.Get_rank()]
    done = [bytearray(1) for _ in peers]
    hear = [world.Irecv([buf, MPI.BYTE], r, exit_tag) for buf, r in zip(done, peers, strict=True)]
    tell = [world.Isend([b"", MPI.BYTE], r, exit_tag) for r in peers]
    unique = {comm.mpi_comm.py2f(): comm for comm in comms}  # a comm wrapped twice: once
    found: list[str] = []
    deadline = time.monotonic() + max(comm.timeout for comm in comms)  # finalize would wait too
    while True:
        heard = MPI.Request.Testall(hear)
        for comm in unique.values():  # taken while waiting too: a blocked sender goes free
            found += _take_all(comm, codes)
        if heard:
            break
        if time.monotonic() > deadline:  # a peer still busy: what was found stands
            for request in hear:
                request.Cancel()
            MPI.Request.Waitall(hear)  # a cancelled receive completes at once
            break
        time.sleep(0.001)
    MPI.Request.Waitall(tell)
    return found


def _take_all(comm, codes: int) -> list[str]:
    """Receive every message waiting on comm (MPI); one line each."""
    from mpi4py import MPI

    lines, status = [], MPI.Status()
    while True:
        message = comm.mpi_comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
        if message is None:
            return lines
        nbytes = status.Get_count(MPI.BYTE)
        message.Recv([bytearray(max(1, nbytes)), MPI.BYTE])
        tag, code = divmod(status.Get_tag(), codes)
        size = DTYPES[code].itemsize if code < len(DTYPES) else 1
        src, dst = comm.world_ranks[status.Get_source()], comm.world_ranks[comm.rank]
        lines.append(_line(src, dst, tag, f"{nbytes // size} x {dtype_name(code)}"))


def _gloo_leftovers(comms) -> list[str]:
    """Every send of this rank still pending, given EXIT_WAIT seconds; one line for each that
    fails or does not complete (torch.distributed: the sender's view)."""
    found = []
    for comm in comms:
        comm.timeout = min(comm.timeout, EXIT_WAIT)
        pending = [w for w in comm.sending if not w.done]
        comm.sending = []  # each completes below, or is named: either way no longer pending
        for work in pending:
            try:
                work.wait()
                continue
            except Exception as e:  # a timeout, or the peer ended (its words, not Gloo's)
                text = str(e).split(" failed: ", 1)[-1].split(": [", 1)[0]
                late = f"no receive within {comm.timeout:g}s of this rank's end"
                why = f" ({late if 'timed out' in text else text})"
            numel, dtype = work.holds
            src, dst = _world_rank(comm, comm.rank), _world_rank(comm, work.peer)
            found.append(_line(src, dst, work.tag, f"{numel} x {dtype}", why))
    return found


def _self_leftovers(comm) -> list[str]:
    """Messages this rank sent itself that no receive took."""
    me = _world_rank(comm, comm.rank)
    lines = [
        _line(me, me, tag, f"{t.numel()} x {t.dtype}")
        for tag, box in sorted(comm.to_self.boxes.items())
        for t in box
    ]
    comm.to_self.boxes.clear()  # named: forgotten
    return lines
