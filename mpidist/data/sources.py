"""The inputs of ``mpidist prepare``: listed, split over ranks by bytes, read as documents.

Inputs are text files, JSON Lines files (``.jsonl``: one document per record, its text
under ``text_key``), their ``.gz`` forms, and directories of them (walked in sorted order;
hidden files and directories skipped; files that are not text skipped and counted). Other
formats (Parquet, Arrow, ...) are not read. Each file is a *unit*; the units, in the order
given, make one stream of documents.

A text file is one document, unless a separator is given: then documents end after each
occurrence of the separator (found left to right without overlap; the separator is not part
of a document). Empty documents and blank JSON Lines lines are skipped.

The work is split by bytes: rank ``r`` of ``n`` takes the documents that start in its range
``[r*T/n, (r+1)*T/n)`` of the units' ``T`` bytes, so no document is split. A ``.gz`` unit,
and a text file without separator, is one piece of work (the rank whose range holds its
first byte). Nothing here communicates.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

__all__ = ["Segment", "Unit", "list_units", "read_segments", "work_ranges"]

_CHUNK = 1 << 20
_SAFE_CUT = re.compile(rb"(?<=[A-Za-z0-9])\n")


@dataclass(frozen=True)
class Unit:
    """One input file."""

    path: str  #: where it is
    name: str  #: as recorded in the token file (as given, or relative to a directory given)
    size: int  #: bytes on disk (compressed for ``.gz``)
    jsonl: bool  #: JSON Lines (else text)
    gz: bool  #: gzip-compressed


@dataclass
class Segment:
    """Part of a document's text: a whole document, or a piece of a long one."""

    unit: int  #: index of its unit
    text: str
    nbytes: int  #: UTF-8 bytes of ``text``
    ends: bool  #: the document ends with this segment


def _kind(name: str) -> tuple[bool, bool]:
    gz = name.endswith(".gz")
    base = name[:-3] if gz else name
    return base.endswith((".jsonl", ".ndjson")), gz


def list_units(inputs: Sequence[str]) -> tuple[list[Unit], list[bool]]:
    """The files of ``inputs`` in order (directories walked sorted, hidden entries and empty
    files skipped), and for each whether it came from a directory (those that are not text
    are skipped by the caller). ValueError naming an input that does not exist or is an
    empty file or directory. Not collective."""
    units: list[Unit] = []
    from_dir: list[bool] = []
    for given in inputs:
        if os.path.isfile(given):
            size = os.path.getsize(given)
            if size == 0:
                raise ValueError(f"{given}: the input is empty")
            units.append(Unit(given, given, size, *_kind(given)))
            from_dir.append(False)
            continue
        if not os.path.isdir(given):
            raise ValueError(f"{given}: no such file or directory")
        rels = []
        for root, dirs, names in os.walk(given):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            rels += [os.path.relpath(os.path.join(root, n), given) for n in names
                     if not n.startswith(".")]
        found = [Unit(os.path.join(given, rel), os.path.join(os.path.basename(
            os.path.normpath(given)), rel), os.path.getsize(os.path.join(given, rel)),
            *_kind(rel)) for rel in sorted(rels)]
        found = [u for u in found if u.size > 0]
        if not found:
            raise ValueError(f"{given}: the directory holds no non-empty file")
        units += found
        from_dir += [True] * len(found)
    return units, from_dir


def _open(unit: Unit) -> BinaryIO:
    return gzip.open(unit.path, "rb") if unit.gz else open(unit.path, "rb")  # noqa: SIM115


def _whole(unit: Unit, separator: bytes | None) -> bool:
    """Whether the unit is one piece of work (not split between ranks)."""
    return unit.gz or (not unit.jsonl and not separator)


def _read_at(f: BinaryIO, lo: int, hi: int) -> bytes:
    f.seek(lo)
    return f.read(max(0, hi - lo))


def _occurrences(data: bytes, sep: bytes) -> list[int]:
    """Every start of ``sep`` in ``data``, overlapping ones included."""
    out, i = [], data.find(sep)
    while i >= 0:
        out.append(i)
        i = data.find(sep, i + 1)
    return out


def _free_before(f: BinaryIO, pos: int, sep: bytes) -> int:
    """The largest ``q <= pos`` such that no occurrence of ``sep`` starts in
    ``(q - len(sep), q)``: a left-to-right scan from the file start and one from ``q`` find
    the same occurrences from ``q`` on."""
    n = len(sep)
    span = 1 << 16
    while True:
        lo = max(0, pos - span)
        data = _read_at(f, lo, pos + n - 1)
        bad = {lo + s + k for s in _occurrences(data, sep) for k in range(1, n)}
        bottom = lo + n - 1 if lo > 0 else 0
        for q in range(pos, bottom - 1, -1):
            if q == 0 or q not in bad:
                return q
        if lo == 0:
            return 0
        span *= 4


def _doc_start(f: BinaryIO, size: int, pos: int, jsonl: bool, sep: bytes | None) -> int:
    """The first document start at or after ``pos`` in a splittable unit (``size`` if
    none)."""
    if pos <= 0:
        return 0
    if pos >= size:
        return size
    if jsonl:
        f.seek(pos - 1)
        at = pos - 1
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                return size
            i = chunk.find(b"\n")
            if i >= 0:
                return at + i + 1
            at += len(chunk)
    if not sep:
        raise ValueError("a text unit is split between ranks only at a separator")
    n = len(sep)
    q = _free_before(f, max(0, pos - n), sep)
    f.seek(q)
    at, carry = q, b""
    while True:
        chunk = f.read(_CHUNK)
        data = carry + chunk
        i = 0
        while True:
            j = data.find(sep, i)
            if j < 0:
                break
            end = at + j + n
            if end >= pos:
                return min(end, size)
            i = j + n
        if not chunk:
            return size
        keep = max(i, len(data) - n + 1)
        at += keep
        carry = data[keep:]


def work_ranges(units: Sequence[Unit], rank: int, size: int, separator: bytes | None
                ) -> list[tuple[int, int, int]]:
    """Rank ``rank``'s work: ``(unit index, lo, hi)`` byte ranges, each a run of whole
    documents (module docstring). Reads a few bytes around the cuts; not collective: every
    rank computes the same cuts."""
    total = sum(u.size for u in units)
    lo_cut, hi_cut = rank * total // size, (rank + 1) * total // size
    out = []
    start = 0
    for i, u in enumerate(units):
        end = start + u.size
        if _whole(u, separator):
            if lo_cut <= start < hi_cut:
                out.append((i, 0, u.size))
        elif start < hi_cut and end > lo_cut:
            with open(u.path, "rb") as f:
                lo = _doc_start(f, u.size, lo_cut - start, u.jsonl, separator)
                hi = _doc_start(f, u.size, hi_cut - start, u.jsonl, separator)
            if hi > lo:
                out.append((i, lo, hi))
        start = end
    return out


def _line_number(unit: Unit, offset: int) -> int:
    """1-based line of byte ``offset`` (counted only when an error is reported)."""
    n = 1
    with _open(unit) as f:
        left = offset
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                break
            n += chunk.count(b"\n")
            left -= len(chunk)
    return n


def _text_of_record(unit: Unit, line: bytes, offset: int, key: str) -> str | None:
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except ValueError as exc:
        where = f"{unit.name}:{_line_number(unit, offset)}"
        raise ValueError(f"{where}: not JSON ({exc})") from None
    text = record.get(key) if isinstance(record, dict) else None
    if not isinstance(text, str):
        where = f"{unit.name}:{_line_number(unit, offset)}"
        what = "lacks" if not isinstance(record, dict) or key not in record else \
            "has a non-string"
        raise ValueError(f"{where}: the record {what} key {key!r} (--text-key)")
    return text


def _decode(unit: Unit, data: bytes, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{unit.name}: not valid UTF-8 at byte {offset + exc.start}") \
            from None


def _limited(unit: Unit, f: BinaryIO, lo: int, hi: int) -> Iterator[bytes]:
    """The chunks of ``[lo, hi)`` (a ``.gz`` unit: all of it, decompressed)."""
    if unit.gz:
        while chunk := f.read(_CHUNK):
            yield chunk
        return
    f.seek(lo)
    left = hi - lo
    while left > 0:
        chunk = f.read(min(_CHUNK, left))
        if not chunk:
            return
        left -= len(chunk)
        yield chunk


def _jsonl_segments(index: int, unit: Unit, f: BinaryIO, lo: int, hi: int, key: str
                    ) -> Iterator[Segment]:
    pos, carry = lo, b""
    for chunk in _chunks_then_end(_limited(unit, f, lo, hi)):
        data = carry + chunk
        lines = data.split(b"\n")
        carry = lines.pop() if chunk else b""
        for line in lines:
            text = _text_of_record(unit, line, pos, key)
            pos += len(line) + 1
            if text:
                yield Segment(index, text, len(text.encode("utf-8")), True)


def _chunks_then_end(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """``chunks``, then one empty chunk that marks the end."""
    yield from chunks
    yield b""


def _stream_segments(index: int, unit: Unit, f: BinaryIO, lo: int, hi: int
                     ) -> Iterator[Segment]:
    """One document streamed in pieces cut just before a newline that follows an ASCII
    letter or digit (:func:`mpidist.data.tokenizer.split_pieces`)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    at, carry, emitted = lo, b"", False
    for chunk in _chunks_then_end(_limited(unit, f, lo, hi)):
        final = not chunk
        data = carry + chunk
        cut = len(data)
        if not final:
            last = None
            for m in _SAFE_CUT.finditer(data, max(0, len(data) - len(chunk) - 1)):
                last = m
            cut = last.start() if last is not None else 0
        piece, carry = data[:cut], data[cut:]
        pending = len(decoder.getstate()[0])
        try:
            text = decoder.decode(piece, final=final)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{unit.name}: not valid UTF-8 at byte "
                             f"{at - pending + exc.start}") from None
        at += len(piece)
        if text or (final and emitted):
            yield Segment(index, text, len(piece), final)
            emitted = True


def _separated_segments(index: int, unit: Unit, f: BinaryIO, lo: int, hi: int, sep: bytes
                        ) -> Iterator[Segment]:
    carry, carry_at = b"", lo  # carry: the current document so far, from byte carry_at
    for chunk in _chunks_then_end(_limited(unit, f, lo, hi)):
        data = carry + chunk
        start = 0
        while (j := data.find(sep, start)) >= 0:
            if j > start:
                yield Segment(index, _decode(unit, data[start:j], carry_at + start), j - start,
                              True)
            start = j + len(sep)
        carry, carry_at = data[start:], carry_at + start
        if not chunk and carry:
            yield Segment(index, _decode(unit, carry, carry_at), len(carry), True)


def read_segments(units: Sequence[Unit], work: Sequence[tuple[int, int, int]], *,
                  separator: bytes | None = None, text_key: str = "text",
                  whole_documents: bool = False) -> Iterator[Segment]:
    """The documents of ``work`` (from :func:`work_ranges`) in order, as segments. A text
    file without separator is streamed in pieces unless ``whole_documents``. ValueError
    naming the file and the place for text that is not UTF-8 and for a JSON Lines line that
    is not JSON or lacks ``text_key``. Not collective."""
    for index, lo, hi in work:
        unit = units[index]
        with _open(unit) as f:
            if unit.jsonl:
                yield from _jsonl_segments(index, unit, f, lo, hi, text_key)
            elif separator:
                yield from _separated_segments(index, unit, f, lo, hi, separator)
            elif whole_documents:
                data = f.read()
                if data:
                    yield Segment(index, _decode(unit, data, 0), len(data), True)
            else:
                yield from _stream_segments(index, unit, f, lo, hi)


def first_documents(units: Sequence[Unit], budget: int, *, separator: bytes | None = None,
                    text_key: str = "text") -> Iterator[str]:
    """A deterministic sample of the corpus: from each unit in order, its first documents
    (pieces of a long one) until the unit's share of ``budget`` bytes (proportional to its
    size; at least one document) is taken. Not collective."""
    total = sum(u.size for u in units) or 1
    for i, u in enumerate(units):
        share = max(1, budget * u.size // total)
        taken = 0
        for seg in read_segments(units, [(i, 0, u.size)], separator=separator,
                                 text_key=text_key):
            yield seg.text
            taken += seg.nbytes
            if taken >= share:
                break


def unit_record(unit: Unit) -> dict[str, Any]:
    """A unit as JSON."""
    return {"path": unit.path, "name": unit.name, "size": unit.size, "jsonl": unit.jsonl,
            "gz": unit.gz}
