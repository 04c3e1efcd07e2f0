"""Tier 3: the comm layer with CUDA tensors. Skipped on machines without a GPU.

- threads: a whole small "cluster" on one GPU, every rank's tensors on cuda:0;
- mpi: CUDA tensors staged through host memory (the pip MPICH is not CUDA-aware);
- nccl: one rank per GPU, so it needs at least two GPUs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_comm import collectives_once, p2p_ring

from minidist.testing import all_dtypes, ops, rank_settings, run_ranks, run_threads, seeds, shapes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), shapes(max_side=6), all_dtypes, ops, seeds)
def test_threads_with_cuda_tensors(p, shape, dtype, op, seed):
    run_threads(collectives_once, p, shape, dtype, op, seed, "cuda")
    run_threads(p2p_ring, p, shape, dtype, seed, False, "cuda")


def cuda_properties(comm, max_examples: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device())

    @rank_settings(max_examples)
    @given(shapes(max_side=6), all_dtypes, ops, seeds)
    def prop(shape, dtype, op, seed):
        collectives_once(comm, shape, dtype, op, seed, device)
        p2p_ring(comm, shape, dtype, seed, seed % 2 == 0, device)

    prop()


def test_mpi_stages_cuda_tensors_through_the_host():
    run_ranks(cuda_properties, 2, "mpi", 15, timeout=180)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_nccl():
    run_ranks(cuda_properties, min(torch.cuda.device_count(), 4), "nccl", 15, timeout=300)
