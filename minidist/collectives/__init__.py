"""Collectives built from send and receive (lesson 02).

algorithms.py    naive, recursive doubling and ring all-reduce; ring reduce-scatter, all-gather;
                 broadcast, all-to-all; the dispatcher `all_reduce` chooses among them by size
overlap.py       Launcher: start a collective now, wait later (the comm's or the ring on a thread)
hierarchical.py  the two-level all-reduce: inside each node, then across nodes (lesson 13)
bench.py         `minidist bench allreduce|p2p`: an nccl-tests style table
"""
