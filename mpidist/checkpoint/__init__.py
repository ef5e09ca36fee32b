"""Checkpoints as one parallel-HDF5 file of global named tensors.

A strategy describes what it saves as ``tensors`` (``{name: TensorInfo(shape, dtype)}``,
global shapes) and this rank's ``pieces`` (``Piece(name, flat slice, 1-D data)``: elements
of the C-order flattened tensor, e.g. from ``ShardedLayout.local_pieces()``). Saving is
collective, atomic and checksummed; loading is each rank reading whatever pieces it needs,
so a checkpoint resharded to any mesh needs no conversion. Format:
``docs/checkpoint-format.md``.

* collective over ``comm``: :func:`save_checkpoint` (with ``async_=True`` it returns an
  :class:`AsyncCheckpoint`, which commits later), :func:`read_pieces`,
  :func:`load_checkpoint`;
* any single process: :func:`read_metadata`, :func:`read_tensor`, :func:`latest_checkpoint`,
  :func:`list_checkpoints`, :func:`verify_checkpoint`, :func:`inspect`, :func:`export`,
  :func:`diff`.
"""

from __future__ import annotations

from mpidist.checkpoint.background import AsyncCheckpoint
from mpidist.checkpoint.format import (
    CHECKSUM_ALGORITHM,
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    Piece,
    TensorInfo,
    checksum,
)
from mpidist.checkpoint.io import (
    LATEST,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_metadata,
    read_pieces,
    read_tensor,
    save_checkpoint,
)
from mpidist.checkpoint.tools import (
    diff,
    diff_found,
    diff_summary,
    export,
    format_diff,
    format_inspect,
    inspect,
    verify_checkpoint,
)

__all__ = [
    "CHECKSUM_ALGORITHM",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LATEST",
    "AsyncCheckpoint",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "Piece",
    "TensorInfo",
    "checkpoint_path",
    "checksum",
    "diff",
    "diff_found",
    "diff_summary",
    "export",
    "format_diff",
    "format_inspect",
    "inspect",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_metadata",
    "read_pieces",
    "read_tensor",
    "save_checkpoint",
    "verify_checkpoint",
]
