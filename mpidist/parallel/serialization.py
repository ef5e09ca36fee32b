"""Self-describing bytes for a strategy's state: a JSON header and raw little-endian arrays.

Layout::

    b"MPIDIST-STATE\\n"            magic (14 bytes)
    uint64 little-endian          length H of the header
    H bytes                       UTF-8 JSON header
    payload                       the arrays back to back, in header order

The header holds ``format`` ("mpidist-state"), ``version``, ``strategy``, ``step``,
``steps_taken``, ``optimizer`` (name and hyperparameters), ``model`` (tensor names and
shapes in layout order and their SHA-256 fingerprint) and ``arrays``: for each array its key
(``params/<name>`` or ``state/<state name>/<name>``), dtype, shape, offset and byte count.
Nothing is ever unpickled or executed.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import numpy as np

from mpidist._version import __version__
from mpidist.core.buffers import ShardedLayout

__all__ = ["FORMAT", "VERSION", "dumps", "loads", "model_fingerprint"]

MAGIC = b"MPIDIST-STATE\n"
FORMAT = "mpidist-state"
VERSION = 1
_DTYPES = {"float32", "float64"}


def model_fingerprint(layout: ShardedLayout) -> tuple[list[list[Any]], str]:
    """``([[name, shape], ...], sha256 hex)`` of a model's tensors in layout order."""
    tensors = [[s.name, list(s.shape)] for u in layout.units for s in u.specs]
    digest = hashlib.sha256(json.dumps(tensors).encode()).hexdigest()
    return tensors, digest


def dumps(state: dict[str, Any], *, model_layout: ShardedLayout) -> bytes:
    """Encode a strategy ``state_dict`` (see ``ShardedOptimizer.state_dict``). Not collective."""
    tensors, digest = model_fingerprint(model_layout)
    arrays: list[tuple[str, np.ndarray]] = []
    for name, _ in tensors:
        arrays.append((f"params/{name}", state["params"][name]))
    for key in sorted(state["state"]):
        for name, _ in tensors:
            arrays.append((f"state/{key}/{name}", state["state"][key][name]))
    entries, offset, blobs = [], 0, []
    for key, arr in arrays:
        a = np.ascontiguousarray(arr)
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        entries.append({"key": key, "dtype": a.dtype.name, "shape": list(a.shape),
                        "offset": offset, "nbytes": len(data)})
        offset += len(data)
        blobs.append(data)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "library_version": __version__,
        "strategy": state["strategy"],
        "step": int(state["step"]),
        "steps_taken": int(state.get("steps_taken", state["step"])),
        "optimizer": state["optimizer"],
        "model": {"tensors": tensors, "fingerprint": digest},
        "state_names": sorted(state["state"]),
        "data": state.get("data"),
        "arrays": entries,
    }
    head = json.dumps(header, sort_keys=True).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(head)), head, *blobs])


def loads(data: bytes, *, expect_strategy: str | None, model_layout: ShardedLayout
          ) -> dict[str, Any]:
    """Decode bytes from :func:`dumps` into a state dict, checking what they are.

    Raises ValueError if the bytes are not an mpidist state, are of another format
    version, of another strategy (when ``expect_strategy`` is given), or of another model
    (tensor names or shapes differ), naming what differs. Not collective.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise ValueError("not mpidist state bytes (bad magic)")
    (hlen,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    if start + hlen > len(data):
        raise ValueError(f"truncated state bytes: header of {hlen} bytes, {len(data)} in all")
    try:
        header = json.loads(data[start:start + hlen].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"corrupt state header: {exc}") from None
    if header.get("format") != FORMAT:
        raise ValueError(f"format {header.get('format')!r} is not {FORMAT!r}")
    if header.get("version") != VERSION:
        raise ValueError(
            f"state format version {header.get('version')!r} is not supported "
            f"(this mpidist reads version {VERSION})"
        )
    if expect_strategy is not None and header.get("strategy") != expect_strategy:
        raise ValueError(
            f"state bytes are from strategy {header.get('strategy')!r}, not {expect_strategy!r}"
        )
    tensors, digest = model_fingerprint(model_layout)
    if header["model"]["fingerprint"] != digest:
        theirs = {n: tuple(s) for n, s in header["model"]["tensors"]}
        ours = {n: tuple(s) for n, s in tensors}
        missing = sorted(set(ours) - set(theirs))
        extra = sorted(set(theirs) - set(ours))
        shapes = sorted(f"{n}: {theirs[n]} != {ours[n]}"
                        for n in set(ours) & set(theirs) if theirs[n] != ours[n])
        raise ValueError(
            "state bytes are from another model: "
            f"missing {missing[:5]}, unexpected {extra[:5]}, shape mismatch {shapes[:5]}"
        )
    payload = start + hlen
    params: dict[str, np.ndarray] = {}
    state: dict[str, dict[str, np.ndarray]] = {k: {} for k in header["state_names"]}
    for e in header["arrays"]:
        if e["dtype"] not in _DTYPES:
            raise ValueError(f"array {e['key']!r} has unsupported dtype {e['dtype']!r}")
        lo = payload + e["offset"]
        if lo + e["nbytes"] > len(data):
            raise ValueError(f"truncated state bytes: array {e['key']!r} is cut off")
        arr = np.frombuffer(data, dtype=np.dtype(e["dtype"]).newbyteorder("<"),
                            count=e["nbytes"] // np.dtype(e["dtype"]).itemsize, offset=lo)
        arr = arr.reshape(e["shape"]).astype(e["dtype"])
        kind, _, rest = e["key"].partition("/")
        if kind == "params":
            params[rest] = arr
        else:
            key, _, name = rest.partition("/")
            state[key][name] = arr
    return {
        "strategy": header["strategy"],
        "step": header["step"],
        "steps_taken": header["steps_taken"],
        "optimizer": header["optimizer"],
        "params": params,
        "state": state,
        "data": header.get("data"),
    }
