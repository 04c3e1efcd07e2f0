"""Data parallelism: one model per rank, gradients averaged (lesson 04).

wrappers.py  DataParallelNaive (one all-reduce per parameter) and DataParallelBucketed
             (buckets, launched from backward, overlapping it); the batch shard
replicas.py  apply_dp: the main job's stage kept equal over its replicas (minidist/replicas.py)
bench.py     `minidist bench dp`
"""
