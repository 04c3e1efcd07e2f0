"""Collectives from send/recv only: all-reduce, reduce-scatter, all-gather, broadcast, all-to-all.

Equals: the library's all_reduce, reduce_scatter, all_gather, broadcast (all_to_all: MPI's
Alltoallv), exactly for integer-valued data in every dtype; floats may differ in the last bits
(each algorithm adds in its own order). Whatever the algorithm, every rank ends bitwise equal.
Communication per step, per rank (p ranks, N elements of b bytes, only point-to-point):
    naive               root receives and sends (p-1) N b; others send N b, receive N b
    recursive doubling  log2(p) exchanges of N b (+1 each way on the extra ranks if p is not
                        a power of two): latency-optimal, bandwidth-poor
    ring                2 (p-1) steps of N/p elements: sends 2 (p-1)/p N b, all to rank+1
                        (a reduce-scatter step's chunk goes in fragments of FRAGMENT_BYTES)
    all-to-all          p-1 pairwise steps: sends 8 (p-1) (counts) + (N - n_rr) b; N rows of b
                        bytes, n_rr of them for this rank itself
Memory per rank: naive and recursive doubling N b extra, the ring 2 fragments (at most
2 FRAGMENT_BYTES) extra; N b more when the tensor is not contiguous (a contiguous copy).
Tags: each collective's messages carry its own (comm/tagged.py): never taken by another one.
Ladder: naive (root folds in rank order) -> recursive_doubling (log2 p rounds, for small
messages) -> ring_reduce_scatter + ring_all_gather = ring_all_reduce (bandwidth-optimal) ->
all_reduce picks by size -> all_to_all (uneven rows to every rank); started without waiting, to
overlap with compute: collectives/overlap.py.
Paper: Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA 2005), sections 4.4-4.5; Patarasuk, Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations" (JPDC 2009), section 3.
Lesson: lessons/02_collectives/.   Run: minidist bench allreduce -n 2 --backend mpi
"""

from __future__ import annotations

import torch

from minidist.comm.protocol import Comm, Work, check_op, check_peer, reduce_
from minidist.comm.tagged import tag_of, tagged

ALGORITHMS = ("naive", "recursive_doubling", "ring")
# all_reduce(algorithm="auto") switches to the ring from this many bytes on. `minidist bench
# allreduce -n 2 --backend mpi` (quiet 2-core VM, lesson 02): recursive doubling / ring 0.54-0.80
# up to 64 KiB, 1.00 at 256 KiB, 1.38-1.74 from 1 MiB. With more ranks the ring wins earlier
# (log2(p) N bytes per rank against 2 (p-1)/p N); NCCL picks its own (lesson 02)
RING_FROM_BYTES = 256 << 10
# the ring moves a chunk in fragments of at most this many bytes, received into two reused
# slots: a scratch buffer as large as a chunk would be allocated, and page-faulted, on every
# call (about 15 ms for 32 MiB here, more than sending it), and fragments let receiving overlap
# reducing
FRAGMENT_BYTES = 1 << 20


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """[(lo, hi)] of the p chunks of n elements: chunk i is [i*n//p, (i+1)*n//p), sizes differ
    by at most one, and empty chunks are allowed (n < p)."""
    return [(i * n // p, (i + 1) * n // p) for i in range(p)]


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """t's elements as a 1-D tensor with unit stride: a view of t when its memory allows, else a
    copy (always for an empty t: torch calls it contiguous whatever its strides)."""
    t = t.detach()
    if t.is_contiguous() and t.numel() > 0:
        return t.view(-1)
    return t.clone(memory_format=torch.contiguous_format).view(-1)


def copy_back(t: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """t, holding result's values: copied in unless result already is t's memory."""
    if result.data_ptr() != t.data_ptr():  # a copy (t is strided) or a work buffer
        t.detach().copy_(result.view(t.shape))
    return t


def naive_all_reduce(t: torch.Tensor, comm: Comm, op: str = "sum") -> torch.Tensor:
    """All-reduce t in place through root 0, and return it.

    Each rank: t any shape, the same on every rank. Rank 0 receives every other rank's t in rank
    order and folds it in, then sends the result to each rank. 2 (p-1) messages of N b, all
    through rank 0: its link carries (p-1) times what a ring link carries.
    """
    check_op(op, t.dtype)
    comm = tagged(comm, tag_of("naive_all_reduce", op))
    p, r = comm.world_size, comm.rank
    flat = flat_view(t)  # (N,)
    if r == 0:
        got = torch.empty_like(flat)  # (N,)
        # receive in rank order: the fold t0 op t1 op ... is the library's order, bitwise
        for src in range(1, p):
            comm.recv(got, src)
            reduce_(flat, got, op)
        if op == "avg":
            flat.div_(p)  # once, at the root: every rank gets the same quotient
        for dst in range(1, p):
            comm.send(flat, dst)
        return copy_back(t, flat)
    comm.send(flat, 0)
    comm.recv(flat, 0)  # the root's result
    return copy_back(t, flat)


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
    comm = tagged(comm, tag_of("recursive_doubling_all_reduce", op))
    p, r = comm.world_size, comm.rank
    flat = flat_view(t)  # (N,)
    acc, got = flat, torch.empty_like(flat)  # (N,) each; they swap roles, never copy
    q = 1 << (p.bit_length() - 1)  # the largest power of two <= p
    extra = p - q
    if r < 2 * extra and r % 2 == 0:
        comm.send(acc, r + 1)  # sit out: the odd partner reduces for both of us
        comm.recv(acc, r + 1)  # ... and sends the final result back
        return copy_back(t, acc.div_(p) if op == "avg" else acc)
    if r < 2 * extra:
        comm.recv(got, r - 1)
        reduce_(got, acc, op)  # the lower rank's value first (see below)
        acc, got = got, acc
    v = r // 2 if r < 2 * extra else r - extra  # this rank among the q that take part
    # lab 02.3 begin: each round: swap with the partner one bit away (a real rank), lower rank first
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
        comm.send(acc, r - 1)  # the sum, undivided: the partner divides it just like we do
    return copy_back(t, acc.div_(p) if op == "avg" else acc)


def ring_reduce_scatter_flat(buf: torch.Tensor, comm: Comm, op: str) -> torch.Tensor:
    """Reduce-scatter buf (N,) in place around the ring: afterwards buf[lo_r:hi_r] (chunk_bounds)
    holds the reduction over all ranks (undivided for "avg"), the others partial sums. p-1
    steps: one chunk to rank+1 and one from rank-1 each, in fragments of at most
    FRAGMENT_BYTES."""
    p, r = comm.world_size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    bounds = chunk_bounds(buf.numel(), p)
    fragment = max(1, FRAGMENT_BYTES // buf.element_size())
    # two slots: one fragment arrives while the other is reduced (the last chunk is the largest)
    scratch = buf.new_empty((2, min(fragment, bounds[-1][1] - bounds[-1][0])))
    # lab 02.1 begin: p-1 steps: send right what you last reduced; reduce in what the left sends
    for s in range(p - 1):
        lo, hi = bounds[(r - s - 1) % p]  # reduced in the previous step (s=0: this rank's own)
        rlo, rhi = bounds[(r - s - 2) % p]  # it arrives holding the reduction over s+1 ranks
        # send first, without waiting: the left neighbour is sending to us at the same time
        sends = _isend_fragments(buf[lo:hi], comm, right, fragment)
        _recv_reduce_fragments(buf[rlo:rhi], comm, left, op, fragment, scratch)
        # the next step reduces into buf[rlo:rhi] and sends it, never buf[lo:hi]; wait anyway so
        # that sends in flight stay bounded by one chunk
        for send in sends:
            send.wait()
    # lab 02.1 end
    return buf


def _isend_fragments(x: torch.Tensor, comm: Comm, dst: int, fragment: int) -> list[Work]:
    """Start sending x (n,) to dst as ceil(n/fragment) messages (none if n = 0)."""
    return [comm.isend(x[i : i + fragment], dst) for i in range(0, x.numel(), fragment)]


def _recv_reduce_fragments(
    acc: torch.Tensor, comm: Comm, src: int, op: str, fragment: int, scratch: torch.Tensor
) -> torch.Tensor:
    """acc (n,) <- acc (op) what src sends with _isend_fragments(.., fragment), through scratch
    (2, >= min(fragment, n)).

    Fragment j+1 is already being received into one slot while fragment j, in the other, is
    reduced: the network and the adder work at the same time, and a fragment is reduced while
    it is still in cache. Only 2 fragments of extra memory, however large acc: no allocation
    per chunk.
    """
    n = acc.numel()
    starts = range(0, n, fragment)
    pending = {0: comm.irecv(scratch[0, : min(fragment, n)], src)} if n else {}
    for j, i in enumerate(starts):
        m = min(fragment, n - i)
        if j + 1 < len(starts):  # slot (j+1)%2 held fragment j-1, already reduced
            m_next = min(fragment, n - starts[j + 1])
            pending[j + 1] = comm.irecv(scratch[(j + 1) % 2, :m_next], src)
        pending.pop(j).wait()
        reduce_(acc[i : i + m], scratch[j % 2, :m], op)
    return acc


def ring_all_gather_flat(buf: torch.Tensor, comm: Comm) -> torch.Tensor:
    """All-gather buf (N,) in place around the ring: rank r's chunk buf[lo_r:hi_r] must be valid
    on entry; afterwards every chunk is, on every rank. p-1 steps, each sends the chunk received
    in the previous step (s=0: its own) to rank+1 and receives the next one from rank-1."""
    p, r = comm.world_size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    bounds = chunk_bounds(buf.numel(), p)
    # lab 02.2 begin: p-1 steps: send right what you last completed; take the next from the left
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
    a ring all-gather hands every chunk to every rank. 2 (p-1) steps; sends 2 (p-1)/p N b in
    all (for N divisible by p), all to rank+1; receives as many from rank-1.
    """
    check_op(op, t.dtype)
    comm = tagged(comm, tag_of("ring_all_reduce", op))  # both halves: see comm/tagged.py
    p, r = comm.world_size, comm.rank
    flat = flat_view(t)  # (N,); reduced in place: the ring needs no second full-size buffer
    ring_reduce_scatter_flat(flat, comm, op)
    if op == "avg":
        lo, hi = chunk_bounds(flat.numel(), p)[r]
        flat[lo:hi].div_(p)  # one division per element, before the copies: every rank agrees
    ring_all_gather_flat(flat, comm)
    return copy_back(t, flat)


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
    comm = tagged(comm, tag_of("ring_reduce_scatter", op))
    p, r = comm.world_size, comm.rank
    lo, hi = chunk_bounds(inp.numel(), p)[r]
    if out.numel() != hi - lo or out.dtype != inp.dtype:  # rank r's chunk of inp
        got = f"{out.numel()} x {out.dtype} (rank {r}, inp.numel()={inp.numel()}, world_size={p})"
        raise ValueError(f"ring_reduce_scatter: out must be {hi - lo} x {inp.dtype}, got {got}")
    buf = inp.detach().clone(memory_format=torch.contiguous_format).view(-1)  # (N,): inp stays
    ring_reduce_scatter_flat(buf, comm, op)
    mine = buf[lo:hi]  # (hi - lo,)
    return copy_back(out, mine.div_(p) if op == "avg" else mine)


def ring_all_gather(out: torch.Tensor, inp: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Fill out with every rank's inp, in rank order, and return it.

    Each rank: out any shape with N elements, the same on every rank; inp any shape with hi - lo
    elements, (lo, hi) = chunk_bounds(N, p)[rank]. Afterwards out.reshape(-1)[lo_i:hi_i] holds
    rank i's inp, on every rank. When p divides N this is exactly comm.all_gather(out, inp).
    Sends p-1 messages to rank+1, (p-1)/p N b in all.
    """
    comm = tagged(comm, tag_of("ring_all_gather"))
    p, r = comm.world_size, comm.rank
    lo, hi = chunk_bounds(out.numel(), p)[r]
    if inp.numel() != hi - lo or out.dtype != inp.dtype:  # rank r's chunk of out
        got = f"{inp.numel()} x {inp.dtype} (rank {r}, out.numel()={out.numel()}, world_size={p})"
        raise ValueError(f"ring_all_gather: inp must be {hi - lo} x {out.dtype}, got {got}")
    flat = flat_view(out)  # (N,)
    flat[lo:hi] = inp.detach().reshape(-1)
    ring_all_gather_flat(flat, comm)
    return copy_back(out, flat)


def broadcast(t: torch.Tensor, comm: Comm, src: int) -> torch.Tensor:
    """Overwrite t on every rank with src's t along a binomial tree, and return it.

    Each rank: t any shape, the same on every rank. Numbered v = (rank - src) mod p, rank v
    receives from v minus its lowest set bit, then sends to v + 2^k for each 2^k below that bit,
    farthest first. ceil(log2 p) rounds; every rank but src receives N b once; p-1 messages.
    """
    check_peer(comm, src, "src")
    comm = tagged(comm, tag_of("broadcast"))
    p = comm.world_size
    v = (comm.rank - src) % p
    flat = flat_view(t)  # (N,)
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
    return copy_back(t, flat)


def all_to_all(
    x: torch.Tensor, send_counts: list[int], comm: Comm, recv_counts: list[int] | None = None
) -> tuple[torch.Tensor, list[int]]:
    """(y, recv_counts): the rows every rank sends this rank, by pairwise exchange.

    x (N, ...): its next send_counts[j] rows go to rank j. y: rank 0's rows for this rank, then
    rank 1's, ...; recv_counts[i] = rank i's send_counts[rank], exchanged first unless given
    (a backward knows them). Step s = 1..p-1 sends to rank+s, receives from rank-s.
    """
    comm = tagged(comm, tag_of("all_to_all"))
    p, r = comm.world_size, comm.rank
    n = x.shape[0] if x.dim() else "0-d"
    if len(send_counts) != p or min(send_counts) < 0 or sum(send_counts) != n:
        msg = f"send_counts={list(send_counts)} must be {p} counts >= 0 summing to x.shape[0]={n}"
        raise ValueError("all_to_all: " + msg)
    if recv_counts is None:
        counts = torch.tensor(send_counts, dtype=torch.int64)  # (p,): one count to each rank
        recv_counts = all_to_all(counts, [1] * p, comm, [1] * p)[0].tolist()
    x = x.detach().contiguous()  # (N, ...): each block a contiguous run of rows
    y = x.new_empty((sum(recv_counts), *x.shape[1:]))  # (M, ...)
    blocks, into = x.split(send_counts), y.split(recv_counts)
    into[r].copy_(blocks[r])
    for s in range(1, p):
        dst, src = (r + s) % p, (r - s) % p
        # both posted before either waits (rank+s sends to its rank+s now); empty blocks: no message
        works = [comm.irecv(into[src], src)] if into[src].numel() else []
        works += [comm.isend(blocks[dst], dst)] if blocks[dst].numel() else []
        for work in works:
            work.wait()
    return y, recv_counts


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
