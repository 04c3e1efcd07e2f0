"""The comm layer: point-to-point and library collectives on every backend, exactly.

Every rank rebuilds every rank's input from one seed (integer-valued, so sums are exact in every
dtype), computes the expected result itself, and the verdict is combined across ranks. The
threads tier draws world sizes 1..8; the process tier starts 4 processes once per test and
runs fixed cases (every dtype) on 3 and 4 of them by splitting the world.
"""

from __future__ import annotations

import collections
import json
import threading
import time

import pytest
import torch
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from minidist.comm import frames
from minidist.comm.protocol import MAX_TAG, OPS, CollectiveMismatch, CommError
from minidist.comm.tagged import TAGS, tagged
from minidist.comm.threads import ThreadsWorld
from minidist.comm.torchdist import init_process_group
from minidist.comm.wrappers import Counter, ObservedComm, Tracer, write_chrome_trace
from minidist.testing import (
    DTYPES,
    RANK_SETTINGS,
    all_dtypes,
    check_all,
    impl,
    integer_valued,
    ops,
    run_ranks,
    run_threads,
    seeds,
    shapes,
    verdict,
)

# ---- what every rank computes: the expected results, built without the comm ---------------


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (a transposed copy, transposed back)."""
    if t.dim() < 2 or t.numel() == 0:
        return t
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def inputs(shape, dtype, seed, p) -> list[torch.Tensor]:
    return [integer_valued(shape, dtype, seed, rank=r) for r in range(p)]


def expected_reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of all ranks' tensors, computed exactly in float64 (or as integers)."""
    dtype = xs[0].dtype
    wide = torch.stack([x.to(torch.float64) for x in xs])  # (p, ...) small integers: exact
    if op in ("sum", "avg"):
        out = wide.sum(0)
    elif op == "max":
        out = wide.amax(0) if wide.numel() else wide.sum(0)
    else:
        out = wide.amin(0) if wide.numel() else wide.sum(0)
    if dtype == torch.bool:
        return out.bool()  # sum and max: any rank True; min: all ranks True
    out = out.to(dtype)  # an exact integer sum in every dtype
    return out / len(xs) if op == "avg" else out  # one division, as every backend does


def valid(op: str, dtype: torch.dtype) -> bool:
    return op != "avg" or dtype.is_floating_point


# ---- the property functions, run on every rank of any backend -------------------------------


def p2p_ring(comm, shape, dtype, seed, blocking: bool, device="cpu") -> None:
    """Each rank sends its tensor to the right and receives the left one's; non-contiguous."""
    p, r = comm.world_size, comm.rank
    mine = strided(integer_valued(shape, dtype, seed, rank=r).to(device))
    got = strided(torch.zeros(shape, dtype=dtype, device=device))
    right, left = (r + 1) % p, (r - 1) % p
    if blocking and p > 1:
        # even ranks send first: with blocking rendezvous sends the other order deadlocks
        if r % 2 == 0:
            comm.send(mine, right)
            comm.recv(got, left)
        else:
            comm.recv(got, left)
            comm.send(mine, right)
    else:
        recv = comm.irecv(got, left, tag=3)
        send = comm.isend(mine, right, tag=3)
        send.wait()
        recv.wait()
    want = integer_valued(shape, dtype, seed, rank=left)
    check_all(comm, {f"recv from {left}": (got, want)}, context=f"p2p {shape} {dtype}")


def collectives_once(comm, shape, dtype, op, seed, device="cpu") -> None:
    """all_reduce, reduce_scatter, all_gather, broadcast (blocking and async) vs expected."""
    p, r = comm.world_size, comm.rank
    xs = [x.to(device) for x in inputs(shape, dtype, seed, p)]
    checks = {}
    if valid(op, dtype):
        t = strided(xs[r].clone())
        comm.all_reduce(t, op)
        checks["all_reduce"] = (t, expected_reduce(xs, op))
        t2 = xs[r].clone()
        comm.iall_reduce(t2, op).wait()
        checks["iall_reduce"] = (t2, expected_reduce(xs, op))
        big = [b.to(device) for b in inputs((p, *shape), dtype, seed + 1, p)]  # p chunks each
        out = torch.empty(shape, dtype=dtype, device=device)
        comm.reduce_scatter(out, strided(big[r]), op)
        checks["reduce_scatter"] = (out, expected_reduce([b[r] for b in big], op))
    gathered = strided(torch.empty((p, *shape), dtype=dtype, device=device))
    comm.iall_gather(gathered, strided(xs[r])).wait()
    checks["all_gather"] = (gathered, torch.stack(xs))
    src = seed % p
    b = xs[r].clone()
    comm.broadcast(b, src)
    checks[f"broadcast from {src}"] = (b, xs[src])
    check_all(comm, checks, context=f"{shape} {dtype} op={op}")


# ---- tier 1: threads --------------------------------------------------------------------


@pytest.mark.threads
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), shapes(), all_dtypes, seeds, st.booleans())
def test_p2p_ring_threads(p, shape, dtype, seed, blocking):
    run_threads(p2p_ring, p, shape, dtype, seed, blocking)


@pytest.mark.threads
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), shapes(), all_dtypes, ops, seeds)
def test_collectives_threads(p, shape, dtype, op, seed):
    run_threads(collectives_once, p, shape, dtype, op, seed)


def split_groups(comm, k: int) -> list:
    sub = comm.split(comm.rank % k)
    x = torch.tensor([float(comm.rank)])
    sub.all_reduce(x)
    return [sub.rank, sub.world_size, x.item()]


@pytest.mark.threads
@pytest.mark.parametrize("p,k", [(1, 1), (4, 2), (6, 3), (5, 2)])
def test_split_threads(p, k):
    got = run_threads(split_groups, p, k)
    for r, (sub_rank, sub_size, total) in enumerate(got):
        members = [q for q in range(p) if q % k == r % k]
        assert (sub_rank, sub_size, total) == (members.index(r), len(members), sum(members))


def bad_inputs(comm) -> list[str]:
    errors = []
    for call in (
        lambda: comm.send(torch.zeros(1), comm.world_size),
        lambda: comm.recv(torch.zeros(1), -1),
        lambda: comm.all_reduce(torch.zeros(2, dtype=torch.int64), "avg"),
        lambda: comm.all_reduce(torch.zeros(2), "product"),
        lambda: comm.all_gather(torch.zeros(5), torch.zeros(2)),
        lambda: comm.reduce_scatter(torch.zeros(2), torch.zeros(7)),
        lambda: comm.broadcast(torch.zeros(2), 9),
    ):
        with pytest.raises(ValueError) as e:
            call()
        errors.append(str(e.value))
    return errors


@pytest.mark.pure
def test_bad_world_and_rank_are_refused():
    with pytest.raises(ValueError, match="world_size=0 must be at least 1"):
        ThreadsWorld(0)
    with pytest.raises(ValueError, match="rank=4 is out of range for world_size=4"):
        ThreadsWorld(4).comm(4)
    with pytest.raises(ValueError, match="rank=2 is out of range for world_size=2"):
        init_process_group("gloo", 2, 2, "127.0.0.1", 1, 1.0)
    with pytest.raises(ValueError, match="backend='mpi' is not 'gloo' or 'nccl'"):
        init_process_group("mpi", 0, 2, "127.0.0.1", 1, 1.0)


@pytest.mark.pure
def test_gloo_frames_and_bulks_never_share_a_wire_tag():
    """A frame's tag carries its size class, a bulk's its exact size, in disjoint codes: Gloo
    aborts on a message larger than its buffer, so a bulk must only ever meet its own size."""
    big = frames.BULK_BYTES
    sizes = [0, 1, 1000, big - 1, big, big + 4, big + 80004, 1 << 26, (1 << 40) + 3]
    assert [frames.bulk_bytes(n) for n in sizes[:4]] == [0, 0, 0, 0]
    for n in sizes[4:]:
        bulk = frames.bulk_bytes(n)
        assert bulk <= n < 2 * bulk and bulk & (bulk - 1) == 0, (n, bulk)
    frame_codes = {
        frames.frame_tag(0, frames.HEADER_BYTES + n - frames.bulk_bytes(n)) for n in sizes
    }
    bulk_codes = {frames.bulk_tag(0, frames.bulk_bytes(n)) for n in sizes[4:]}
    assert max(frame_codes) < frames.BULK <= min(bulk_codes) and max(bulk_codes) < frames.CODES
    assert frames.bulk_tag(MAX_TAG - 1, 1 << 63) == 2**31 - 1  # the largest tag torch takes


@pytest.mark.threads
def test_bad_input_names_the_numbers():
    msgs = run_threads(bad_inputs, 3)[0]
    assert "dst=3 is out of range for world_size=3" in msgs[0]
    assert "src=-1 is out of range" in msgs[1]
    assert "op='avg' needs a floating dtype, got torch.int64" in msgs[2]
    assert "op='product' is not one of" in msgs[3]
    assert "out.numel()=5 must be world_size=3 x 2" in msgs[4]
    assert "inp.numel()=7 must be world_size=3 x 2" in msgs[5]
    assert "src=9 is out of range" in msgs[6]


def recv_nobody_sends(comm):
    comm.timeout = 0.5
    if comm.rank == 1:
        comm.recv(torch.zeros(3), 0)
    else:
        time.sleep(1.0)  # busy elsewhere, not blocked in the comm: only the timeout can tell


def collective_one_rank_skips(comm):
    comm.timeout = 0.5
    if comm.rank != 2:
        comm.all_reduce(torch.zeros(3))
    else:
        time.sleep(1.0)


def mismatched_collectives(comm):
    if comm.rank == 1:
        comm.all_gather(torch.zeros(6), torch.zeros(2))
    else:
        comm.all_reduce(torch.zeros(2))


@pytest.mark.threads
def test_timeout_names_rank_op_sequence_and_peer():
    with pytest.raises(AssertionError) as e:
        run_threads(recv_nobody_sends, 2, timeout=20)
    text = "CommTimeout: rank 1 of 2 (threads): recv(tag=0) #1 with peer 0 timed out"
    assert text in str(e.value)
    with pytest.raises(AssertionError) as e:
        run_threads(collective_one_rank_skips, 3, timeout=20)
    assert "all_reduce #1 waiting for ranks [2] timed out after 0.5s" in str(e.value)


@pytest.mark.threads
def test_threads_detect_mismatched_collectives():
    with pytest.raises(AssertionError) as e:
        run_threads(mismatched_collectives, 3, timeout=20)
    text = str(e.value)
    assert "CollectiveMismatch" in text
    assert "ranks [0, 2]: all_reduce(shape=(2,), float32, op=sum)" in text
    assert "rank 1: all_gather(shape=(2,), float32)" in text


def hangs_on_purpose(comm):
    if comm.rank == 0:
        comm.recv(torch.zeros(1), 1)  # rank 1 never sends
    else:
        time.sleep(3.0)  # and is not blocked in the comm: no detector can see it


@pytest.mark.threads
def test_harness_turns_a_hang_into_a_failure_naming_ranks():
    with pytest.raises(AssertionError, match=r"ranks still running: \[0, 1\]"):
        run_threads(hangs_on_purpose, 2, timeout=1.0, comm_timeout=30)


@pytest.mark.threads
def test_tagged_view_gives_its_tag_to_untagged_messages():
    world = ThreadsWorld(2)
    comm, peer = world.comm(0), world.comm(1)
    view = tagged(tagged(comm, 3), 7)  # a view of a view: of the comm itself, tag 7
    assert view.inner is comm and (view.rank, view.world_size, view.backend) == (0, 2, "threads")
    view.send(torch.tensor([1.0]), 1)
    view.isend(torch.tensor([2.0]), 1, tag=4).wait()  # a tag given is the caller's
    assert peer.recv(torch.zeros(1), 0, tag=4).item() == 2.0
    assert peer.recv(torch.zeros(1), 0, tag=7).item() == 1.0
    assert len(set(TAGS.values())) == len(TAGS) and min(TAGS.values()) > 1000  # clear of users'


def user_message_around_a_ring(comm):
    """A user message (tag 0) of one ring chunk's size, sent before ring_all_reduce and
    received after it: with one tag for both, the ring would take it as its first chunk."""
    r, p = comm.rank, comm.world_size
    sent = comm.isend(torch.tensor([100.0 + r]), (r + 1) % p)
    x = torch.full((p,), float(r))  # p elements: chunks of one, as large as the message
    impl("collectives.algorithms").ring_all_reduce(x, comm)
    got = comm.recv(torch.zeros(1), (r - 1) % p)
    sent.wait()
    return x.tolist(), got.item()


@pytest.mark.threads
def test_a_user_message_never_lands_in_a_collective():
    p = 3
    for r, (x, got) in enumerate(run_threads(user_message_around_a_ring, p, timeout=20)):
        assert x == [float(sum(range(p)))] * p and got == 100.0 + (r - 1) % p, (r, x, got)


def one_rank_disagrees(comm):
    verdict(comm, comm.rank != 2, f"rank-local detail {comm.rank}")


@pytest.mark.threads
def test_verdict_fails_every_rank_together():
    with pytest.raises(AssertionError, match="1 of 4 ranks failed\nrank 2: rank-local detail 2"):
        run_threads(one_rank_disagrees, 4)


def counted_ring(comm):
    counter = Counter()
    c = ObservedComm(comm, counter)
    p2p_ring(c, (3, 5), torch.float64, 7, blocking=False)
    return counter.summary()


@pytest.mark.threads
def test_counter_counts_p2p_bytes_per_peer():
    for r, s in enumerate(run_threads(counted_ring, 4)):
        assert s["sent_to"] == {(r + 1) % 4: 3 * 5 * 8}
        assert s["received_from"] == {(r - 1) % 4: 3 * 5 * 8}


@pytest.mark.threads
def test_isend_leaves_a_copy_in_the_mailbox_and_wakes_the_waiters():
    """The send half alone (lab 01.1): no receive runs. A thread waiting on the world's
    condition for the message is woken at once, and the message is a copy: the sender may
    overwrite its tensor as soon as isend returns."""
    world = impl("comm.threads").ThreadsWorld(2, 5.0, "buffered")
    sender = world.comm(0)
    key = (0, 1, 7)
    woken = []

    def waiter():
        start = time.monotonic()
        with world.cond:
            world.cond.wait_for(lambda: world.mailbox.get(key), timeout=3.0)  # no poll: notify
        woken.append(time.monotonic() - start)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(0.2)  # the waiter is waiting
    t = torch.arange(4.0)
    sender.isend(t, 1, tag=7).wait()
    t.fill_(-1.0)  # reused at once
    thread.join(5.0)
    assert woken and woken[0] < 2.0, f"the waiter slept {woken} s: nothing woke it"
    box = list(world.mailbox.get(key, []))
    assert len(box) == 1 and torch.equal(box[0], torch.arange(4.0)), box
    assert all(not b for k, b in world.mailbox.items() if k != key), "wrong mailbox"


@pytest.mark.threads
def test_a_receive_takes_its_mailboxs_messages_in_order_and_checks_them():
    """The receive half alone (lab 01.2): messages put in the mailbox by hand, as isend would.
    A receive takes the oldest, copies it into its buffer (any shape of the same size), waits
    for one that has not arrived yet, and refuses one of another size or dtype."""
    world = impl("comm.threads").ThreadsWorld(2, 5.0, "buffered")
    receiver, key = world.comm(1), (0, 1, 0)

    def deposit(t: torch.Tensor) -> None:
        with world.cond:
            world.mailbox.setdefault(key, collections.deque()).append(t)
            world.cond.notify_all()

    deposit(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    deposit(torch.tensor([5.0, 6.0, 7.0, 8.0]))
    first, second = torch.zeros(2, 2), torch.zeros(4)
    receiver.recv(first, 0)
    assert torch.equal(first, torch.tensor([[1.0, 2.0], [3.0, 4.0]])), first
    receiver.recv(second, 0)
    assert torch.equal(second, torch.tensor([5.0, 6.0, 7.0, 8.0])), second
    assert not world.mailbox.get(key), "a received message must leave the mailbox"
    later = threading.Timer(0.2, deposit, (torch.tensor([9.0]),))
    later.start()
    third = torch.zeros(1)
    receiver.recv(third, 0)  # posted before the message arrives
    assert third.item() == 9.0
    deposit(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(CommError, match="3 x torch.float64"):
        receiver.recv(torch.zeros(2), 0)


def traced(comm):
    tracer = Tracer()
    c = ObservedComm(comm, tracer)
    with tracer.span("compute"):
        c.all_reduce(torch.ones(4))
    return tracer.events


@pytest.mark.threads
def test_tracer_writes_a_chrome_trace(tmp_path):
    events = run_threads(traced, 2)
    path = tmp_path / "trace.json"
    write_chrome_trace(str(path), dict(enumerate(events)))
    trace = json.loads(path.read_text())["traceEvents"]
    names = {(e["pid"], e["name"]) for e in trace if e["ph"] == "X"}
    assert names == {(0, "compute"), (0, "all_reduce"), (1, "compute"), (1, "all_reduce")}
    assert all(e["dur"] >= 0 for e in trace if e["ph"] == "X")


# ---- tier 2: real processes, started once per test ------------------------------------------


# the process tier's fixed cases (the threads tier draws the sweep): every dtype once, each op
# in turn, on 4 ranks and on 3, blocking and not, odd, 0-d and empty shapes
SHAPES = ((7, 3), (5,), (), (2, 0, 3), (9,), (3, 5), (1,), (4, 2), (6, 1))
HARD = [
    dict(k=4 - i % 2, shape=SHAPES[i], dtype=dtype, op=OPS[i % 4], seed=i)
    for i, dtype in enumerate(DTYPES)
]


def properties_in_ranks(comm, max_examples: int) -> int:
    """The fixed cases, then hypothesis, inside every rank (same cases everywhere); world
    sizes 3 and 4 (drawn: 1..p) by splitting."""
    subs = {k: comm.split(int(comm.rank < k)) for k in range(1, comm.world_size + 1)}
    examples = [0]
    phases = [Phase.explicit, Phase.generate] if max_examples else [Phase.explicit]

    @settings(RANK_SETTINGS, max_examples=max(max_examples, 1), phases=phases)
    @given(st.integers(1, comm.world_size), shapes(max_side=5), all_dtypes, ops, seeds)
    def prop(k, shape, dtype, op, seed):
        examples[0] += 1
        if comm.rank < k:  # ranks outside the sub-world sit this example out
            sub = subs[k]
            collectives_once(sub, shape, dtype, op, seed)
            p2p_ring(sub, shape, dtype, seed, blocking=seed % 2 == 0)
        comm.barrier()

    for case in HARD:
        prop = example(**case)(prop)
    prop()
    return examples[0]


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_comm_properties_processes(backend):
    counts = run_ranks(properties_in_ranks, 4, backend, 0, timeout=180)
    assert counts == [len(HARD)] * 4  # every rank ran the same cases


def failures_in_ranks(comm) -> list[str]:
    """Mismatch detection (debug mode) and bad input over real processes."""
    checked = impl("comm.checked").CheckedComm(comm)
    shape = (4,) if comm.rank == 0 else (5,)
    try:
        checked.all_reduce(torch.zeros(shape))
        message = "no error"
    except CollectiveMismatch as e:
        message = str(e)
    try:
        comm.send(torch.zeros(1), comm.world_size + 1)
        bad = "no error"
    except ValueError as e:
        bad = str(e)
    return [message, bad]


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_mismatch_and_bad_input_processes(backend):
    for message, bad in run_ranks(failures_in_ranks, 3, backend, timeout=120):
        assert "rank 0: all_reduce(shape=(4,), float32, op=sum)" in message
        assert "ranks [1, 2]: all_reduce(shape=(5,), float32, op=sum)" in message
        assert "dst=4 is out of range for world_size=3" in bad


def times_out_in_recv(comm):
    if comm.rank == 1:  # rank 0 goes on to wait in the harness's final barrier (60 s)
        comm.timeout = 1.0
        comm.recv(torch.zeros(2), 0, tag=5)


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_timeout_processes(backend):
    with pytest.raises(AssertionError) as e:
        run_ranks(times_out_in_recv, 2, backend, timeout=60)
    text = str(e.value)
    assert "rank 1 failed" in text
    assert f"CommTimeout: rank 1 of 2 ({backend}): recv(tag=5) #" in text
    assert "with peer 0 timed out after 1s" in text
