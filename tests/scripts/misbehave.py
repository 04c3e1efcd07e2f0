"""One rank misbehaves, the others do their part: the watchdog's drills (tests/test_launch.py)
and those of ranks no launcher watches (tests/test_launchers.py).

exit3     rank 1 calls sys.exit(3) while the others wait for it in a recv
sleep     rank 1 sleeps outside any collective while the others wait for it in a recv
loop      rank 1 loops after its peers finished (no one waits for it)
early     rank 1 raises before init()
hang      rank 1 sleeps outside any collective while the others wait for it in an all_reduce
skip      rank 1 returns (exit code 0), skipping the all_reduce the others wait in
raise     rank 1 raises while rank 2 sleeps outside the comm and the rest wait in an all_reduce
"""

import os
import sys
import time

import torch

import minidist

what = sys.argv[1]
if what == "early" and any(os.environ.get(v) == "1" for v in ("RANK", "PMI_RANK")):
    raise RuntimeError("rank 1 could not set up")
comm = minidist.init()
comm.barrier()
if comm.rank == 1:
    print(f"rank 1 misbehaves at {time.time():.3f}", flush=True)  # the tests time from here
    if what == "exit3":
        sys.exit(3)
    if what == "skip":
        sys.exit(0)
    if what == "raise":
        raise ValueError("rank 1 gives up")
    while True:  # sleep, loop and hang: never ends; only the watchdog ends it
        time.sleep(0.05 if what in ("sleep", "hang") else 0)
elif comm.rank == 2 and what == "raise":
    while True:  # outside the comm: no connection of its own closes to wake it
        time.sleep(0.05)
elif what in ("hang", "skip", "raise"):
    comm.all_reduce(torch.ones(4))
elif what != "loop":
    comm.recv(torch.zeros(1), 1)  # rank 1 never sends
