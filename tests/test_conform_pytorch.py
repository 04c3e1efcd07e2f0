"""PyTorch's own implementations under the conformance kit (minidist/conform/pytorch.py): a small
slice, with what they were found to do. The whole run, every capability and every drawn case:
`minidist conform pytorch` (lessons/appendix_conformance/README.md, "PyTorch, judged").
"""

from __future__ import annotations

import pytest

from minidist.conform import pytorch, registry, runner


@pytest.mark.pure
def test_torch_1f1b_program_numbers_the_last_stages_forwards_from_1():
    """Schedule1F1B._get_pipeline_order (the program torch draws and simulates) gives the last
    stage the forwards of microbatches 1..m, not 0..m-1: with no warm-up forward, its counter
    is incremented before the first steady-state forward. The step itself runs 0..m-1 (the
    kit's step.1f1b passes). When torch fixes it, this test says the docs need a word."""
    assert pytorch.pipeline_schedule("1f1b", 2, 2) == [
        [("F", 0), ("F", 1), ("B", 0), ("B", 1)],
        [("F", 1), ("B", 0), ("F", 2), ("B", 1)],
    ]
    assert pytorch.pipeline_schedule("1f1b", 1, 1) == [[("F", 1), ("B", 0)]]
    assert pytorch.pipeline_schedule("gpipe", 2, 2)[1] == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    with pytest.raises(NotImplementedError, match="refuses n_microbatches=1 < 2 stages"):
        pytorch.pipeline_schedule("1f1b", 2, 1)


@pytest.mark.processes
def test_fsdp2_and_zero_redundancy_optimizer_pass_every_zero_check_over_gloo():
    """ZeRO-1 (ZeroRedundancyOptimizer under DDP), ZeRO-2 and ZeRO-3 (FSDP2's fully_shard) equal
    one process's AdamW, hold each element's state on one rank, and stay within the memory
    formula, on sub-worlds of 1..4 of one job of gloo processes (the hard cases alone)."""
    results = runner.conform("pytorch", registry.CAPABILITIES["zero"], ["gloo"], 1)
    assert [r.status for r in results] == ["passed"] * len(results), [
        (r.full_name, r.problem) for r in results if r.status != "passed"
    ]
    assert all(r.examples >= 2 for r in results), [(r.full_name, r.examples) for r in results]
