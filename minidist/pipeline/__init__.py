"""Pipeline parallelism (lesson 06).

schedules.py  schedules as data: GPipe, 1F1B, interleaved, zero-bubble; checks, bubble, memory
stage.py      the executor: one stage runs its schedule over send and receive
zero_bubble.py  a chunk run layer by layer, so its backward splits into B and W (ZB)
partition.py  layers cut into stages of balanced cost
chunks.py     apply_pp: this stage's layers as chunks (the main job's step 4)
draw.py       `minidist schedule`: a schedule drawn as a grid
bench.py      `minidist bench pipeline`
"""
