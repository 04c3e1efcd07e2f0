"""The mixture-of-experts variant of the main job's GPT: every block's MLP replaced by the MoE
layer of expert_parallel/moe.py (expert_parallel/moe_block.py: MoEBlock), its experts shared
out over the mesh's ep group (moe_block.apply_ep); here, what the variant refuses and the bytes
it sends.

Equals: train_full on the same model with all E experts in one process, each block routing
the whole batch in the same groups as the ranks do (one group per rank and microbatch: b = B /
(dp m) sequences, b T / cp tokens, with cp each rank's zigzag chunks: context.token_order;
capacity and the auxiliary loss are per group, as GShard and Switch define them), the
auxiliary loss weighted 1 / (dp m cp) per group (the mean over groups).
float64: losses 1e-12 relative, parameters 1e-10 (tests/test_train.py).
Communication per step, per rank (ep ranks on ep_comm): per block and microbatch, that of
ExpertParallelMoE (three all-to-alls forward, two backward: expert_parallel/moe.py); at the step's
end moe_block.apply_expert_dp all-reduces every gradient once: the dense ones and the routers' over
dp x cp (the routers' as ep, edp, then cp), the experts' over edp then cp, their replicas. On
the dp counter (dp x cp and edp count as dp): 8 + f Psi_r bytes, Psi_r the rank's parameters
(dp_nbytes); on ep the routers' f E D per block and the all-to-alls (what the routers decide).
Memory per rank: the blocks' dense weights, the routers (E D each), E/ep experts per block.
Ladder: MoEBlock (attention, then MoE; the auxiliary loss attached to the output) ->
parallel_block (the experts cut over ep_comm) -> apply_expert_dp (gradients averaged
over their own replicas): moe_block.py holds all three.
Paper: Fedus, Zoph, Shazeer, Switch Transformers (JMLR 2022), section 2.2; Lepikhin et al.,
GShard (ICLR 2021), section 2.2; Megatron-LM's MoEAuxLossAutoScaler (megatron/core/
transformer/moe/moe_utils.py) for attaching the auxiliary loss to an activation.
Lesson: lessons/14_expert_parallel/.
Run: minidist train --dp 4 --ep 2 --experts 4 --topk 2 --check

The loss printed is the cross-entropy alone, in every layout and in the reference (the
auxiliary loss reaches the gradients through moe_block.AttachAux).
"""

from __future__ import annotations


def problems(config) -> list[str]:
    """What stops a TrainConfig's experts (or its ep) from running, with the numbers."""
    c = config
    experts = config.model.experts
    found = []
    if c.ep > 1 and not experts:
        found.append(f"ep={c.ep} needs experts: --ep shares out the experts of --experts E")
    if experts and c.ep >= 1 and experts % c.ep:
        found.append(f"experts={experts} is not divisible by ep={c.ep}")
    if not experts:
        return found
    refused = {
        "tp": (c.tp, 1, "the experts are not cut over tp"),
        "zero": (c.zero, 0, "ZeRO shards over dp, but the ranks of an ep group hold different"
                 " experts"),
        "amp": (c.amp, "fp32", "the experts train in --dtype only"),
    }  # fmt: skip
    for name, (value, fine, why) in refused.items():
        if value != fine:
            found.append(f"experts={experts} with {name}={value!r} is not supported: {why}")
    return found


def dp_nbytes(params: list, f: int) -> int:
    """Payload bytes a rank hands the dp counter per step with experts: the loss's 8 (float64),
    then every gradient it holds once, in f-byte elements (the dense ones over dp x cp, each
    router's and this rank's experts' over their replicas: apply_expert_dp sends no flags)."""
    return 8 + f * sum(q.numel() for q in params)
