"""ZeRO: optimizer state, gradients and parameters sharded across data-parallel ranks (lesson 07).

stages.py    ZeRO-1, ZeRO-2 and ZeRO-3 as optimizers over a plan of shards
gatherer.py  ZeRO-3's units: parameters gathered before use and freed after
state.py     the optimizer state consolidated, saved and resharded to another world size
cost.py      the bytes each stage holds and sends, as formulas
bench.py     `minidist bench zero`
"""
