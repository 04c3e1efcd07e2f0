"""Each rank reads one line of its standard input, a byte at a time (no further than the line),
and prints it: tests/test_standard_input_and_folders.py checks that rank 0 alone gets input."""

import os

import minidist

comm = minidist.init()
line = b""
while not line.endswith(b"\n"):
    byte = os.read(0, 1)
    if not byte:  # end of input: /dev/null at once
        break
    line += byte
print(f"rank {comm.rank} read {line.decode().strip()!r}", flush=True)
comm.barrier()
