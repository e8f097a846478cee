"""Piece-to-piece copies on a GPU: one kernel for a whole same-host read.

Where both daemons share a host and D's memory has P's layout and block size
(``in_wire_order``), a read is a list of equal pieces of P's memory (one per
layer, K/V plane and block, from ``PieceTemplate``) paired one for one with
pieces of D's. On host memory ``iovec.Copier`` copies such pairs with
``process_vm_readv``; on a GPU this module does it with one kernel launch for
every segment of the read: each program copies a chunk of one piece, from
P's CUDA-IPC mapping straight into D's cache. There is no staging: the
gather-then-scatter it replaces moved every byte twice, in one launch and
one index upload per segment.

The kernel is Triton's, which a CUDA build of torch brings with it. Where
Triton is missing (or the memory is not on one CUDA device), ``available``
says so and the caller gathers and scatters as before.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
from typing import Any

import numpy as np
import torch

log = logging.getLogger("kvd.transport")

# Each program copies one chunk of this many 4-byte words (8 KiB): a piece of
# 8 KiB (16-token NHD blocks of 8 heads x 128 x bf16, one K or V plane) is one
# program; a 512 KiB piece is 64.
_CHUNK_WORDS = 2048
_MAX_PROGRAMS_PER_PIECE = 1024  # the grid's second dimension (CUDA allows 65535); more chunks loop


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, compiled on first use; None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    _cache_dir()

    @triton.jit  # type: ignore[untyped-decorator]
    def copy_pieces(dst, src, dst_off, src_off, piece, ROUNDS: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):  # type: ignore[no-untyped-def]
        # Program (i, j) copies chunks j, j + grid[1], ... of piece i (chunks
        # past its end are masked off); offsets are in elements from the bases.
        i = tl.program_id(0)
        j = tl.program_id(1)
        d = tl.multiple_of(tl.load(dst_off + i), ALIGN)
        s = tl.multiple_of(tl.load(src_off + i), ALIGN)
        for k in range(0, ROUNDS):
            at = (j + k * tl.num_programs(1)) * BLOCK + tl.arange(0, BLOCK)
            inside = at < piece
            tl.store(dst + d + at, tl.load(src + s + at, mask=inside), mask=inside)

    return copy_pieces


def available(*devices: torch.device) -> bool:
    """Whether pieces on ``devices`` can be copied here: all on one CUDA
    device, where the kernel compiled and copied a trial piece (Triton
    compiles at first launch, with a C compiler and a writable cache: where
    it cannot, same-host reads gather and scatter instead of failing)."""
    if len({(d.type, d.index) for d in devices}) != 1 or devices[0].type != "cuda" or _kernel() is None:
        return False
    return _works_on(devices[0].index if devices[0].index is not None else torch.cuda.current_device())


@functools.cache
def _works_on(index: int) -> bool:
    device = torch.device("cuda", index)
    try:
        src = torch.arange(64, dtype=torch.uint8, device=device)
        dst = torch.zeros_like(src)
        copy_pairs(np.asarray([dst.data_ptr()], dtype=np.uint64), np.asarray([src.data_ptr()], dtype=np.uint64), 64, device)
        torch.cuda.synchronize(device)
        if not torch.equal(src, dst):
            raise RuntimeError("the trial copy moved wrong bytes")
        return True
    except Exception as e:
        log.warning("the GPU piece kernel is not usable on %s (same-host reads gather and scatter instead): %s", device, e)
        return False


def _cache_dir() -> None:
    """Triton caches compiled kernels under $HOME; a daemon's user may have
    none it can write (the image's user 10001): a private folder in /tmp."""
    if "TRITON_CACHE_DIR" not in os.environ:
        home = os.path.expanduser("~")
        if not os.access(home, os.W_OK):
            os.environ["TRITON_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"kvd-triton-{os.getuid()}")


def pair(dst: tuple[np.ndarray, int], src: tuple[np.ndarray, int]) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Two lists of equal pieces, (addresses, piece bytes), as pairs of the
    same length: the bigger pieces are cut into the smaller where one divides
    the other (a contiguous run on one side against one piece per block on
    the other). None where the two do not cover the same bytes that way."""
    (d_addrs, d_piece), (s_addrs, s_piece) = dst, src
    if d_piece <= 0 or s_piece <= 0 or d_addrs.size * d_piece != s_addrs.size * s_piece:
        return None
    piece = min(d_piece, s_piece)
    if max(d_piece, s_piece) % piece:
        return None
    return _cut(d_addrs, d_piece, piece), _cut(s_addrs, s_piece, piece), piece


def _cut(addrs: np.ndarray, piece: int, into: int) -> np.ndarray:
    if piece == into:
        return addrs.astype(np.uint64, copy=False)
    steps = np.arange(0, piece, into, dtype=np.uint64)
    return (addrs.astype(np.uint64)[:, None] + steps[None, :]).reshape(-1)


class PiecePairs:
    """Pairs of equal pieces (device addresses of this process), uploaded
    once as element offsets from one base pointer; ``launch`` queues their
    copy on the current stream of ``device``."""

    def __init__(self, dst: np.ndarray, src: np.ndarray, piece: int, device: torch.device) -> None:
        self.n, self.device = int(dst.size), device
        # Offsets are counted from one base pointer Triton accepts: their own
        # device buffer (its allocation is aligned).
        self.offsets = torch.empty(2 * self.n, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        host = torch.empty(2 * self.n, dtype=torch.int64, pin_memory=pinned)
        flat = host.numpy()  # written in place: no copies of a 32k-piece list on the host
        flat[: self.n] = dst.view(np.int64) if dst.dtype == np.uint64 else dst
        flat[self.n :] = src.view(np.int64) if src.dtype == np.uint64 else src
        aligned = not (piece % 16 or int(np.bitwise_or.reduce(flat)) & 15) if self.n else True
        flat -= self.offsets.data_ptr()
        # 16-byte aligned: 4-byte words, which the kernel loads 16 bytes at a time.
        self.word, self.align = (4, 4) if aligned else (1, 1)
        if aligned:
            flat >>= 2
        self.elems = piece // self.word
        # Up from pinned memory: from pageable memory the upload waits for the whole stream.
        self.offsets.copy_(host, non_blocking=pinned)

    def launch(self) -> None:
        kernel = _kernel()
        if kernel is None:
            raise RuntimeError("no device piece copier here: Triton is not installed")
        if not self.n:
            return
        words = _CHUNK_WORDS * (4 // self.word)
        # A chunk is at most 8 KiB; a smaller piece gets a chunk its own size
        # (a power of two), so no program idles over masked-off bytes.
        block = min(words, 1 << max(4, (self.elems - 1).bit_length()))
        chunks = -(-self.elems // block)
        per_piece = min(chunks, _MAX_PROGRAMS_PER_PIECE)
        pointer = self.offsets.view(torch.int32 if self.word == 4 else torch.uint8)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            # ROUNDS is 1 for pieces up to 8 MiB: few values, so few compiles.
            kernel[(self.n, per_piece)](pointer, pointer, self.offsets[: self.n], self.offsets[self.n :], self.elems,
                                        ROUNDS=-(-chunks // per_piece), BLOCK=block, ALIGN=self.align, num_warps=4)


def copy_pairs(dst: np.ndarray, src: np.ndarray, piece: int, device: torch.device) -> None:
    """Queue the copy of every ``piece``-byte piece at ``src[i]`` to ``dst[i]``
    (device addresses of this process) on the current stream of ``device``,
    as one kernel launch. Returns at once; the caller waits for the stream."""
    PiecePairs(dst, src, piece, device).launch()
