"""Hidden checks of lab 07 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests: the pieces of hand-made plans (boundaries inside tensors, an empty
tensor, a rank that holds padding only: a boundary off by one shows); no full gradient left on
the model after the reduce-scatter; a parameter no rank used keeps no gradient and does not
move under AdamW's weight decay; clipping on four ranks of a two-element model, where two
ranks hold only padding (a rank with nothing to add must still join the all-reduce), and a
max_norm so large that nothing may change (a coefficient not capped at 1 scales up).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minidist.testing import check_all, impl, run_threads, verdict

F64 = torch.float64
FAST = {"timeout": 40, "comm_timeout": 3}


@pytest.mark.pure
def test_07_1_pieces_of_hand_made_plans():
    zero = impl("zero.stages")
    Piece = zero.Piece
    # [3, 5, 2] over 4 ranks: S = 3, buffer [t0 t0 t0 | t1 t1 t1 | t1 t1 t2 | t2 pad pad]
    plan = zero.partition([3, 5, 2], 4)
    assert [plan.pieces(r) for r in range(4)] == [
        [Piece(0, 0, 3, 0)],
        [Piece(1, 0, 3, 0)],
        [Piece(1, 3, 5, 0), Piece(2, 0, 1, 2)],
        [Piece(2, 1, 2, 0)],
    ]
    # [0, 2, 0] over 3 ranks: S = 1; the empty tensors have no piece, rank 2 only padding
    plan = zero.partition([0, 2, 0], 3)
    assert [plan.pieces(r) for r in range(3)] == [[Piece(1, 0, 1, 0)], [Piece(1, 1, 2, 0)], []]
    # [4, 4] over 2 ranks: a boundary exactly between the tensors
    plan = zero.partition([4, 4], 2)
    assert [plan.pieces(r) for r in range(2)] == [[Piece(0, 0, 4, 0)], [Piece(1, 0, 4, 0)]]


class Two(nn.Module):
    """used: Linear(2, 1); unused: Linear(2, 2), never called (no gradient on any rank)."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(2, 1, dtype=F64), nn.Linear(2, 2, dtype=F64)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for q in self.parameters():
                q.copy_(torch.randn(q.shape, generator=g, dtype=F64))

    def forward(self, x):
        return self.used(x)


def data(p: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(71)
    return torch.randn(p, 3, 2, generator=g, dtype=F64), torch.randn(
        p, 3, 1, generator=g, dtype=F64
    )


def unused_and_freed(comm, stage: int) -> None:
    """Two steps of AdamW (weight decay 0.1): the unused Linear keeps its values and no
    gradient; the used one equals one process; no model parameter holds a full .grad after
    the gradients are synced."""
    zero = impl("zero.stages")
    p, r = comm.world_size, comm.rank
    xs, ys = data(p)
    ref, model = Two(), Two()
    before = [q.detach().clone() for q in model.unused.parameters()]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    z = zero.wrap(model, comm, torch.optim.AdamW, stage, {"lr": 0.1, "weight_decay": 0.1})
    left = []
    for _ in range(2):
        nn.functional.mse_loss(ref(xs.view(-1, 2)), ys.view(-1, 1)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(z(xs[r]), ys[r]).backward()
        z.finish_gradient_sync()
        left += [n for n, q in model.named_parameters() if q.grad is not None]
        z.step()
        z.zero_grad()
    verdict(comm, not left, f"stage {stage}: full gradients left on {left}")
    with z.gathered():
        now = {n: q.detach().clone() for n, q in model.named_parameters()}
    pairs = {f"used.{n}": (now[f"used.{n}"], q.detach()) for n, q in ref.used.named_parameters()}
    names = [n for n, _ in model.unused.named_parameters()]
    pairs |= {f"unused.{n}": (now[f"unused.{n}"], b) for n, b in zip(names, before, strict=True)}
    check_all(comm, pairs, 1e-12, 1e-14, context=f"stage {stage}")


@pytest.mark.threads
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_07_2_unused_parameters_stay_put_and_no_full_gradient_is_left(stage):
    run_threads(unused_and_freed, 2, stage, **FAST)


def clipped(comm, stage: int, max_norm: float) -> None:
    """A Linear(1, 1): 2 elements over 4 ranks, so ranks 2 and 3 hold only padding. One SGD
    step after clip_grad_norm_(max_norm): the norm and the parameters equal one process's."""
    zero = impl("zero.stages")
    p, r = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(72)
    xs, ys = (
        torch.randn(p, 2, 1, generator=g, dtype=F64),
        torch.randn(p, 2, 1, generator=g, dtype=F64),
    )

    def make():
        lin = nn.Linear(1, 1, dtype=F64)
        with torch.no_grad():
            lin.weight.fill_(1.5)
            lin.bias.fill_(-0.5)
        return lin

    ref, model = make(), make()
    nn.functional.mse_loss(ref(xs.view(-1, 1)), ys.view(-1, 1)).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm)
    with torch.no_grad():
        for q in ref.parameters():
            q -= 0.1 * q.grad
    z = zero.wrap(model, comm, torch.optim.SGD, stage, {"lr": 0.1})
    nn.functional.mse_loss(z(xs[r]), ys[r]).backward()
    norm = z.clip_grad_norm_(max_norm)
    z.step()
    with z.gathered():
        pairs = {
            n: (q.detach().clone(), q_ref.detach())
            for (n, q), q_ref in zip(model.named_parameters(), ref.parameters(), strict=True)
        }
    pairs["norm"] = (norm.reshape(()).to(F64), ref_norm.to(F64))
    check_all(comm, pairs, 1e-12, 1e-14, context=f"stage {stage} max_norm={max_norm}")


@pytest.mark.threads
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_07_3_clipping_with_ranks_that_hold_only_padding(stage):
    run_threads(clipped, 4, stage, 0.01, **FAST)


@pytest.mark.threads
@pytest.mark.parametrize("stage", [1, 3])
def test_07_3_clipping_never_scales_gradients_up(stage):
    run_threads(clipped, 2, stage, 1e6, **FAST)
