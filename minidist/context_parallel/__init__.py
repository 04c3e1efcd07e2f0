"""Context parallelism: ring attention over a sequence cut across ranks (lesson 15).

ring_attention.py  the sequence cut, the ring of key/value blocks, the merge and its backward
parallelize.py     apply_cp: a transformer's attentions made rings (the main job's step 2)
bench.py           `minidist bench cp`
"""
