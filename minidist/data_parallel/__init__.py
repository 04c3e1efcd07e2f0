"""Data parallelism: one model per rank, gradients averaged (lesson 04).

wrappers.py  DataParallelNaive (one all-reduce per parameter) and DataParallelBucketed
             (buckets, launched from backward, overlapping it); the batch shard
bench.py     `minidist bench dp`
"""
