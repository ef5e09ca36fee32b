"""Serial tools on checkpoint files: verify, inspect, export, diff.

None of these is collective: they run in one process (the ``mpidist inspect | diff |
export`` commands) and read tensors in bounded chunks, so they work on checkpoints larger
than memory (except :func:`export`, which builds the consolidated file in memory).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from mpidist.checkpoint.format import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    TensorInfo,
    as_tensor_infos,
    checksum_update,
    compare_tensors,
)
from mpidist.checkpoint.header import open_h5, read_header
from mpidist.checkpoint.load import read_tensor
from mpidist.checkpoint.storage import read_chunks, read_range

__all__ = ["diff", "diff_found", "diff_summary", "export", "format_diff", "format_inspect",
           "inspect", "verify_checkpoint"]

_CHUNK_BYTES = 64 << 20


def _chunks(ds: Any, info: TensorInfo) -> Iterator[tuple[int, np.ndarray]]:
    """``(start, elements)`` chunks of a dataset in flat C order."""
    return read_chunks(lambda a, out: read_range(ds, a, out), 0, info.numel, info.dtype,
                       _CHUNK_BYTES)


def _scan(path: str, *, verify: bool, norms: bool) -> tuple[dict[str, Any],
                                                               dict[str, TensorInfo],
                                                               dict[str, float], list[str]]:
    """Header, per-tensor L2 norms and the names failing their checksum, in one pass."""
    meta, infos, sums = read_header(path)
    out_norms: dict[str, float] = {}
    bad: list[str] = []
    if not (verify or norms):
        return meta, infos, out_norms, bad
    with open_h5(path) as f:
        for name, info in infos.items():
            total = 0.0
            s = (0, 0)
            try:
                for a, chunk in _chunks(f[name], info):
                    if verify:
                        s = checksum_update(s, chunk, a)
                    if norms:
                        x = np.abs(chunk) if chunk.dtype.kind == "c" else chunk
                        x = x.astype(np.float64)
                        total += float(np.dot(x, x))
            except (OSError, ValueError, RuntimeError) as exc:
                raise CorruptCheckpointError(
                    f"{path!r}: dataset {name!r} cannot be read: {type(exc).__name__}: {exc}"
                ) from None
            if verify and s != sums[name]:
                bad.append(name)
            if norms:
                out_norms[name] = math.sqrt(total)
    return meta, infos, out_norms, bad


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    expected: Mapping[str, TensorInfo | tuple[Sequence[int], Any]] | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Check a checkpoint completely; return a report or raise :class:`CheckpointError`.

    Not collective. Checks the format name and version, that every dataset is numeric and
    carries its checksum, every checksum against the data, and (given ``expected``) the
    tensor names, shapes and dtypes. The report holds ``path``, ``step``, ``num_tensors``,
    ``total_bytes`` and ``ok=True``.
    """
    path = os.fspath(path)
    meta, infos, _, bad = _scan(path, verify=True, norms=False)
    if bad:
        raise CorruptCheckpointError(
            f"checksum mismatch in {path!r} for dataset(s) {bad}: the data on disk is not "
            "what was saved"
        )
    if expected is not None:
        msg = compare_tensors(infos, as_tensor_infos(expected), strict=strict)
        if msg is not None:
            raise CheckpointMismatchError(f"{path!r}: {msg}")
    return {
        "path": path,
        "ok": True,
        "step": meta.get("step"),
        "num_tensors": len(infos),
        "total_bytes": sum(i.nbytes for i in infos.values()),
    }


def inspect(path: str | os.PathLike[str], *, verify: bool = False) -> dict[str, Any]:
    """A JSON-able description of a checkpoint. Not collective.

    Keys: ``path``, ``format``, ``format_version``, ``library_version``, ``created``,
    ``step``, ``strategy``, ``mesh``, ``world_size`` (None where the writer gave none),
    ``attrs`` (everything the writer stored), ``tensors`` (``{name: {shape, dtype, numel,
    nbytes, l2_norm}}``, sorted), ``num_tensors``, ``total_bytes`` and ``verified`` (True
    when ``verify`` checked every checksum; a mismatch raises instead).
    """
    path = os.fspath(path)
    meta, infos, norms, bad = _scan(path, verify=verify, norms=True)
    if bad:
        raise CorruptCheckpointError(f"checksum mismatch in {path!r} for dataset(s) {bad}")
    return {
        "path": path,
        "format": meta.get("format"),
        "format_version": meta.get("format_version"),
        "library_version": meta.get("library_version"),
        "created": meta.get("created"),
        "step": meta.get("step"),
        "strategy": meta.get("strategy"),
        "mesh": meta.get("mesh"),
        "world_size": meta.get("world_size"),
        "attrs": meta,
        "tensors": {
            n: {"shape": list(i.shape), "dtype": i.dtype, "numel": i.numel,
                "nbytes": i.nbytes, "l2_norm": norms[n]}
            for n, i in infos.items()
        },
        "num_tensors": len(infos),
        "total_bytes": sum(i.nbytes for i in infos.values()),
        "verified": bool(verify),
    }


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n} B"


def format_inspect(report: Mapping[str, Any]) -> str:
    """Human-readable text of an :func:`inspect` report: header, then a tree of tensors."""
    lines = [
        f"checkpoint {report['path']}",
        f"  format {report['format']} v{report['format_version']}, written by mpidist "
        f"{report['library_version']} at {report['created']}",
        f"  step {report['step']}  strategy {report['strategy']}  mesh {report['mesh']}  "
        f"world_size {report['world_size']}",
    ]
    skip = {"format", "format_version", "library_version", "created", "step", "strategy",
            "mesh", "world_size"}
    for key in sorted(set(report["attrs"]) - skip):
        lines.append(f"  {key}: {json.dumps(report['attrs'][key], sort_keys=True)}")
    tensors = report["tensors"]
    groups: dict[str, list[str]] = {}
    for name in tensors:
        groups.setdefault(name.rpartition("/")[0], []).append(name)
    width = max((len(n.rpartition("/")[2]) for n in tensors), default=0)
    for group in sorted(groups):
        names = groups[group]
        size = sum(tensors[n]["nbytes"] for n in names)
        lines.append(f"/{group}  ({len(names)} tensors, {_mb(size)})")
        for n in names:
            t = tensors[n]
            shape = "(" + ", ".join(str(d) for d in t["shape"]) + ")"
            lines.append(f"    {n.rpartition('/')[2]:<{width}}  {shape:<16} {t['dtype']:<8} "
                         f"norm {t['l2_norm']:.6g}")
    state = "all checksums verified" if report["verified"] else "checksums not verified"
    lines.append(f"total: {report['num_tensors']} tensors, {_mb(report['total_bytes'])}; "
                 f"{state}")
    return "\n".join(lines)


def export(path: str | os.PathLike[str], to: str | os.PathLike[str], *,
           prefix: str = "params/") -> list[str]:
    """Write the tensors under ``prefix`` (default the parameters) to one flat file.

    Not collective. ``to`` ending in ``.npz`` gives a NumPy archive, ``.safetensors`` a
    safetensors file (needs the ``safetensors`` package). Keys are the names with
    ``prefix`` removed; with no tensor under ``prefix`` every tensor is exported under its
    full name. Every tensor is checksum-verified. Returns the exported keys.
    """
    path, to = os.fspath(path), os.fspath(to)
    if not (to.endswith(".npz") or to.endswith(".safetensors")):
        raise ValueError(f"export target {to!r} must end in .npz or .safetensors")
    _, infos = read_header(path)[:2]
    chosen = [n for n in infos if prefix and n.startswith(prefix)]
    if chosen:
        keys = {n: n[len(prefix):] for n in chosen}
    else:
        keys = {n: n for n in infos}
    arrays = {keys[n]: read_tensor(path, n) for n in keys}
    if to.endswith(".safetensors"):
        try:
            from safetensors.numpy import save_file
        except ImportError:
            raise CheckpointError(
                f"exporting to {to!r} needs the 'safetensors' package; install it or use .npz"
            ) from None
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, to)
    else:
        with open(to, "wb") as fh:
            np.savez(fh, **arrays)
    return sorted(arrays)


def diff(a: str | os.PathLike[str], b: str | os.PathLike[str], *, rtol: float = 0.0,
         atol: float = 0.0) -> dict[str, Any]:
    """Compare two checkpoints tensor by tensor. Not collective.

    Returns ``{"max_abs_diff": {name: float}, "differ": {name: elements}, "only_in_a": [...],
    "only_in_b": [...], "mismatched": {name: "shape/dtype a vs b"}, "rtol": .., "atol": ..}``.
    Differences are computed in float64 (complex: modulus); equal bit patterns (NaN included)
    count as no difference, a NaN against anything else as an infinite one. An element
    differs when ``|a - b| > atol + rtol * |b|`` (default: any difference at all);
    ``differ`` counts such elements per tensor, for the tensors that have any.
    """
    for name, v in (("rtol", rtol), ("atol", atol)):
        if not float(v) >= 0:
            raise ValueError(f"{name}={v!r} must be a number >= 0")
    a, b = os.fspath(a), os.fspath(b)
    _, ia, _ = read_header(a)
    _, ib, _ = read_header(b)
    result: dict[str, Any] = {
        "max_abs_diff": {},
        "differ": {},
        "only_in_a": sorted(set(ia) - set(ib)),
        "only_in_b": sorted(set(ib) - set(ia)),
        "mismatched": {},
        "rtol": float(rtol),
        "atol": float(atol),
    }
    with open_h5(a) as fa, open_h5(b) as fb:
        for name in sorted(set(ia) & set(ib)):
            if ia[name] != ib[name]:
                result["mismatched"][name] = (f"{ia[name].shape} {ia[name].dtype} vs "
                                              f"{ib[name].shape} {ib[name].dtype}")
                continue
            worst, count = 0.0, 0
            pairs = zip(_chunks(fa[name], ia[name]), _chunks(fb[name], ib[name]), strict=True)
            for (_, x), (_, y) in pairs:
                d, scale = _abs_diff(x, y)
                if d.size:
                    worst = max(worst, float(np.max(d)))
                    limit = atol + rtol * scale if rtol else atol
                    count += int(np.count_nonzero((d > limit) | np.isinf(d)))
            result["max_abs_diff"][name] = worst
            if count:
                result["differ"][name] = count
    return result


def _abs_diff(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``|x - y|`` in float64 (0 where the bytes are equal, inf for a NaN against anything
    else) and ``|y|``, element by element of two chunks of the same shape and dtype."""
    same = x.view(np.uint8).reshape(x.shape[0], -1) == y.view(np.uint8).reshape(y.shape[0], -1)
    wide = np.complex128 if x.dtype.kind == "c" else np.float64
    xw, yw = x.astype(wide), y.astype(wide)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(xw - yw).astype(np.float64)
    d[np.isnan(d)] = np.inf
    d[same.all(axis=1)] = 0.0
    scale = np.abs(yw).astype(np.float64)
    scale[np.isnan(scale)] = 0.0
    return d, scale


def diff_summary(result: Mapping[str, Any]) -> str:
    """The last line of :func:`format_diff`: how many tensors differ beyond the tolerance,
    the largest absolute difference, how many shapes differ (and tensors in one only)."""
    values = list(result["max_abs_diff"].values())
    worst = max(values) if values else 0.0
    line = (f"{len(result['differ'])} tensors differ, max abs diff {worst:.6g}, "
            f"{len(result['mismatched'])} shapes differ")
    alone = len(result["only_in_a"]) + len(result["only_in_b"])
    if alone:
        line += f", {alone} in one checkpoint only"
    return line


def diff_found(result: Mapping[str, Any]) -> bool:
    """Whether a :func:`diff` result shows a difference beyond its tolerance (a tensor whose
    values differ, a shape or dtype that differs, a tensor in one checkpoint only)."""
    return bool(result["differ"] or result["mismatched"] or result["only_in_a"]
                or result["only_in_b"])


def format_diff(result: Mapping[str, Any]) -> str:
    """Human-readable text of a :func:`diff` result: one line per tensor that differs
    (beyond the tolerance), then :func:`diff_summary`'s line."""
    lines = [f"{name}: max |a-b| = {result['max_abs_diff'][name]:.6g} ({n} element(s) "
             "beyond the tolerance)" for name, n in result["differ"].items()]
    lines += [f"{name}: {why}" for name, why in result["mismatched"].items()]
    lines += [f"{name}: only in a" for name in result["only_in_a"]]
    lines += [f"{name}: only in b" for name in result["only_in_b"]]
    lines.append(diff_summary(result))
    return "\n".join(lines)
