"""Expert parallelism: mixture of experts over all-to-all (lesson 14).

moe.py    the router, the experts, the single-process MoE and its expert-parallel twin
bench.py  `minidist bench moe`
"""
