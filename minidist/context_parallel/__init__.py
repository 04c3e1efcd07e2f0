"""Context parallelism: ring attention over a sequence cut across ranks (lesson 15).

ring_attention.py  the sequence cut, the ring of key/value blocks, the merge and its backward
bench.py           `minidist bench cp`
"""
