"""One rank misbehaves, the others do their part: the watchdog's drills (tests/test_launch.py).

exit3     rank 1 calls sys.exit(3) while the others wait for it in a recv
sleep     rank 1 sleeps outside any collective while the others wait for it
loop      rank 1 loops after its peers finished (no one waits for it)
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
    print(f"rank 1 misbehaves at {time.time():.3f}", flush=True)  # the test times from here
    if what == "exit3":
        sys.exit(3)
    while True:  # sleep and loop: never ends; only the watchdog ends it
        time.sleep(0.05 if what == "sleep" else 0)
elif what != "loop":
    comm.recv(torch.zeros(1), 1)  # rank 1 never sends
