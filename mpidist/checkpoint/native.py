"""A rank's posix write pass as one compiled loop that runs without the GIL.

:func:`write_table` checksums and writes (``pwrite``) every piece of a table, 4 MB chunk after
chunk, and asks the kernel to start writing back as it goes (``sync_file_range`` on
Linux), all inside one Numba function compiled ``nogil``: libc's ``pwrite`` is called from
compiled code, so the GIL is taken once per call, not once per chunk. A background
writer therefore does not have to win the GIL back (up to the interpreter's 5 ms switch
interval, or a whole compiled kernel of the training thread) between its chunks, and does
not make the training thread hand it over either.

The pieces are read where they are (by address): the caller keeps them alive. Only
contiguous pieces already in the stored (little-endian) byte order go through it; the
writer falls back to the Python loop of :func:`~mpidist.checkpoint.storage.pwrite_array`
otherwise. A failed ``pwrite`` stops the loop and is redone by the caller with
``os.pwrite``, which raises the ``OSError`` with its errno (the same error as the Python
loop); a stop flag set by another thread ends the loop between chunks. Not collective.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

__all__ = ["ADDRESS", "CANCELLED", "DONE", "FAILED", "FIRST", "ITEMSIZE", "NBYTES", "OFFSET",
           "TENSOR", "write_table"]

DONE, CANCELLED, FAILED = 0, 1, 2

#: Columns of the table: address, bytes, file offset, item size, index of the first
#: element in its tensor, tensor index.
ADDRESS, NBYTES, OFFSET, ITEMSIZE, FIRST, TENSOR = range(6)

_pwrite = types.ExternalFunction(
    "pwrite", types.intp(types.int32, types.voidptr, types.uintp, types.int64))
_sync_file_range = types.ExternalFunction(
    "sync_file_range", types.int32(types.int32, types.int64, types.int64, types.uint32))
_SYNC_FILE_RANGE_WRITE = 2


@intrinsic
def _address(typingctx, addr):  # pragma: no cover - compiled
    """The int64 ``addr`` as a ``void *``."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(types.int64), codegen


@njit(nogil=True, cache=True)
def _sum_words(words, w, s1, s2):  # pragma: no cover - compiled
    """``(S1, S2)`` plus the checksum of the unsigned ``words`` (one compiled loop per
    word size), the first being element ``w - 1`` of its tensor."""
    one = np.uint64(1)
    for k in range(words.size):
        x = np.uint64(words[k])
        s1 += x
        s2 += w * x
        w += one
    return s1, s2


@njit(nogil=True, cache=True)
def _add_sums(ptr, count, itemsize, w, s1, s2):  # pragma: no cover - compiled
    """``(S1, S2)`` plus the checksum of ``count`` words of ``itemsize`` bytes at ``ptr``,
    the first being element ``w - 1`` of its tensor."""
    if itemsize == 8:
        return _sum_words(carray(ptr, count, np.uint64), w, s1, s2)
    if itemsize == 4:
        return _sum_words(carray(ptr, count, np.uint32), w, s1, s2)
    if itemsize == 2:
        return _sum_words(carray(ptr, count, np.uint16), w, s1, s2)
    return _sum_words(carray(ptr, count, np.uint8), w, s1, s2)


@njit(nogil=True, cache=True)
def _start_writeback(fd, lo, hi):  # pragma: no cover - compiled
    return _sync_file_range(np.int32(fd), lo, hi - lo, np.uint32(_SYNC_FILE_RANGE_WRITE)) == 0


@njit(nogil=True, cache=True)
def write_table(fd, table, sums, chunk, every, stop, state):  # pragma: no cover - compiled
    """Write rows ``state[0]:`` of ``table`` (int64, the columns above), the first of them
    from byte ``state[1]``, into file descriptor ``fd``, in chunks of ``chunk`` bytes
    (whole elements, at least one), adding each chunk's checksum to
    ``sums[tensor]`` (uint64) before writing it; ``every`` > 0 starts writeback every
    ``every`` contiguous bytes. Sets ``state = (row, chunk start, bytes of the chunk
    written, status)``: :data:`DONE`, :data:`CANCELLED` (``stop[0]`` was set before a
    chunk) or :data:`FAILED` (``pwrite`` returned <= 0 there: the chunk's checksum is
    counted, the rest of the chunk is the caller's to write)."""
    lo = np.int64(0)
    hi = np.int64(0)
    start_row = state[0]
    for r in range(start_row, table.shape[0]):
        addr, nbytes, offset = table[r, 0], table[r, 1], table[r, 2]
        itemsize, first, t = table[r, 3], table[r, 4], table[r, 5]
        pos = state[1] if r == start_row else np.int64(0)
        while pos < nbytes:
            if stop[0] != 0:
                state[0], state[1], state[2], state[3] = r, pos, 0, CANCELLED
                return
            n = min(max(1, chunk // itemsize) * itemsize, nbytes - pos)
            w = np.uint64(first + pos // itemsize + 1)
            s1, s2 = _add_sums(_address(addr + pos), n // itemsize, itemsize, w,
                               sums[t, 0], sums[t, 1])
            sums[t, 0] = s1
            sums[t, 1] = s2
            done = np.int64(0)
            while done < n:
                k = _pwrite(np.int32(fd), _address(addr + pos + done), n - done,
                            offset + pos + done)
                if k <= 0:
                    state[0], state[1], state[2], state[3] = r, pos, done, FAILED
                    return
                done += k
            if every > 0:  # as storage.Writeback does, without leaving compiled code
                a = offset + pos
                if a != hi:
                    if hi > lo and not _start_writeback(fd, lo, hi):
                        every = 0
                    lo = a
                hi = a + n
                if every > 0 and hi - lo >= every:
                    if not _start_writeback(fd, lo, hi):
                        every = 0
                    lo = hi
            pos += n
    if every > 0 and hi > lo:
        _start_writeback(fd, lo, hi)
    state[0], state[1], state[2], state[3] = table.shape[0], 0, 0, DONE
