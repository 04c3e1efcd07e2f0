"""Expert parallelism: mixture of experts over all-to-all (lesson 14).

moe.py    the router, the experts, the single-process MoE and its expert-parallel twin
moe_block.py  the transformer block with an MoE, apply_ep (the main job's step 3) and
              apply_expert_dp (its replicas)
bench.py  `minidist bench moe`
"""
