"""Collective save and load of checkpoints: one HDF5 file, atomic commit, verified reads.

Every rank writes the pieces it owns as hyperslabs of the global tensors' datasets and
reads back whatever pieces it asks for, so a checkpoint written by N ranks with one
sharding loads on M ranks with any other. The I/O mode (chosen identically on every rank:
``serial=``, else ``MPIDIST_CHECKPOINT_SERIAL=1``, else ``MPIDIST_CHECKPOINT_IO``) only
changes how the bytes get there: ``posix`` (default: rank 0 lays the file out with HDF5,
every rank ``pwrite``s/``pread``s its ranges at the datasets' offsets), ``mpio`` (h5py's
mpio driver) or ``serial`` (the ranks take turns through h5py); every mode writes the same
file. The file is written under a hidden temp name and renamed when complete, so a crash
leaves the previous checkpoint and ``latest`` untouched. Each phase ends with one small
collective that raises the same :class:`CheckpointError` on every rank, naming the rank
that failed. The format, the modes and the commit protocol: ``docs/checkpoint-format.md``.
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
