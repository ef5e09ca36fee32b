"""Reading a checkpoint's header: attributes, tensor list, checksums and (for the posix
mode) each dataset's byte offset in the file."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from mpidist.checkpoint.agreement import describe_error, h5py_module
from mpidist.checkpoint.format import (
    CHECKSUM_ALGORITHM,
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointFormatError,
    CorruptCheckpointError,
    TensorInfo,
)
from mpidist.checkpoint.storage import ATTR_S1_B, ATTR_S2_B, dataset_dtype

__all__ = ["attr_str", "open_h5", "raw_offset", "read_header", "read_header_offsets",
           "read_metadata", "scalar_attr"]


def attr_str(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def open_h5(path: str) -> Any:
    """``h5py.File(path, "r")``; CheckpointError when ``path`` does not exist,
    CorruptCheckpointError when it is not readable HDF5."""
    try:
        return h5py_module().File(path, "r")
    except (OSError, ValueError) as exc:
        if isinstance(exc, FileNotFoundError) or not os.path.exists(path):
            raise CheckpointError(f"checkpoint {path!r} does not exist") from None
        raise CorruptCheckpointError(
            f"checkpoint {path!r} cannot be read as HDF5 (truncated or corrupted file?): "
            f"{describe_error(exc)}") from None


def read_header(path: str) -> tuple[dict[str, Any], dict[str, TensorInfo],
                                      dict[str, tuple[int, int]]]:
    """Metadata, tensors and stored checksums of a checkpoint; raises CheckpointError."""
    meta, infos, sums, _ = read_header_offsets(path)
    return meta, infos, sums


def raw_offset(dsid: Any, info: TensorInfo) -> int:
    """Byte offset of a dataset (low-level id) whose elements ``pread`` can read, else -1.

    That is a contiguous dataset with allocated storage of exactly ``numel * itemsize``
    bytes whose file type is the little-endian type this library writes for ``info.dtype``
    (mpidist's own files always are). Anything else (chunked, filtered, external,
    big-endian, padded compound: files written by other tools) is read through h5py.
    """
    h5py = h5py_module()
    if not info.numel:
        return -1
    dcpl = dsid.get_create_plist()
    if dcpl.get_layout() != h5py.h5d.CONTIGUOUS or dcpl.get_external_count():
        return -1
    offset = dsid.get_offset()
    stored = dataset_dtype(info.dtype)
    if offset is None or dsid.get_storage_size() != info.numel * stored.itemsize:
        return -1
    if dsid.get_type() != h5py.h5t.py_create(stored, logical=True):
        return -1
    return int(offset)


def scalar_attr(obj_id: Any, key: bytes) -> int | None:
    """A numeric scalar attribute of a low-level object id as int; None if absent."""
    h5a = h5py_module().h5a
    if not h5a.exists(obj_id, key):
        return None
    aid = h5a.open(obj_id, key)
    try:
        buf = np.empty(aid.shape, dtype=aid.dtype)
        aid.read(buf)
    finally:
        aid.close()
    if buf.size != 1 or buf.dtype.kind not in "iu":
        raise ValueError(f"attribute {key.decode()!r} is not an integer scalar")
    return int(buf.reshape(-1)[0])


def read_header_offsets(path: str) -> tuple[dict[str, Any], dict[str, TensorInfo],
                                             dict[str, tuple[int, int]], np.ndarray]:
    """:func:`read_header` plus each tensor's :func:`raw_offset` (int64, sorted names)."""
    h5py = h5py_module()
    f = open_h5(path)
    try:
        with f:
            fmt = attr_str(f.attrs.get("format"))
            if fmt != FORMAT_NAME:
                raise CheckpointFormatError(
                    f"{path!r} is not an mpidist checkpoint: root attribute format={fmt!r}, "
                    f"expected {FORMAT_NAME!r}"
                )
            version = f.attrs.get("format_version")
            if isinstance(version, np.generic):
                version = version.item()
            if not isinstance(version, int) or version != FORMAT_VERSION:
                raise CheckpointFormatError(
                    f"{path!r} has format_version={version!r}; this library reads version "
                    f"{FORMAT_VERSION}"
                )
            alg = attr_str(f.attrs.get("checksum_algorithm"))
            if alg != CHECKSUM_ALGORITHM:
                raise CheckpointFormatError(
                    f"{path!r} uses checksum_algorithm={alg!r}, expected {CHECKSUM_ALGORITHM!r}"
                )
            try:
                meta = json.loads(attr_str(f.attrs["metadata_json"]))
            except (KeyError, ValueError, TypeError) as exc:
                raise CorruptCheckpointError(
                    f"{path!r}: root attribute metadata_json is missing or not JSON: {exc}"
                ) from None
            meta.update(format=FORMAT_NAME, format_version=FORMAT_VERSION,
                        library_version=attr_str(f.attrs.get("library_version")),
                        created=attr_str(f.attrs.get("created")))
            infos: dict[str, TensorInfo] = {}
            sums: dict[str, tuple[int, int]] = {}
            raw: dict[str, int] = {}
            problems: list[str] = []

            # The low-level API: h5py's visititems and attrs cost 3x more per dataset.
            h5d, h5o = h5py.h5d, h5py.h5o
            found: list[bytes] = []
            h5o.visit(f.id, lambda name, oi: found.append(name)
                      if oi.type == h5o.TYPE_DATASET else None, info=True)
            for bname in found:
                name = bname.decode("utf-8")
                dsid = h5d.open(f.id, bname)
                try:
                    dt = dsid.dtype
                    if dt.kind not in "fiubc" or dt.fields is not None:
                        problems.append(f"dataset {name!r} has non-numeric dtype {dt}")
                        continue
                    infos[name] = TensorInfo(tuple(dsid.shape), dt.name)
                    raw[name] = raw_offset(dsid, infos[name])
                    s1, s2 = scalar_attr(dsid, ATTR_S1_B), scalar_attr(dsid, ATTR_S2_B)
                    if s1 is None or s2 is None:
                        problems.append(f"dataset {name!r} has no checksum attributes")
                    else:
                        sums[name] = (s1, s2)
                finally:
                    dsid.close()
            if problems:
                raise CorruptCheckpointError(f"{path!r}: " + "; ".join(problems))
            count = f.attrs.get("num_tensors")
            if count is not None and int(count) != len(infos):
                raise CorruptCheckpointError(
                    f"{path!r}: root says num_tensors={int(count)} but {len(infos)} datasets "
                    "were found"
                )
            infos = dict(sorted(infos.items()))
            offsets = np.array([raw[n] for n in infos], dtype=np.int64)
            return meta, infos, sums, offsets
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CorruptCheckpointError(
            f"{path!r}: metadata cannot be read (corrupted file?): {describe_error(exc)}"
        ) from None


def read_metadata(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """``(attrs, {name: TensorInfo})`` of a checkpoint. Not collective; any rank may call it.

    ``attrs`` is the mapping given to :func:`save_checkpoint` plus ``format``,
    ``format_version``, ``library_version`` and ``created``. Raises
    :class:`CheckpointFormatError` for another format or version and
    :class:`CorruptCheckpointError` for an unreadable file.
    """
    meta, infos, _ = read_header(os.fspath(path))
    return meta, infos
