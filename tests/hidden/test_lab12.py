"""Hidden checks of lab 12 (the instructor's copy only: `make handout` leaves tests/hidden/ out).

Convention: tests/hidden/test_labNN*.py grades lab NN; a test named test_NN_k_* is a check of
task NN.k, worth one point like the checks the lesson README names (tools/labs_grade.py).
These tests also run on the reference with the rest of the suite.
Beyond the public tests: coordinates and dp/pp/tp groups with context parallelism (cp = 2, 3:
code right only for cp = 1 drops c), brute force from rank = ((d pp + s) cp + c) tp + t, and
the sub-communicators make_mesh splits on a world with cp; the composition's first steps
(layer ids and chunks cut over tp) against the main job's own on every rank, with pp = 2 and
with interleaved chunks; the tp and pp byte formulas on written-out cases (recomputed blocks,
the head's loss collectives, headers on activations only, virtual stages).
"""

from __future__ import annotations

import pytest
import torch

from minidist.gpt import model as gpt
from minidist.gpt import train as reference
from minidist.testing import impl, run_threads, verdict

LAYOUTS = [(1, 1, 1, 2), (2, 1, 2, 2), (1, 2, 2, 3), (2, 3, 1, 2), (3, 2, 2, 3)]  # dp pp tp cp


def places(dp: int, pp: int, tp: int, cp: int) -> dict[int, tuple[int, int, int, int]]:
    """rank -> (d, s, c, t), from the formula, by brute force."""
    return {
        ((d * pp + s) * cp + c) * tp + t: (d, s, c, t)
        for d in range(dp)
        for s in range(pp)
        for c in range(cp)
        for t in range(tp)
    }


@pytest.mark.pure
def test_12_1_coords_with_context_parallelism():
    mesh = impl("mesh")
    for dp, pp, tp, cp in LAYOUTS:
        layout = mesh.Layout(dp, pp, tp, cp=cp)
        for rank, (d, s, _, t) in places(dp, pp, tp, cp).items():
            assert layout.coords(rank) == (d, s, t), ((dp, pp, tp, cp), rank)


@pytest.mark.pure
def test_12_2_groups_with_context_parallelism():
    mesh = impl("mesh")
    for dp, pp, tp, cp in LAYOUTS:
        layout, where = mesh.Layout(dp, pp, tp, cp=cp), places(dp, pp, tp, cp)
        for rank, (d, s, c, t) in where.items():
            for axis, keep in (("dp", (1, 2, 3)), ("pp", (0, 2, 3)), ("tp", (0, 1, 2))):
                mine = [(d, s, c, t)[i] for i in keep]
                want = sorted(r for r, x in where.items() if [x[i] for i in keep] == mine)
                got = layout.group(rank, axis)
                assert got == want, ((dp, pp, tp, cp), rank, axis, got, want)


def members(comm, dims: tuple) -> None:
    """Each of dp_comm, pp_comm, tp_comm holds the ranks of the formula's group, in order."""
    dp, pp, tp, cp = dims
    m = impl("mesh").make_mesh(comm, impl("mesh").Layout(dp, pp, tp, cp=cp))
    where = places(dp, pp, tp, cp)
    problems = []
    for axis, keep in (("dp", (1, 2, 3)), ("pp", (0, 2, 3)), ("tp", (0, 1, 2))):
        sub = getattr(m, f"{axis}_comm")
        found = torch.empty(sub.world_size, dtype=torch.int64)
        sub.all_gather(found, torch.tensor([comm.rank]))
        mine = [where[comm.rank][i] for i in keep]
        want = sorted(r for r, x in where.items() if [x[i] for i in keep] == mine)
        if found.tolist() != want:
            problems.append(f"{axis}: {found.tolist()} != {want}")
    verdict(comm, not problems, f"rank {comm.rank} of {dims}: " + "; ".join(problems))


@pytest.mark.threads
@pytest.mark.parametrize("dims", [(2, 1, 2, 2), (1, 2, 1, 3)])
def test_12_3_make_mesh_with_context_parallelism(dims):
    dp, pp, tp, cp = dims
    run_threads(members, dp * pp * tp * cp, dims, timeout=30, comm_timeout=3)


TINY = gpt.GPTConfig(seq_len=8, d_model=16, n_heads=4, d_ff=32, n_layers=2)


def first_steps(comm, options: dict) -> None:
    """The lab's build_job and the main job's, on the same rank: the same layer ids, and the
    same chunks (every parameter's name, shape and values)."""
    config = reference.TrainConfig(**options, steps=1, warmup=1, dtype="float64", model=TINY)
    mine = impl("gpt.train").build_job(comm, config)
    want = reference.build_job(comm, config)
    problems = []
    if mine.layer_ids != want.layer_ids:
        problems.append(f"layer ids {mine.layer_ids} != {want.layer_ids}")
    for i, (a, b) in enumerate(zip(mine.chunks, want.chunks, strict=True)):
        got, exp = a.state_dict(), b.state_dict()
        if list(got) != list(exp):
            problems.append(f"chunk {i}: {list(got)} != {list(exp)}")
            continue
        problems += [f"chunk {i} {n}" for n in exp if not torch.equal(got[n], exp[n])]
    verdict(comm, not problems, f"rank {comm.rank} {options}: " + "; ".join(problems[:4]))


@pytest.mark.threads
@pytest.mark.parametrize(
    "options",
    [
        dict(dp=1, pp=2, tp=2, microbatches=2, batch=2),
        dict(dp=2, pp=2, tp=1, schedule="interleaved", chunks=2, microbatches=2, batch=4),
    ],
)
def test_12_4_layers_and_chunks_of_every_rank_are_the_main_jobs(options):
    run_threads(first_steps, 4, options, timeout=60, comm_timeout=3)


@pytest.mark.pure
def test_12_5_tp_bytes_on_written_out_cases():
    train = impl("gpt.train")
    c = reference.TrainConfig(model=TINY)  # 2 blocks: ids 1, 2; embedding 0, head 3
    a, loss_row = 10, 3
    assert train._tp_nbytes(c, [0, 1, 2, 3], a, loss_row) == 2 * 4 * a + a + a + 3 * loss_row
    assert train._tp_nbytes(c, [1], a, loss_row) == 4 * a
    assert train._tp_nbytes(c, [2, 3], a, loss_row) == 4 * a + a + 3 * loss_row
    assert train._tp_nbytes(c, [0], a, loss_row) == a
    recomputed = reference.TrainConfig(model=TINY, checkpointing=True)
    assert train._tp_nbytes(recomputed, [0, 1, 2], a, loss_row) == 2 * 6 * a + a


@pytest.mark.pure
def test_12_6_pp_bytes_on_written_out_cases():
    train = impl("gpt.train")
    ma = 100
    plain = reference.TrainConfig(pp=3, model=TINY)
    want = [8 + ma + 64, 8 + (ma + 64) + ma, 8 + ma]  # first: on; middle: both; last: back
    assert [train._pp_nbytes(plain, s, ma) for s in range(3)] == want
    # interleaved: pp = 2, chunks = 2: virtual stages 0 1 | 2 3; stage 0 holds 0 and 2
    inter = reference.TrainConfig(pp=2, chunks=2, schedule="interleaved", model=TINY)
    want = [8 + (ma + 64) + (ma + 64 + ma), 8 + (ma + 64 + ma) + ma]
    assert [train._pp_nbytes(inter, s, ma) for s in range(2)] == want
    assert train._pp_nbytes(reference.TrainConfig(model=TINY), 0, ma) == 8  # one stage
