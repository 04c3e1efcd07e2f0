"""Misuse of the comm never gives wrong numbers: mismatched collectives and messages are errors.

Each backend runs every drill inside one start of its ranks (3 of them): a collective whose
shape, dtype, op or kind differs on one rank; a message whose dtype or size differs from the
receive buffer (alone and inside ring_all_reduce); a receive from self; debug mode around an
exchange where both sides send first, and a message that debug mode finds left unreceived.
Two ranks in different hand-written collectives (each has its own tag) time out naming both.
The rendezvous: bound to the address given, a taken port refused at once.
Every rank reports what it saw, and the test checks each rank's words; a correct all-reduce
after the drills shows the comm is still in step. A hang fails in seconds (short timeouts).
"""

from __future__ import annotations

import datetime
import re

import pytest
import torch

from minidist.comm import frames, torchdist
from minidist.comm.agreement import signature
from minidist.comm.protocol import CommError
from minidist.launch.init import _torch_env
from minidist.testing import impl, run_ranks

BACKENDS = ["threads", "mpi", "gloo"]


def attempt(fn) -> str:
    """'ok' if fn() returns, else the error's type and text."""
    try:
        fn()
        return "ok"
    except CommError as e:
        return f"{type(e).__name__}: {e}"


def collective_drills(comm) -> dict[str, str]:
    """The library's collectives, each called with one rank out of step."""
    r, p = comm.rank, comm.world_size
    f32, f64 = torch.float32, torch.float64
    return {
        "shape": attempt(lambda: comm.all_reduce(torch.ones(4 if r == 0 else 5))),
        "dtype": attempt(lambda: comm.all_reduce(torch.ones(4, dtype=f32 if r == 0 else f64))),
        "op": attempt(lambda: comm.all_reduce(torch.ones(2), "sum" if r != 2 else "max")),
        "kind": attempt(
            lambda: (
                comm.all_gather(torch.empty(2 * p), torch.ones(2))
                if r == 1
                else comm.all_reduce(torch.ones(2))
            )
        ),
        "broadcast root": attempt(lambda: comm.broadcast(torch.ones(3), int(r == 0))),
    }


BULK = frames.BULK_BYTES // 4  # float32 elements from which gloo sends a bulk beside the frame


def message_drills(comm) -> dict[str, str]:
    """Messages between ranks 0 and 1 (on a comm of their own) whose buffers disagree."""
    pair = comm.split(int(comm.rank < 2))
    seen = {}
    cases = [
        ("int32 into float32", torch.ones(4, dtype=torch.int32), torch.zeros(4)),
        ("4 into 6", torch.ones(4), torch.zeros(6)),
        ("6 into 4", torch.ones(6), torch.zeros(4)),
        # 1 MiB and more: gloo sends the bulk beside the frame, straight from and into storage
        ("bulk n into n + 1", torch.ones(BULK + 1), torch.zeros(BULK + 2)),
    ]
    if comm.backend == "gloo":  # (an MPI send this large waits for a receive of its dtype)
        cases.append(
            (
                "bulk int32 into float32",
                torch.ones(BULK + 1, dtype=torch.int32),
                torch.zeros(BULK + 1),
            )
        )
    for name, send, recv in cases:
        sub = pair.split(0)  # a fresh comm per case: an unmatched message stays behind
        if comm.rank == 0:
            seen[name] = attempt(lambda sub=sub, send=send: sub.send(send, 1))
        elif comm.rank == 1:
            seen[name] = attempt(lambda sub=sub, recv=recv: sub.recv(recv, 0))
    sub = pair.split(0)  # an odd size, both sides transposed (not contiguous): bulk, then rest
    cols = BULK // 3 + 1  # 3 cols floats: the bulk, then 8 bytes more
    sent = torch.arange(3.0 * cols).reshape(3, cols).t()
    got = torch.zeros(3, cols).t()
    if comm.rank == 0:
        seen["bulk exact"] = attempt(lambda: sub.send(sent, 1))
    elif comm.rank == 1:
        ok = attempt(lambda: sub.recv(got, 0))
        seen["bulk exact"] = ok if ok != "ok" or torch.equal(got, sent) else f"wrong: {got[:2]}"
    ring = impl("collectives.algorithms").ring_all_reduce
    sub = pair.split(0)
    if comm.rank < 2:  # the same byte size, another dtype on rank 0; then another length
        x = torch.ones(256, dtype=torch.int32 if comm.rank == 0 else torch.float32)
        seen["ring dtype"] = attempt(lambda: ring(x, sub))
        sub = pair.split(0)
        seen["ring shape"] = attempt(lambda: ring(torch.ones(8 if comm.rank == 0 else 10), sub))
        sub = pair.split(0)
        # on gloo sizes this far apart do not match: the receiver's timeout explains. The sender
        # waits longer: Gloo closes a timed-out connection, which would cut the receiver short
        sub.timeout = 1.0 if comm.rank == 1 else 3.0
        if comm.rank == 0:
            seen["4 into 40"] = attempt(lambda: sub.send(torch.ones(4), 1))
        else:
            seen["4 into 40"] = attempt(lambda: sub.recv(torch.zeros(40), 0))
    comm.barrier()
    seen["recv from self"] = attempt(lambda: comm.recv(torch.zeros(2), comm.rank, tag=9))
    return seen


def debug_drills(comm) -> dict[str, str]:
    """Debug mode: a ring where both sides send first must not hang; a message nobody
    receives is named at the next collective."""
    # a comm of their own: MPICH may kill a rank at exit when a message on the world comm was
    # never received
    checked = impl("comm.checked").CheckedComm(comm.split(0))
    x = torch.arange(3000.0) + comm.rank  # 12 KB: above MPI's eager limit, a rendezvous send
    impl("collectives.algorithms").ring_all_reduce(x, checked)
    p = comm.world_size
    ring_ok = torch.equal(x, p * torch.arange(3000.0) + sum(range(p)))
    # rank 1 forgets to receive before the barrier (a non-blocking send: Gloo's would wait)
    late = checked.isend(torch.ones(2), 1, tag=4) if comm.rank == 0 else None
    stale = attempt(checked.barrier)
    if comm.rank == 1:
        checked.recv(torch.zeros(2), 0, tag=4)  # received after all: the next step is clean
    if late is not None:
        late.wait()
    checked.barrier()
    return {"ring under debug mode": "ok" if ring_ok else f"wrong: {x[:4]}", "stale": stale}


def plan_drills(comm) -> dict[str, str]:
    """A comm that trusts a plan (agreement.trust, mpi and gloo): plans that differ are refused
    on every rank; a call off the plan is refused on its rank; calls on it sum right."""
    r, p = comm.rank, comm.world_size
    four, five = signature("all_reduce", torch.ones(4), op="sum"), "all_reduce(other)"
    seen = {"plans differ": attempt(lambda: comm.split(0).trust([four if r else five]))}
    own = comm.split(0)
    own.trust([four, four])
    x = torch.ones(4)
    own.all_reduce(x)
    seen["off the plan"] = attempt(lambda: own.all_reduce(torch.ones(5)))
    own.all_reduce(x)  # the plan's second call: still in step
    seen["on the plan"] = "ok" if torch.equal(x, torch.full((4,), float(p * p))) else f"{x}"
    return seen


def all_drills(comm) -> dict[str, str]:
    comm.timeout = 10.0  # a drill that hangs fails in seconds, not minutes
    seen = collective_drills(comm) | message_drills(comm) | debug_drills(comm)
    if hasattr(comm, "trust"):
        seen |= plan_drills(comm)
    x = torch.full((5,), float(comm.rank))
    comm.all_reduce(x)  # still in step after every error above
    seen["after"] = "ok" if torch.equal(x, torch.full((5,), 3.0)) else f"wrong: {x}"
    return seen


@pytest.mark.processes
@pytest.mark.parametrize("backend", BACKENDS)
def test_misuse_is_an_error_never_wrong_numbers(backend):
    seen = run_ranks(all_drills, 3, backend, timeout=90)
    for r, s in enumerate(seen):
        for name in ("shape", "dtype", "op", "kind", "broadcast root"):
            assert s[name].startswith("CollectiveMismatch: collective #"), (r, name, s[name])
        assert "rank 0: all_reduce(shape=(4,), float32, op=sum)" in s["shape"]
        assert "ranks [1, 2]: all_reduce(shape=(5,), float32, op=sum)" in s["shape"]
        assert "ranks [1, 2]: all_reduce(shape=(4,), float64, op=sum)" in s["dtype"]
        assert "rank 2: all_reduce(shape=(2,), float32, op=max)" in s["op"]
        assert "rank 1: all_gather(shape=(2,), float32)" in s["kind"]
        assert "rank 0: broadcast(shape=(3,), float32, src=1)" in s["broadcast root"]
        assert s["recv from self"].startswith("CommError: ") and "from self" in s["recv from self"]
        assert s["ring under debug mode"] == "ok" and s["after"] == "ok", (r, s)
        tag4 = r"rank 0 sent rank 1 (\d+) messages with tag 4, rank 1 posted (\d+) receives"
        stale = re.search(tag4 + r" with tag 4 from rank 0: message #(\d+) is not", s["stale"])
        assert stale and int(stale[1]) == int(stale[2]) + 1 == int(stale[3]), s["stale"]
        if backend != "threads":  # threads checks every call at its meeting point: no plans
            assert s["plans differ"].startswith("CollectiveMismatch: collective #"), s
            assert "trust(1 collectives, sha1 " in s["plans differ"], s["plans differ"]
            off = "called all_reduce(shape=(5,), float32, op=sum) where the agreed plan expects "
            assert (
                off + "all_reduce(shape=(4,), float32, op=sum) (call 1 of its 2)"
                in (s["off the plan"])
            ), s["off the plan"]
            assert s["on the plan"] == "ok", s
    receiver = seen[1]
    assert "int32" in receiver["int32 into float32"] and "float32" in receiver["int32 into float32"]
    n = BULK + 1
    bulk = receiver.get("bulk int32 into float32", f"{n} x torch.int32 {n} x torch.float32")
    assert f"{n} x torch.int32" in bulk and f"{n} x torch.float32" in bulk, bulk
    bigger = receiver["bulk n into n + 1"]
    assert f"{n + 1} x torch.float32" in bigger, bigger
    for name in ("int32 into float32", "4 into 6", "6 into 4", "bulk n into n + 1"):
        assert receiver[name].startswith("CommError: rank 1 of 2"), (name, receiver[name])
    assert seen[0]["bulk exact"] == seen[1]["bulk exact"] == "ok", (seen[0], seen[1])
    far = receiver["4 into 40"]
    if backend == "gloo":
        assert far.startswith("CommTimeout: rank 1 of 2 (gloo): recv(tag=0)"), far
        assert "(expects 40 x torch.float32; far other sizes never match)" in far
    else:
        assert far.startswith("CommError: rank 1 of 2"), far
    for r in (0, 1):  # in the ring each of the two ranks receives the other's mismatch
        assert seen[r]["ring dtype"].startswith("CommError: rank"), seen[r]["ring dtype"]
        assert "int32" in seen[r]["ring dtype"] and "float32" in seen[r]["ring dtype"]
        assert seen[r]["ring shape"].startswith("CommError: rank"), seen[r]["ring shape"]


def different_collectives(comm) -> dict[str, str]:
    """Rank 0 and rank 1 in two hand-written collectives (or one with two reduction ops) whose
    messages would fit each other's buffers: each collective's messages carry its own tag, so
    nothing matches and each rank times out (in 2 s) naming its collective and, where the
    backend sees it, the other one."""
    coll = impl("collectives.algorithms")
    drills = {
        "ring_all_reduce(sum) / ring_all_gather": (
            lambda c: coll.ring_all_reduce(torch.ones(4), c),
            lambda c: coll.ring_all_gather(torch.empty(4), torch.ones(2), c),
        ),
        "recursive_doubling_all_reduce(sum) / ring_all_reduce(sum)": (
            lambda c: coll.recursive_doubling_all_reduce(torch.ones(4), c),
            lambda c: coll.ring_all_reduce(torch.ones(4), c),
        ),
        "ring_all_reduce(sum) / ring_all_reduce(max)": (
            lambda c: coll.ring_all_reduce(torch.ones(4), c, "sum"),
            lambda c: coll.ring_all_reduce(torch.ones(4), c, "max"),
        ),
    }
    seen = {}
    for name, calls in drills.items():
        sub = comm.split(0)  # a fresh comm per drill: the unmatched messages stay behind
        sub.timeout = 2.0
        seen[name] = attempt(lambda sub=sub, calls=calls: calls[comm.rank](sub))
    return seen


def check_different_collectives(seen: list[dict[str, str]], backend: str) -> None:
    for name in seen[0]:
        names = name.split(" / ")
        for r in (0, 1):
            mine, other = names[r], names[1 - r]
            error = seen[r][name]
            if backend == "threads":  # the world sees both ranks wait: no timeout needed
                assert error.startswith("Deadlock: deadlock: all 2 live ranks wait"), error
                mine_line = error.split(f"\n  rank {r} waits in ")[1].split("\n")[0]
                assert f"; waiting in {mine};" in mine_line, error
                assert f"rank {1 - r} sent this rank " in mine_line, error
                assert f" from {other}," in mine_line, error
                assert "; the ranks called different collectives" in mine_line, error
                continue
            assert error.startswith(f"CommTimeout: rank {r} of 2 ({backend}): "), error
            assert f"; waiting in {mine};" in error, error
            if backend == "gloo":
                assert f"this backend cannot see what rank {1 - r} sent instead" in error, error
            else:
                assert f"rank {1 - r} sent this rank " in error and f" from {other}," in error
                assert error.endswith("; the ranks called different collectives"), error


@pytest.mark.threads
def test_different_hand_written_collectives_deadlock_naming_both():
    seen = run_ranks(different_collectives, 2, "threads", allow_unreceived=True)  # drills
    check_different_collectives(seen, "threads")


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_different_hand_written_collectives_time_out_naming_both_processes(backend):
    seen = run_ranks(different_collectives, 2, backend, timeout=60)
    check_different_collectives(seen, backend)


def listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


@pytest.mark.pure
def test_rendezvous_binds_the_given_address_and_refuses_a_taken_port():
    wait = datetime.timedelta(seconds=5)
    store = torchdist._store(0, 1, "127.0.0.1", 0, wait)  # port 0: the OS picks one
    assert listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1 only, not 0.0.0.0
    with pytest.raises(CommError, match=f"cannot serve the rendezvous at 127.0.0.1:{store.port}"):
        torchdist.init_process_group("gloo", 0, 2, "127.0.0.1", store.port, 1.0)
    with pytest.raises(ValueError, match="MASTER_PORT is not set: the 2 ranks need a free port"):
        _torch_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    assert _torch_env({"RANK": "0", "WORLD_SIZE": "1"})[3] == 0  # a world of one: any free port
