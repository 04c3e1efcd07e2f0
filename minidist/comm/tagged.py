"""A tag per hand-written collective, so two different collectives never exchange messages.

The collectives of minidist/collectives/algorithms.py are built from send and recv. With one tag for
all of them, rank 0 in `ring_all_reduce` and rank 1 in `ring_all_gather` (or in
`recursive_doubling_all_reduce`) would take each other's messages wherever the sizes fit, and
return wrong numbers. So each public collective starts with

    comm = tagged(comm, tag_of("ring_all_reduce", op))

and every message it sends or receives without a tag of its own carries that one, a tag per
collective and reduction op: a message of another collective, or of the same one reducing with
another op (sum on one rank, max on the other), never matches, the waiting rank times out, and
the timeout names the collective it waited in and, where the backend can see it, what the peer
sent instead (`timeout_note`). Cost: one Python call per message (the view's send/recv/isend/irecv).
"""

from __future__ import annotations

from .protocol import MAX_TAG, OPS

# the top of the user range: clear of tag 0 (user code's default), context_parallel's 0-3,
# parameter_server's 81-82 and the pipeline's 3 (microbatch * n_virtual + boundary) + kind.
# ring_all_reduce's reduce-scatter and all-gather halves send with ring_all_reduce's own tag:
# a rank in ring_all_reduce must not match a rank in a lone ring_reduce_scatter or
# ring_all_gather either (for "avg" they divide at other points)
NAMES = (
    "naive_all_reduce",
    "recursive_doubling_all_reduce",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_all_gather",
    "broadcast",
    "all_to_all",
    "hierarchical_all_reduce",
)
# (name, op) -> tag; op None for the collectives that reduce nothing: MAX_TAG-1 .. MAX_TAG-40
TAGS = {
    (name, op): MAX_TAG - 1 - i - len(NAMES) * k
    for k, op in enumerate((None, *OPS))
    for i, name in enumerate(NAMES)
}
COLLECTIVE_OF = {tag: name if op is None else f"{name}({op})" for (name, op), tag in TAGS.items()}


def tag_of(name: str, op: str | None = None) -> int:
    """The tag of collective `name` reducing with `op` (None: it reduces nothing)."""
    return TAGS[(name, op)]


class TaggedComm:
    """comm, except that send/recv/isend/irecv without a tag use `tag`; everything else is
    comm's own (attributes, collectives, split)."""

    def __init__(self, comm, tag: int):
        self.inner, self.tag = comm, tag
        self.rank, self.world_size = comm.rank, comm.world_size

    def __getattr__(self, name):  # backend, timeout, all_reduce, split, ... of the inner comm
        return getattr(self.inner, name)

    def send(self, t, dst, tag=None):
        return self.inner.send(t, dst, self.tag if tag is None else tag)

    def recv(self, t, src, tag=None):
        return self.inner.recv(t, src, self.tag if tag is None else tag)

    def isend(self, t, dst, tag=None):
        return self.inner.isend(t, dst, self.tag if tag is None else tag)

    def irecv(self, t, src, tag=None):
        return self.inner.irecv(t, src, self.tag if tag is None else tag)


def tagged(comm, tag: int) -> TaggedComm:
    """A view of comm whose messages carry `tag` by default (a view of a view: of the inner
    comm, so a collective called inside another sends with its own tag, one call deep)."""
    return TaggedComm(comm.inner if isinstance(comm, TaggedComm) else comm, tag)


def label(tag: int) -> str:
    """'from ring_all_reduce' for a collective's tag, else 'with tag 5'."""
    name = COLLECTIVE_OF.get(tag)
    return f"with tag {tag}" if name is None else f"from {name}"


def timeout_note(tag: int, peer: int, sent: list[tuple[int, str]] | None) -> str:
    """What a timed-out send or receive with `tag` adds to its message: the collective it waited
    in, and what `peer` sent this rank that no receive took: sent = [(tag, '4 x torch.float32')]
    ([] for nothing; None where the backend cannot see it). '' for a user tag and nothing seen."""
    words = [f"waiting in {COLLECTIVE_OF[tag]}"] if tag in COLLECTIVE_OF else []
    if sent:
        messages = ", ".join(f"{what} {label(t)}" for t, what in sent)
        words.append(f"rank {peer} sent this rank {messages}, which no receive here takes")
        if tag in COLLECTIVE_OF and any(t in COLLECTIVE_OF and t != tag for t, _ in sent):
            words.append("the ranks called different collectives")
    elif sent is None and words:
        words.append(f"this backend cannot see what rank {peer} sent instead")
    elif words:
        words.append(f"rank {peer} sent this rank nothing else: it is elsewhere, or slow")
    return "".join(f"; {w}" for w in words)
