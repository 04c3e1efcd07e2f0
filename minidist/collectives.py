"""Collectives by hand: all-reduce, reduce-scatter, all-gather and broadcast from send/recv only.

Equals: the library's comm.all_reduce / reduce_scatter / all_gather / broadcast, exactly for
integer-valued data in every dtype; floats may differ in the last bits because each algorithm
adds in its own order. Whatever the algorithm, every rank ends with bitwise the same tensor.
Communication per step, per rank (p ranks, N elements of b bytes, only point-to-point):
    naive               root receives and sends (p-1) N b; others send N b, receive N b
    recursive doubling  log2(p) exchanges of N b (+1 each way on the extra ranks if p is not
                        a power of two): latency-optimal, bandwidth-poor
    ring                2 (p-1) messages of N/p elements: sends 2 (p-1)/p N b, all to rank+1
Memory per rank: naive and recursive doubling N b extra, ring N/p b extra (plus N b when the
tensor is not contiguous, for a contiguous copy).
Ladder: naive (root folds in rank order) -> recursive_doubling (log2 p rounds, for small
messages) -> ring_reduce_scatter + ring_all_gather = ring_all_reduce (bandwidth-optimal) ->
all_reduce picks by size.
Paper: Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA 2005), sections 4.4-4.5; Patarasuk, Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations" (JPDC 2009), section 3.
Lesson: lessons/02_collectives/.   Run: minidist bench allreduce -n 2 --backend mpi
"""

from __future__ import annotations

import torch

from minidist.comm.protocol import Comm, check_op, check_peer, reduce_

ALGORITHMS = ("naive", "recursive_doubling", "ring")
# all_reduce(algorithm="auto") switches to the ring from this many bytes on; measured with
# `minidist bench allreduce -n 2 --backend mpi` on a 2-core machine (the crossover lay between
# 16 KiB and 64 KiB); larger worlds favour recursive doubling for longer (log2 p vs 2(p-1) rounds)
RING_FROM_BYTES = 32 * 1024


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """[(lo, hi)] of the p chunks of n elements: chunk i is [i*n//p, (i+1)*n//p), sizes differ
    by at most one, and empty chunks are allowed (n < p)."""
    return [(i * n // p, (i + 1) * n // p) for i in range(p)]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of t's elements (sharing memory), or a contiguous copy if t is strided."""
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _finish(t: torch.Tensor, flat: torch.Tensor, op: str, p: int) -> torch.Tensor:
    """Divide once for "avg", then copy the result into t unless flat already is t's memory."""
    if op == "avg":
        flat.div_(p)
    if flat.data_ptr() != t.data_ptr():  # flat is a copy (t is strided, or a work buffer)
        t.detach().copy_(flat.view(t.shape))
    return t


def naive_all_reduce(t: torch.Tensor, comm: Comm, op: str = "sum") -> torch.Tensor:
    """All-reduce t in place through root 0, and return it.

    Each rank: t any shape, the same on every rank. Rank 0 receives every other rank's t in rank
    order and folds it in, then sends the result to each rank. 2 (p-1) messages of N b, all
    through rank 0: its link carries (p-1) times what a ring link carries.
    """
    check_op(op, t.dtype)
    p, r = comm.world_size, comm.rank
    flat = _flat(t)  # (N,)
    if r == 0:
        got = torch.empty_like(flat)  # (N,)
        # receive in rank order: the fold t0 op t1 op ... is the library's order, bitwise
        for src in range(1, p):
            comm.recv(got, src)
            reduce_(flat, got, op)
        if op == "avg":
            flat.div_(p)
        for dst in range(1, p):
            comm.send(flat, dst)
        return _finish(t, flat, "sum", p)
    comm.send(flat, 0)
    comm.recv(flat, 0)  # the root's result, already divided for "avg"
    return _finish(t, flat, "sum", p)


def recursive_doubling_all_reduce(t: torch.Tensor, comm: Comm, op: str = "sum") -> torch.Tensor:
    """All-reduce t in place by recursive doubling, and return it: latency-optimal.

    Each rank: t any shape, the same on every rank. With q = 2^floor(log2 p) and e = p - q, ranks
    0 .. 2e-1 pair up first: each even one sends its t to the odd one above it and sits out.
    The q remaining ranks, renumbered v = 0 .. q-1, exchange their whole partial result with
    v XOR 1, v XOR 2, v XOR 4, ...: after round k each holds the reduction over a group of
    2^(k+1). Finally each odd rank sends the result back to its even partner. Messages of N b:
    log2(q) exchanges, plus one each way on the 2e paired ranks.
    """
    check_op(op, t.dtype)
    p, r = comm.world_size, comm.rank
    flat = _flat(t)  # (N,)
    acc, got = flat, torch.empty_like(flat)  # (N,) each; they swap roles, never copy
    q = 1 << (p.bit_length() - 1)  # the largest power of two <= p
    extra = p - q
    if r < 2 * extra and r % 2 == 0:
        comm.send(acc, r + 1)  # sit out: the odd partner reduces for both of us
        comm.recv(acc, r + 1)  # ... and sends the final result back
        return _finish(t, acc, op, p)
    if r < 2 * extra:
        comm.recv(got, r - 1)
        reduce_(got, acc, op)  # the lower rank's value first (see below)
        acc, got = got, acc
    v = r // 2 if r < 2 * extra else r - extra  # this rank among the q that take part
    # lab 02.3 begin: swap acc with real peer of virtual rank v ^ mask, lower rank's value first
    mask = 1
    while mask < q:
        pv = v ^ mask
        peer = 2 * pv + 1 if pv < extra else pv + extra  # virtual rank -> real rank
        recv = comm.irecv(got, peer)  # both posted before either waits: they overlap
        send = comm.isend(acc, peer)
        recv.wait()
        # the fold below may overwrite acc, and the next round receives into got: the send
        # of acc must have left first
        send.wait()
        # both partners compute lower (op) higher, in that order, so they agree bitwise even
        # where op is not symmetric in its bits (torch.maximum(-0.0, +0.0) keeps the first)
        if v < pv:
            reduce_(acc, got, op)
        else:
            reduce_(got, acc, op)
            acc, got = got, acc
        mask <<= 1
    # lab 02.3 end
    if r < 2 * extra:
        comm.send(acc, r - 1)
    if acc is not flat:
        flat.copy_(acc)
    return _finish(t, flat, op, p)


def _ring_reduce_scatter_flat(buf: torch.Tensor, comm: Comm, op: str) -> torch.Tensor:
    """Reduce-scatter buf (N,) in place around the ring; afterwards this rank's chunk of buf,
    buf[lo_r:hi_r] with chunk_bounds, holds the reduction over all ranks (not divided for
    "avg"). The other chunks hold partial sums. p-1 steps, each sends one chunk to rank+1 and
    receives one from rank-1."""
    p, r = comm.world_size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    bounds = chunk_bounds(buf.numel(), p)
    # the last chunk is the largest: ceil(N/p) elements
    got = torch.empty(bounds[-1][1] - bounds[-1][0], dtype=buf.dtype, device=buf.device)
    # lab 02.1 begin: send chunk (r-s-1)%p right, receive (r-s-2)%p from the left, reduce it in
    for s in range(p - 1):
        lo, hi = bounds[(r - s - 1) % p]  # the chunk reduced in the previous step (s=0: own data)
        rlo, rhi = bounds[(r - s - 2) % p]  # it arrives holding the sum over s+1 ranks
        recv = comm.irecv(got[: rhi - rlo], left)  # both posted before either waits: they overlap
        send = comm.isend(buf[lo:hi], right)
        recv.wait()
        reduce_(buf[rlo:rhi], got[: rhi - rlo], op)  # a different chunk than the one in flight
        # the next step receives into `got` again and sends buf[rlo:rhi]; wait so that at most
        # one send is in flight (no unbounded queue)
        send.wait()
    # lab 02.1 end
    return buf


def _ring_all_gather_flat(buf: torch.Tensor, comm: Comm) -> torch.Tensor:
    """All-gather buf (N,) in place around the ring: rank r's chunk buf[lo_r:hi_r] must be valid
    on entry; afterwards every chunk is, on every rank. p-1 steps, each sends the chunk received
    in the previous step (s=0: its own) to rank+1 and receives the next one from rank-1."""
    p, r = comm.world_size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    bounds = chunk_bounds(buf.numel(), p)
    # lab 02.2 begin: send chunk (r-s)%p right, receive chunk (r-s-1)%p from the left into buf
    for s in range(p - 1):
        lo, hi = bounds[(r - s) % p]
        rlo, rhi = bounds[(r - s - 1) % p]
        recv = comm.irecv(buf[rlo:rhi], left)  # received in place: no copy, no reduction
        send = comm.isend(buf[lo:hi], right)
        recv.wait()
        send.wait()  # keep at most one send in flight
    # lab 02.2 end
    return buf


def ring_all_reduce(t: torch.Tensor, comm: Comm, op: str = "sum") -> torch.Tensor:
    """All-reduce t in place around the ring, and return it: bandwidth-optimal.

    Each rank: t any shape, the same on every rank (numel need not divide by p). A ring
    reduce-scatter leaves rank r with the reduced chunk r; for "avg" it divides just that chunk;
    a ring all-gather hands every chunk to every rank. Sends 2 (p-1) messages, 2 (p-1)/p N b in
    all (for N divisible by p), all to rank+1; receives as many from rank-1.
    """
    check_op(op, t.dtype)
    p, r = comm.world_size, comm.rank
    flat = _flat(t)  # (N,); reduced in place: the ring needs no second full-size buffer
    _ring_reduce_scatter_flat(flat, comm, op)
    if op == "avg":
        lo, hi = chunk_bounds(flat.numel(), p)[r]
        flat[lo:hi].div_(p)  # one division per element, before the copies: every rank agrees
    _ring_all_gather_flat(flat, comm)
    return _finish(t, flat, "sum", p)


def ring_reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, comm: Comm, op: str = "sum"
) -> torch.Tensor:
    """Fill out with this rank's chunk of the reduction of inp over all ranks, and return it.

    Each rank: inp any shape with N elements, the same on every rank; out any shape with
    hi - lo elements, where (lo, hi) = chunk_bounds(N, p)[rank], i.e. lo = rank*N//p. Rank r
    gets the reduction of inp.reshape(-1)[lo:hi]. When p divides N this is exactly
    comm.reduce_scatter(out, inp, op) (out has N/p elements). inp is not modified. Sends p-1
    messages to rank+1, (p-1)/p N b in all.
    """
    check_op(op, inp.dtype)
    p, r = comm.world_size, comm.rank
    lo, hi = chunk_bounds(inp.numel(), p)[r]
    if out.numel() != hi - lo or out.dtype != inp.dtype:
        raise ValueError(
            f"ring_reduce_scatter: out must hold rank {r}'s chunk of inp: {hi - lo} x "
            f"{inp.dtype} (inp.numel()={inp.numel()}, world_size={p}), got {out.numel()} x "
            f"{out.dtype}"
        )
    buf = inp.detach().reshape(-1).clone()  # (N,): a work copy, so inp stays as it was
    _ring_reduce_scatter_flat(buf, comm, op)
    mine = buf[lo:hi]  # (hi - lo,)
    return _finish(out, mine, op, p)


def ring_all_gather(out: torch.Tensor, inp: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Fill out with every rank's inp, in rank order, and return it.

    Each rank: out any shape with N elements, the same on every rank; inp any shape with hi - lo
    elements, (lo, hi) = chunk_bounds(N, p)[rank]. Afterwards out.reshape(-1)[lo_i:hi_i] holds
    rank i's inp, on every rank. When p divides N this is exactly comm.all_gather(out, inp).
    Sends p-1 messages to rank+1, (p-1)/p N b in all.
    """
    p, r = comm.world_size, comm.rank
    lo, hi = chunk_bounds(out.numel(), p)[r]
    if inp.numel() != hi - lo or out.dtype != inp.dtype:
        raise ValueError(
            f"ring_all_gather: inp must hold rank {r}'s chunk of out: {hi - lo} x {out.dtype} "
            f"(out.numel()={out.numel()}, world_size={p}), got {inp.numel()} x {inp.dtype}"
        )
    flat = _flat(out)  # (N,)
    flat[lo:hi] = inp.detach().reshape(-1)
    _ring_all_gather_flat(flat, comm)
    return _finish(out, flat, "sum", p)


def broadcast(t: torch.Tensor, comm: Comm, src: int) -> torch.Tensor:
    """Overwrite t on every rank with src's t along a binomial tree, and return it.

    Each rank: t any shape, the same on every rank. Numbered v = (rank - src) mod p, rank v
    receives from v minus its lowest set bit, then sends to v + 2^k for each 2^k below that bit,
    farthest first. ceil(log2 p) rounds; every rank but src receives N b once; p-1 messages.
    """
    check_peer(comm, src, "src")
    p = comm.world_size
    v = (comm.rank - src) % p
    flat = _flat(t)  # (N,)
    mask = 1
    while mask < p:
        if v & mask:
            comm.recv(flat, (v - mask + src) % p)
            break
        mask <<= 1
    # send only after receiving (above): a rank forwards what it got. The farthest child first,
    # because its subtree is the largest and has the most rounds still to go
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            comm.send(flat, (v + mask + src) % p)
        mask >>= 1
    return _finish(t, flat, "sum", p)


def all_reduce(
    t: torch.Tensor, comm: Comm, op: str = "sum", algorithm: str = "auto"
) -> torch.Tensor:
    """All-reduce t in place with the named algorithm, and return it.

    algorithm: "naive", "recursive_doubling", "ring", or "auto": recursive doubling below
    RING_FROM_BYTES (few rounds matter most), the ring from there on (bytes matter most). t's
    size decides, so every rank chooses the same.
    """
    if algorithm == "auto":
        small = t.numel() * t.element_size() < RING_FROM_BYTES
        algorithm = "recursive_doubling" if small else "ring"
    if algorithm == "naive":
        return naive_all_reduce(t, comm, op)
    if algorithm == "recursive_doubling":
        return recursive_doubling_all_reduce(t, comm, op)
    if algorithm == "ring":
        return ring_all_reduce(t, comm, op)
    raise ValueError(f"algorithm={algorithm!r} is not 'auto' or one of {ALGORITHMS}")
