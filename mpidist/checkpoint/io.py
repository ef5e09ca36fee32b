"""Collective save and load of checkpoints: one HDF5 file, atomic commit, verified reads.

A checkpoint is one HDF5 file of global named tensors (``docs/checkpoint-format.md``).
Every rank writes the pieces it owns as hyperslabs of the tensors' datasets and reads back
whatever pieces it asks for, so a checkpoint written by N ranks with one sharding loads on
M ranks with any other.

The file is an ordinary HDF5 file whichever way it is written; the I/O modes differ only
in how the bytes get there. Chosen identically on every rank (``serial=`` argument, else
``MPIDIST_CHECKPOINT_SERIAL=1``, else ``MPIDIST_CHECKPOINT_IO=posix|mpio|serial``):

* ``posix`` (default): rank 0 alone creates the file with h5py's default (sec2) driver:
  every group, attribute and dataset, the datasets contiguous with their space allocated
  at creation (``H5D_ALLOC_TIME_EARLY``) and never filled, so each dataset's byte offset
  is fixed before any data exists; the checksum attributes are written as zeros. Rank 0
  closes the file and broadcasts the offsets; every rank then checksums and
  ``os.pwrite``s its pieces' little-endian bytes at ``offset + start * itemsize`` chunk by
  chunk, starting the kernel's writeback as it goes (``sync_file_range`` on Linux,
  ``MPIDIST_CHECKPOINT_WRITEBACK_MB``); the sums are combined with one Allreduce, rank 0
  overwrites the zero checksums in place, and every rank fsyncs. Loading is the reverse:
  rank 0 reads the header and offsets, and every rank ``os.pread``s its ranges. Datasets
  that are not plainly contiguous (files written by other tools: chunked, filtered, other
  byte order) are read through h5py.
  Why the default: HDF5 adds nothing to the data transfers of contiguous datasets, while
  opening and closing a file with the ``mpio`` driver (collective metadata, MPI-IO
  file-view setup, a collective truncate) cost seconds per checkpoint; see
  ``benchmarks/checkpoint_io.py``.
* ``mpio``: ``h5py`` built with MPI and a communicator of more than one rank (otherwise
  ``posix``). The file is opened with ``driver="mpio"``; file, group, dataset and
  attribute creation are collective (every rank makes the same calls in the same, sorted,
  order); piece transfers are independent, so ranks may write different numbers of pieces.
* ``serial``: Rank 0 creates the file with every dataset and attribute; then the ranks take
  turns (rank order, one Barrier per turn) opening it with h5py and writing their pieces.

Atomic commit: the file is written as ``.<name>.tmp-<hex>`` in the target directory (the
name chosen by rank 0 and broadcast), fsynced by every rank, renamed by rank 0 with
``os.replace`` and the directory fsynced; then the ``latest`` pointer is replaced the same
way. A crash at any moment leaves the previous checkpoint and ``latest`` untouched; a
leftover temp file is ignored by :func:`latest_checkpoint` and removed by the next save.

Errors are agreed on before anyone proceeds: each phase ends with one small collective that
raises the same :class:`CheckpointError` on every rank, naming the rank that failed.
"""

from __future__ import annotations

from mpidist.checkpoint.agreement import IO_MODES
from mpidist.checkpoint.header import read_metadata
from mpidist.checkpoint.load import load_checkpoint, read_pieces, read_tensor
from mpidist.checkpoint.paths import (
    LATEST,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
)
from mpidist.checkpoint.save import save_checkpoint
from mpidist.checkpoint.storage import (
    FUSED_CHUNK_BYTES,
    MAX_TRANSFER_BYTES,
    POSIX_CHUNK_BYTES,
    WRITEBACK_BYTES,
)

__all__ = [
    "FUSED_CHUNK_BYTES",
    "IO_MODES",
    "LATEST",
    "MAX_TRANSFER_BYTES",
    "POSIX_CHUNK_BYTES",
    "WRITEBACK_BYTES",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_metadata",
    "read_pieces",
    "read_tensor",
    "save_checkpoint",
]
