"""Pipeline schedules as data: per-stage programs of ops, checked and simulated with no comm.

Equals: each stage does one forward and one backward (or B then W) per microbatch and chunk, so
running a schedule equals full-batch training; checked as data (`check_order`, `check_matching`).
Communication per step, per stage (p stages, m microbatches, v chunks): m*v activations to the
next stage, m*v gradients to the previous one; blocking send/recv, placed by `place_comm`.
Memory per stage s (stored activations, microbatches): GPipe m; 1F1B, ZB-H1 min(p - s, m) (ZB-H1
holds min(p, m) until their W); interleaved min(v*m, (v-1)*p + 2*(p-s-1) + 1) chunk-microbatches.
Ladder: gpipe -> 1f1b (warmup, steady, cooldown: memory p - s, not m) -> interleaved (v chunks
per stage: bubble / v) -> zb (backward split into B and W; the W fill the bubble).
Bubble (idle / total, simulated, t_b = 2 t_f): GPipe, 1F1B (p-1)/(m+p-1); interleaved
(p-1)/(v*m+p-1) with eager sends (blocking ones: more if p % 3 == 2 and m > p); ZB-H1
(p-1)/(3*m+p-1) (t_F = t_B = t_W, m >= p).
Paper: GPipe (Huang et al. 2019); 1F1B, PipeDream-Flush (Narayanan et al. 2021a); interleaved 1F1B
(Narayanan et al. 2021b, Megatron-LM, sec. 2.2); Zero Bubble (Qi et al. 2023, sec. 2, ZB-H1).
Lesson: lessons/06_pipeline/.   Run: minidist schedule --schedule 1f1b --stages 4 --microbatches 8
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate

FORWARD = "forward"
BACKWARD = "backward"  # input and weight gradients together, as in GPipe and 1F1B
BACKWARD_INPUT = "backward_input"  # ZB's B: the gradient of the stage's input only
BACKWARD_WEIGHT = "backward_weight"  # ZB's W: the gradient of the stage's weights
SEND_ACT, RECV_ACT = "send_act", "recv_act"  # activations flow to the next (virtual) stage
SEND_GRAD, RECV_GRAD = "send_grad", "recv_grad"  # gradients flow back to the previous one
COMPUTE = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
SENDS = (SEND_ACT, SEND_GRAD)
LETTER = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W"}
NAMES = ("gpipe", "1f1b", "interleaved", "zb")


@dataclass(frozen=True)
class Op:
    """One instruction of a stage's program: `kind` of `microbatch` on model chunk `chunk`."""

    kind: str
    microbatch: int
    chunk: int = 0


Program = list[Op]  # what one stage runs, in order
Timeline = list[list[tuple[float, float, Op]]]  # per stage: (start, end, op) of its compute ops
Rows = list[tuple[int, float, float, str]]  # (stage, start, end, label): a measured timeline


def _fwd(i: int, c: int = 0) -> Program:  # receive the input, forward, send the output
    return [Op(RECV_ACT, i, c), Op(FORWARD, i, c), Op(SEND_ACT, i, c)]


def _bwd(i: int, c: int = 0, kind: str = BACKWARD) -> Program:  # the same with gradients
    return [Op(RECV_GRAD, i, c), Op(kind, i, c), Op(SEND_GRAD, i, c)]


def _drop_edges(ops: Program, stage: int, n_stages: int, n_chunks: int = 1) -> Program:
    """`ops` without comm to virtual stages that do not exist (before the first, after the
    last); a single stage keeps everything local (chunk c's output is chunk c+1's input)."""
    return [
        op
        for op in ops
        if op.kind in COMPUTE or n_stages > 1 and 0 <= peer(op, stage, n_stages)[1].chunk < n_chunks
    ]


def _check_sizes(n_stages: int, n_microbatches: int, stage: int) -> None:
    assert n_stages >= 1 and n_microbatches >= 1, f"{n_stages=}, {n_microbatches=}: need >= 1"
    assert 0 <= stage < n_stages, f"{stage=} is not a stage of {n_stages=}"


def schedule_gpipe(n_stages: int, n_microbatches: int, stage: int) -> Program:
    """GPipe: the program of `stage`: all m forwards, then all m backwards (stores m)."""
    _check_sizes(n_stages, n_microbatches, stage)
    ops = [op for i in range(n_microbatches) for op in _fwd(i)]
    ops += [op for i in range(n_microbatches) for op in _bwd(i)]
    return _drop_edges(ops, stage, n_stages)


def schedule_1f1b(
    n_stages: int, n_microbatches: int, stage: int, w_delay: int | None = None
) -> Program:
    """1F1B (PipeDream-Flush): the program of `stage`, storing at most min(p - stage, m).

    warmup: p - stage - 1 forwards fill the pipeline after this stage; steady: one forward,
    one backward; cooldown: the backwards left. Any m >= 1 works (m < p: all of m is warmup).
    With w_delay (ZB-H1): each backward split into B, then the W of w_delay steps before.
    """
    _check_sizes(n_stages, n_microbatches, stage)
    m, split = n_microbatches, w_delay is not None

    def backward(i: int) -> Program:  # B of i, then the delayed W, if there is one yet
        late = [Op(BACKWARD_WEIGHT, i - w_delay)] if split and i >= w_delay else []
        return _bwd(i, kind=BACKWARD_INPUT if split else BACKWARD) + late

    ops: Program = []
    # lab 06.1 begin: warmup forwards (_fwd), steady _fwd + backward(i) pairs, cooldown backwards
    warmup = min(n_stages - stage - 1, m)
    ops += [op for i in range(warmup) for op in _fwd(i)]
    for i in range(m - warmup):  # steady: forward warmup + i, backward i
        ops += _fwd(warmup + i) + backward(i)
    for i in range(m - warmup, m):  # cooldown
        ops += backward(i)
    # lab 06.1 end
    if split:  # the W still delayed
        ops += [Op(BACKWARD_WEIGHT, i) for i in range(max(0, m - w_delay), m)]
    return _drop_edges(ops, stage, n_stages)


def schedule_interleaved(n_stages: int, n_microbatches: int, stage: int, n_chunks: int) -> Program:
    """Interleaved 1F1B (Megatron): the program of `stage`, which holds v = n_chunks chunks.

    Chunk c of stage s is virtual stage c*p + s: the model passes the stages v times. Groups of
    p microbatches go through chunk 0, then chunk 1, ..., so an activation leaving the last stage
    reaches the first as it finishes the group. Needs n_microbatches a multiple of n_stages
    (Megatron paper, section 2.2): raises ValueError otherwise.
    """
    _check_sizes(n_stages, n_microbatches, stage)
    p = n_stages
    m = n_microbatches
    v = n_chunks
    assert v >= 1, f"{n_chunks=} must be >= 1"
    if m % p:
        raise ValueError(f"interleaved 1F1B: n_microbatches={m} is not a multiple of n_stages={p}")

    def nth(k: int, backward: bool) -> tuple[int, int]:  # (microbatch, chunk) of the k-th one
        # lab 06.2 begin: groups of p*v: p microbatches per chunk; backwards take chunks last-first
        group, r = divmod(k, p * v)
        return group * p + r % p, (v - 1 - r // p if backward else r // p)
        # lab 06.2 end

    # warmup: (v-1)*p forwards take microbatch 0 to the last chunk; 2 more per later stage cover
    # the first backward's round trip (Megatron's choice; so v = 1 is not 1F1B's p - s - 1)
    warmup = min(m * v, (v - 1) * p + 2 * (p - stage - 1))
    ops = [op for k in range(warmup) for op in _fwd(*nth(k, False))]
    for k in range(m * v - warmup):  # steady: one forward, one backward
        ops += _fwd(*nth(warmup + k, False)) + _bwd(*nth(k, True))
    for k in range(m * v - warmup, m * v):  # cooldown
        ops += _bwd(*nth(k, True))
    return _drop_edges(ops, stage, p, v)


def schedule_zb_h1(n_stages: int, n_microbatches: int, stage: int) -> Program:
    """ZB-H1 (Zero Bubble): 1F1B with each backward split into B (input gradient) and W (weights).

    B is all the previous stage waits for, so it goes first; W only has to happen before the
    optimizer step. Stage s delays its W by s steps (the warmup forwards it has fewer than
    stage 0), so every stage holds min(p, m) microbatches until their W, as stage 0 of 1F1B
    does, and the delayed W fill the cooldown bubble.
    """
    return schedule_1f1b(n_stages, n_microbatches, stage, w_delay=stage)


def build_schedules(
    name: str, n_stages: int, n_microbatches: int, n_chunks: int = 1, place: bool = True
) -> list[Program]:
    """The programs of all stages for schedule `name` (in NAMES); comm by `place_comm` if place."""
    make = {"gpipe": schedule_gpipe, "1f1b": schedule_1f1b, "zb": schedule_zb_h1}
    make["interleaved"] = lambda p, m, s: schedule_interleaved(p, m, s, n_chunks)
    programs = [make[name](n_stages, n_microbatches, s) for s in range(n_stages)]
    return place_comm(programs) if place else programs


def peer(op: Op, stage: int, n_stages: int) -> tuple[int, Op]:
    """The stage and the op completing comm `op` of `stage`: send_act(i, c) on stage s meets
    recv_act(i, c') on virtual stage c*p + s + 1 (the next stage; from the last stage, the first
    stage's next chunk). Gradients go the other way."""
    virtual = op.chunk * n_stages + stage + (1 if op.kind in (SEND_ACT, RECV_GRAD) else -1)
    other = {SEND_ACT: RECV_ACT, RECV_ACT: SEND_ACT, SEND_GRAD: RECV_GRAD, RECV_GRAD: SEND_GRAD}
    return virtual % n_stages, Op(other[op.kind], op.microbatch, virtual // n_stages)


def check_matching(schedules: list[Program]) -> list[str]:
    """Problems found: each send needs its receive on the neighbouring stage, and back."""
    problems, present = [], [set(ops) for ops in schedules]
    for stage, ops in enumerate(schedules):
        for op in ops:
            other, match = peer(op, stage, len(schedules)) if op.kind not in COMPUTE else (0, op)
            if match.kind not in COMPUTE and match not in present[other]:
                problems.append(f"stage {stage}: {op} has no {match} on stage {other}")
    return problems


# the life of one (microbatch, chunk) on one stage: each op after those of lower rank
_RANK = {RECV_ACT: 0, FORWARD: 1, SEND_ACT: 2, RECV_GRAD: 3, BACKWARD: 4, BACKWARD_INPUT: 4}
_RANK |= {SEND_GRAD: 5, BACKWARD_WEIGHT: 5}  # W and the send after B: either order


def check_order(schedules: list[Program], n_microbatches: int) -> list[str]:
    """Problems found: each stage forwards every (microbatch, chunk) once, before its backward;
    one backward, or a B then a W; no op twice; the receives and sends its virtual stage needs,
    in the order of _RANK (an activation is sent before its gradient can come back)."""
    p, n_chunks = len(schedules), 1 + max(op.chunk for ops in schedules for op in ops)
    problems = []
    for stage, ops in enumerate(schedules):
        pos = {(i, c): {} for i in range(n_microbatches) for c in range(n_chunks)}
        for t, op in enumerate(ops):
            at = pos.get((op.microbatch, op.chunk))
            if at is None or op.kind in at:
                problems.append(f"stage {stage}: {op} is twice or outside m={n_microbatches}")
            else:
                at[op.kind] = t
        for (i, c), at in pos.items():
            split, virtual = BACKWARD_INPUT in at, c * p + stage
            need = {FORWARD, *((BACKWARD_INPUT, BACKWARD_WEIGHT) if split else (BACKWARD,))}
            need |= {RECV_ACT, SEND_GRAD} if p > 1 and virtual > 0 else set()
            need |= {SEND_ACT, RECV_GRAD} if p > 1 and virtual < p * n_chunks - 1 else set()
            where, kinds = f"stage {stage}, microbatch {i}, chunk {c}", sorted(at, key=at.get)
            problems += [f"{where}: no {kind}" for kind in sorted(need - set(at))]
            if [_RANK[k] for k in kinds] != sorted(_RANK[k] for k in kinds):
                problems.append(f"{where}: out of order: {', '.join(kinds)}")
    return problems


class Deadlock(RuntimeError):
    """No stage can move: every unfinished stage waits in a send or receive nobody will match."""


def simulate(
    schedules: list[Program],
    cost_f: float = 1,
    cost_b: float = 2,
    cost_w: float | None = None,
    rendezvous: bool = True,
) -> Timeline:
    """Run all stages' programs; per stage, the (start, end, op) of each compute op. Raises
    Deadlock, never hangs. A forward takes cost_f, a backward cost_b; split, W takes cost_w
    (default cost_b / 2) and B the rest; comm takes no time. rendezvous: blocking send/recv, a
    send and its receive complete together once both stages reach them; else eager sends
    (buffered, like isend) complete at once and a receive waits for its send."""
    cost_w = cost_b / 2 if cost_w is None else cost_w
    cost = dict(zip(COMPUTE, (cost_f, cost_b, cost_b - cost_w, cost_w), strict=True))
    n = len(schedules)
    timeline = [[] for _ in schedules]
    sent = {}
    moved = True
    pc, clock = [0] * n, [0.0] * n

    def at(s: int) -> Op | None:  # the op stage s waits at, None once it is done
        return schedules[s][pc[s]] if pc[s] < len(schedules[s]) else None

    while moved:  # sweep the stages, each as far as it can go, until none moves
        moved = False
        for s, ops in enumerate(schedules):
            while pc[s] < len(ops):
                op = ops[pc[s]]
                other, match = peer(op, s, n) if op.kind not in cost else (s, op)
                if op.kind in cost:
                    timeline[s].append((clock[s], clock[s] + cost[op.kind], op))
                    clock[s] += cost[op.kind]
                elif not rendezvous and op.kind in SENDS:
                    sent[s, op] = clock[s]
                elif not rendezvous and (other, match) in sent:
                    clock[s] = max(clock[s], sent[other, match])
                elif rendezvous and at(other) == match:
                    clock[s] = clock[other] = max(clock[s], clock[other])
                    pc[other] += 1
                else:
                    break  # blocked: the receive's send, or the send's peer, has not come yet
                pc[s], moved = pc[s] + 1, True
    if stuck := [f"stage {s} in {at(s)}" for s in range(n) if at(s)]:
        raise Deadlock("no stage can move; waiting: " + "; ".join(stuck))
    return timeline


def place_comm(schedules: list[Program], cost_f: float = 1, cost_b: float = 2) -> list[Program]:
    """The same compute order, each send and receive moved to where blocking comm is safe.

    Eager sends give each message's ideal times: ready when its producer ends, needed when its
    consumer starts. Both stages exchange it at the earliest moment in between at which neither
    is inside a compute op (if there is none, when it is needed, and someone waits). Every stage
    does its exchanges in one global order (that time, then the sender), so no cycle of stages
    can wait on each other: no deadlock under rendezvous, whatever the real costs.
    """
    timeline = simulate(schedules, cost_f, cost_b, rendezvous=False)
    starts = [[a for a, _, _ in ops] for ops in timeline]
    ends = [[b for _, b, _ in ops] for ops in timeline]
    when, meet = {}, {}  # (stage, comm op) -> end of the compute before (send), start after (recv)
    for s, ops in enumerate(schedules):
        for k, op in zip(accumulate(o.kind in COMPUTE for o in ops), ops, strict=True):
            if op.kind not in COMPUTE:  # k: the compute ops up to here
                when[s, op] = ends[s][k - 1] if op.kind in SENDS else starts[s][k]

    def free(s: int, t: float) -> bool:  # stage s is not inside a compute op at time t
        i = bisect.bisect_left(starts[s], t) - 1
        return i < 0 or ends[s][i] <= t

    for (s, op), ready in when.items():
        if op.kind in SENDS:
            other, match = peer(op, s, len(schedules))
            need = when[other, match]
            moments = [ready] + [t for x in (s, other) for t in ends[x] if ready < t <= need]
            t = min((t for t in moments if free(s, t) and free(other, t)), default=need)
            meet[s, op] = meet[other, match] = (t, 0, s, op.kind, op.microbatch, op.chunk)
    placed = []
    for s, ops in enumerate(schedules):
        compute = [op for op in ops if op.kind in COMPUTE]
        keyed = [((starts[s][k], 1, k), op) for k, op in enumerate(compute)]  # after comm at t
        keyed += [(meet[s, op], op) for op in ops if op.kind not in COMPUTE]
        placed.append([op for _, op in sorted(keyed, key=lambda pair: pair[0])])
    return placed


def timeline_rows(timeline: Timeline | Rows) -> Rows:
    """(stage, start, end, label) rows, measured or simulated ('F3.1': forward, mb 3, chunk 1)."""
    if not (isinstance(timeline[0], list) and isinstance(timeline[0][0], tuple)):
        return list(map(tuple, timeline))
    chunked = any(op.chunk for ops in timeline for _, _, op in ops)
    return [
        (s, a, b, f"{LETTER[op.kind]}{op.microbatch}" + (f".{op.chunk}" if chunked else ""))
        for s, ops in enumerate(timeline)
        for a, b, op in ops
    ]


def bubble_fraction(timeline: Timeline | Rows) -> float:
    """Idle / total, 1 - busy / (n_stages * makespan), of a Timeline or measured compute rows."""
    rows = timeline_rows(timeline)
    makespan = max(r[2] for r in rows) - min(r[1] for r in rows)
    return 1 - sum(b - a for _, a, b, _ in rows) / ((1 + max(r[0] for r in rows)) * makespan)


def bubble_formula(name: str, n_stages: int, n_microbatches: int, n_chunks: int = 1) -> float:
    """The papers' bubble as idle / total: (p-1)/(m+p-1), (p-1)/(v*m+p-1), (p-1)/(3*m+p-1).
    They give bubble / ideal time: (p-1)/m (GPipe, 1F1B), (p-1)/(v*m) (interleaved), and for
    ZB-H1 (p-1)(t_F + t_B - t_W) / (m (t_F + t_B + t_W)), here with t_F = t_B = t_W."""
    p, m = n_stages, n_microbatches
    ideal = {"gpipe": m, "1f1b": m, "interleaved": n_chunks * m, "zb": 3 * m}[name]
    return (p - 1) / (ideal + p - 1)


def peak_activations(ops: Program, until_weight: bool = False) -> int:
    """The most microbatches (of any chunk) whose activations one stage stores at once.
    A forward stores one; its backward, or the B of a split backward, frees it (W still reads
    the layer inputs, M_W in the ZB paper: until_weight counts a microbatch until its W)."""
    free = {BACKWARD, BACKWARD_WEIGHT if until_weight else BACKWARD_INPUT}
    return max(accumulate((op.kind == FORWARD) - (op.kind in free) for op in ops), default=0)


def text_grid(timeline: Timeline | Rows) -> str:
    """One row per stage, one column per time unit: the op running then, '.' when idle."""
    rows = timeline_rows(timeline)
    width = max(len(r[3]) for r in rows)
    grid = [["."] * round(max(r[2] for r in rows)) for _ in range(1 + max(r[0] for r in rows))]
    for s, a, b, name in rows:
        grid[s][round(a) : round(b)] = [name] * (round(b) - round(a))
    lines = [" ".join(x.rjust(width) for x in cells) for cells in grid]
    return "\n".join(f"stage {s} | {line}" for s, line in enumerate(lines))
