"""ZeRO: optimizer state, gradients and parameters sharded across data-parallel ranks (lesson 07).

units.py     a unit: parameters flattened into one buffer cut into p shards, the structure
             every stage keeps
stages.py    the plan of shards, and ZeRO-1, ZeRO-2 and ZeRO-3 as optimizers over it; wrap
gatherer.py  ZeRO-3: a unit gathered before its module runs and freed after, prefetched, and a
             freed parameter that refuses to be read
state.py     the optimizer state consolidated, saved and resharded to another world size
cost.py      the bytes each stage holds and sends, as formulas
replicas.py  apply_zero: the main job's stage as ZeRO replicas (minidist/replicas.py)
bench.py     `minidist bench zero`
"""
