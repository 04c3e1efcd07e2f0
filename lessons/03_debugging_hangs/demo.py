"""Lesson 03: bugs that hang a distributed program, and what minidist says instead.

python lessons/03_debugging_hangs/demo.py                             # 4 ranks as threads
minidist run -n 4 --backend mpi lessons/03_debugging_hangs/demo.py    # or --backend gloo
minidist run -n 4 --backend mpi lessons/03_debugging_hangs/demo.py --crash   # a rank dies
"""

import sys

import torch

from minidist.comm import CheckedComm, CommError
from minidist.comm.protocol import Deadlock
from minidist.launch.launcher import demo_init


def exchange(pair, numel: int, send_first: bool) -> None:
    """Swap numel floats with the other rank of a pair, both ranks starting the same way."""
    x, peer = torch.zeros(numel), 1 - pair.rank
    if send_first:
        pair.send(x, peer)  # returns at once only if the message can be buffered
    pair.recv(x, peer)  # if both ranks get here first, nobody sends: they wait forever
    if not send_first:
        pair.send(x, peer)


def rank_local_assert(comm, agree_first: bool) -> None:
    ok = torch.tensor([int(comm.rank != 1)])  # rank 1 finds a bad batch
    if agree_first:
        comm.all_reduce(ok, op="min")  # every rank learns whether every rank is fine
    assert ok.item(), "a bad batch"
    comm.all_reduce(torch.ones(3))  # the next collective: the others wait here for rank 1


def different_collectives(comm) -> None:
    if comm.rank == 1:
        comm.all_gather(torch.zeros(2 * comm.world_size), torch.zeros(2))
    else:  # rank 0 also with another shape
        comm.all_reduce(torch.zeros(3 if comm.rank == 0 else 2))


BUGS = [  # title, the bug, its arguments, on pairs of ranks (0-1, 2-3, ...)?, debug mode?
    ("1. both ranks recv first", exchange, (8, False), True, False),
    ("2. both ranks send 8 floats first", exchange, (8, True), True, False),
    ("3. both ranks send 4M floats first", exchange, (1 << 22, True), True, False),
    ("4. rank 1 fails an assert on its own", rank_local_assert, (False,), False, False),
    ("5. the same assert, agreed on first", rank_local_assert, (True,), False, False),
    ("6. debug mode: different collectives", different_collectives, (), False, True),
]


def main(comm) -> None:
    for title, bug, args, pairs, debug in BUGS:
        sub = comm.split(comm.rank // 2 if pairs else 0)  # a fresh comm: a hang spoils one
        sub.timeout = 1.0  # this comm only; for a run: MINIDIST_TIMEOUT=1 or init(timeout=1)
        try:
            bug(CheckedComm(sub) if debug else sub, *args)  # debug: what MINIDIST_DEBUG=1 does
            text = "finished"
        except (CommError, AssertionError) as e:
            text = f"{type(e).__name__}: {e}"
        # every rank's text to every rank: an all-gather of zero-padded bytes
        raw = torch.frombuffer(
            bytearray(text.encode()[:1000].ljust(1000, b"\0")), dtype=torch.uint8
        )
        rows = torch.empty(comm.world_size, 1000, dtype=torch.uint8)
        gathered = comm.iall_gather(rows, raw)
        try:
            gathered.wait()
        except Deadlock:
            # threads: in bug 4 rank 1 waits here while the others wait for it in bug(): the
            # world sees it and raises Deadlock on all four (on rank 1 only if it wakes before
            # the others, freed, come here). This all-gather stays posted, so wait again
            gathered.wait()
        texts = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in rows]
        if comm.rank == 0:
            print(title)
            for t in dict.fromkeys(texts):  # ranks that saw the same thing on one line
                print(f"  ranks {[r for r, x in enumerate(texts) if x == t]}: {t}")
    if "--crash" in sys.argv and comm.rank == 1:
        raise RuntimeError("rank 1 dies on purpose (--crash)")
    comm.barrier()


if __name__ == "__main__":
    comm = demo_init(__file__)  # plain `python demo.py`: 4 thread-ranks
    assert comm.world_size % 2 == 0, f"run with an even number of ranks, not {comm.world_size}"
    main(comm)
