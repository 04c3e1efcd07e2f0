"""The gloo backend's messages: a frame that names its payload, and a bulk beside it.

Gloo reports nothing about a message it delivers: it fills a larger receive buffer silently and
aborts the process on a smaller one. So every message of the gloo backend (torchdist.py) travels
as a *frame*: HEADER_BYTES of (element count, dtype code), then payload bytes. Its tag carries
the frame's size class k (it fits in 2**k bytes, not in 2**(k-1)); the receiver posts a buffer of
2**k bytes, so any frame of its class arrives, and its header is checked against the receiving
tensor (`mismatch`): a different count or dtype is an error naming both, never wrong numbers.

Copying a large payload into a frame and out of it again costs more than Gloo's own send
(measured: 16 MiB one way, 1.5x the time of torch.distributed.send with one copy), and a second
message costs more than two copies of a small one (one way, 2 ranks, quiet: 64 KiB 103-137 us
framed against 227-237 us with its bulk beside it, raw Gloo 88-106; 256 KiB 177-201 against
236-270; at 1 MiB the bulk wins). So a message of at least BULK_BYTES sends its *bulk*, the
largest power of two of its bytes, as a second message straight from the sender's tensor into
the receiver's, and only the rest in the frame (less than half of it; nothing for a power of
two). The bulk's tag carries its exact size, so
Gloo only ever matches it with a buffer of that size. Both receives are posted at once: the
sender waits for neither.

    wire tag = tag * CODES + (frame size class k < BULK, or BULK + log2(bulk bytes))
"""

from __future__ import annotations

import ctypes
import struct

import torch

from .protocol import DTYPE_CODE, DTYPES, dtype_name, flat_bytes

HEADER_BYTES = 16  # a frame's header: (element count, dtype code) as two int64
_HEADER = struct.Struct("=qq")  # native order, as torch's int64 views read it
# codes 0..63 are frame size classes, 64..127 bulk sizes. The largest wire tag,
# MAX_TAG * CODES - 1, is 2**31 - 1: the largest tag torch passes on to Gloo
CODES = 128
BULK = 64
BULK_BYTES = 1 << 20  # from 1 MiB on, a message sends its bulk without a copy
SPARE_BYTES = 1 << 17  # frame buffers up to this size are used again (Spares)


def bulk_bytes(nbytes: int) -> int:
    """How many of a message's nbytes travel as its bulk: 0 below BULK_BYTES, else the largest
    power of two <= nbytes."""
    return 0 if nbytes < BULK_BYTES else 1 << (nbytes.bit_length() - 1)


def frame_tag(tag: int, frame_bytes: int) -> int:
    """The wire tag of a frame of frame_bytes: its size class k = frame_bytes.bit_length()."""
    return tag * CODES + frame_bytes.bit_length()


def bulk_tag(tag: int, bulk: int) -> int:
    """The wire tag of a bulk of `bulk` bytes (a power of two): its exact size."""
    return tag * CODES + BULK + bulk.bit_length() - 1


class Spares:
    """Frame buffers to use again, by size (at most SPARE_BYTES). Measured on a 1 KiB
    ping-pong over Gloo (2 ranks on 2 busy cores): a fresh buffer per message cost about 20 us
    more CPU time and 200 us more wall time than a used one, and a view of a larger buffer
    (buf[:n]) as much again, each as much as the message itself. So a send's frame is a whole
    buffer of its exact size, a receive's one of 2**k bytes."""

    def __init__(self, device: torch.device):
        self.device = device
        self.free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of exactly nbytes bytes."""
        free = self.free.get(nbytes)
        return free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def give(self, buf: torch.Tensor) -> None:
        """buf is free again (its send or receive has completed)."""
        if buf.numel() <= SPARE_BYTES:
            if len(self.free) > 64:  # a program of many sizes: start over
                self.free.clear()
            free = self.free.setdefault(buf.numel(), [])
            if len(free) < 4:  # a few in flight at once; more are garbage
                free.append(buf)


def make_frame(t: torch.Tensor, lo: int, frame: torch.Tensor) -> torch.Tensor:
    """frame (from Spares.take, HEADER_BYTES + t's bytes after lo) filled with (t.numel(),
    dtype code) as int64, then t's bytes from byte lo on (t contiguous; lo: its bulk). On the
    CPU through plain memory copies: each torch operation costs microseconds, more than a
    small message."""
    head = _HEADER.pack(t.numel(), DTYPE_CODE.get(t.dtype, len(DTYPES)))
    n = t.numel() * t.element_size() - lo
    if not t.is_cpu:
        frame[:HEADER_BYTES] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        frame[HEADER_BYTES:] = flat_bytes(t)[lo:]
        return frame
    ctypes.memmove(frame.data_ptr(), head, HEADER_BYTES)
    if n:
        ctypes.memmove(frame.data_ptr() + HEADER_BYTES, t.data_ptr() + lo, n)
    return frame


def mismatch(frame: torch.Tensor, t: torch.Tensor) -> str | None:
    """None if the frame's header matches t's count and dtype, else what it holds:
    '4 x torch.int32'."""
    if frame.is_cpu:
        head = ctypes.string_at(frame.data_ptr(), HEADER_BYTES)
    else:
        head = frame[:HEADER_BYTES].cpu().numpy().tobytes()
    numel, code = _HEADER.unpack(head)
    if numel == t.numel() and code == DTYPE_CODE.get(t.dtype, len(DTYPES)):
        return None
    return f"{numel} x {dtype_name(code)}"


def unframe(frame: torch.Tensor, t: torch.Tensor, lo: int) -> None:
    """Copy the frame's payload into t's bytes from byte lo on (t contiguous; the caller has
    checked the header)."""
    n = t.numel() * t.element_size() - lo
    if t.is_cpu and n:
        ctypes.memmove(t.data_ptr() + lo, frame.data_ptr() + HEADER_BYTES, n)
    elif n:
        flat_bytes(t)[lo:] = frame[HEADER_BYTES : HEADER_BYTES + n]
