"""The ``key=value,...`` texts of mpidist's test and benchmark hooks (environment variables
such as ``MPIDIST_FT_KILL``, ``MPIDIST_TEST_HOLD``, ``MPIDIST_CHECKPOINT_WRITER_HOOK``)."""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["key_values"]


def key_values(text: str, keys: Collection[str]) -> dict[str, str]:
    """``"k=v,k=v"`` as ``{k: v}`` (keys and values stripped). Raises ValueError without a
    message (the caller names its variable and the form it expects) for an item without
    ``=``, a key not in ``keys`` or a key given twice. Pure."""
    out: dict[str, str] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in keys or key in out:
            raise ValueError
        out[key] = value.strip()
    return out
