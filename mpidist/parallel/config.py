"""ShardingConfiguration: how a strategy communicates, as one frozen dataclass."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

__all__ = ["PRECISIONS", "RECOMPUTE", "ShardingConfiguration"]

_DTYPES = ("float32", "float64")
#: activation checkpointing choices
RECOMPUTE = ("none", "blocks")
#: ``precision`` choices (``--precision``)
PRECISIONS = ("full", "mixed-bf16", "mixed-fp16")


@dataclass(frozen=True)
class ShardingConfiguration:
    """Settings shared by every strategy. Unknown fields are rejected with a ValueError.

    Attributes:
        mesh: the :class:`~mpidist.core.mesh.ProcessMesh` to run on; None: the strategy's entry
            point (a ``...Optimizer`` or ``...Model`` constructor) builds one on the
            communicator it is given as ``comm=``, and on ``MPI.COMM_WORLD`` when it is
            given none — resolved there, never deeper.
        bucket_mb: gradient bucket size in MiB (DDP, ZeRO-1).
        overlap: start each bucket's nonblocking allreduce as soon as backward has
            filled it (else all buckets are reduced after backward).
        max_grad_norm: clip gradients to this global L2 norm; None turns clipping off.
        micro_batches: micro-batches per step (gradient accumulation); a local batch that
            does not divide by it is split into parts one sample apart, and needs at least
            one sample per micro-batch.
        dtype: parameter, gradient and optimizer-state dtype, "float32" or "float64".
        auto_sync_gradients: whether the wrapped model's ``backward`` synchronises
            gradients by itself (DDPModel); when False the caller calls ``sync_gradients``.
        prefetch: ZeRO-3 starts the allgather of the next unit while the current one runs.
        recompute: activation checkpointing: "none" keeps every activation for backward;
            "blocks" keeps only each unit's input and recomputes the unit's forward just
            before its backward (exact: the same operations run again).
        virtual_stages: model chunks per pipeline stage (the interleaved schedule): the
            units are cut into ``pp * virtual_stages`` virtual stages and stage ``s`` holds
            chunks ``c * pp + s``; 1 for every other schedule.
        device: where parameters, gradients, optimizer state and activations live: "cpu"
            (NumPy), "cuda" (CuPy, on GPU ``local rank % GPUs``), "cuda:N", or a
            :class:`~mpidist.core.arrays.Device`. Not recorded in checkpoints: a run
            written on one device resumes on another.
        precision: "full" (everything in ``dtype``) or mixed precision, "mixed-bf16" or
            "mixed-fp16": parameters and activations in 16 bits for compute, float32
            master weights in the optimizer (``dtype`` must be float32), gradients reduced
            in float32, and for fp16 dynamic loss scaling.
    """

    mesh: Any = None
    bucket_mb: float = 25.0
    overlap: bool = True
    max_grad_norm: float | None = None
    micro_batches: int = 1
    dtype: str = "float32"
    auto_sync_gradients: bool = True
    prefetch: bool = True
    recompute: str = "none"
    virtual_stages: int = 1
    device: Any = "cpu"
    precision: str = "full"

    def __new__(cls, *args: Any, **kwargs: Any) -> ShardingConfiguration:
        known = [f.name for f in fields(cls)]
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise ValueError(
                f"ShardingConfiguration: unknown field {unknown[0]}={kwargs[unknown[0]]!r}; "
                f"known fields: {', '.join(known)}"
            )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        b = self.bucket_mb
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) \
                or b <= 0:
            raise ValueError(f"bucket_mb={b!r} must be a positive number")
        m = self.micro_batches
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise ValueError(f"micro_batches={m!r} must be a positive integer")
        c = self.max_grad_norm
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or not math.isfinite(c) or c <= 0):
            raise ValueError(f"max_grad_norm={c!r} must be a positive number or None")
        dt = np.dtype(self.dtype).name if isinstance(self.dtype, (type, np.dtype)) \
            else self.dtype
        if dt not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {_DTYPES}")
        object.__setattr__(self, "dtype", dt)
        v = self.virtual_stages
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"virtual_stages={v!r} must be a positive integer")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} must be one of {PRECISIONS}")
        if self.precision != "full" and dt != "float32":
            raise ValueError(f"precision={self.precision!r} keeps float32 master weights: "
                             f"dtype={dt!r} must be 'float32'")
        if not isinstance(self.device, str) and not hasattr(self.device, "xp"):
            raise ValueError(f"device={self.device!r} must be 'cpu', 'cuda', 'cuda:N' or a "
                             "Device")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r} must be one of {RECOMPUTE}")
        for name in ("overlap", "auto_sync_gradients", "prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")

    @property
    def bucket_bytes(self) -> int:
        """Bucket size in bytes."""
        return max(1, int(self.bucket_mb * 2**20))

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def replace(self, **changes: Any) -> ShardingConfiguration:
        """A copy with some fields changed (validated like the constructor)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_high_bandwidth(cls, **overrides: Any) -> ShardingConfiguration:
        """Fast interconnect (NVLink, InfiniBand, shared memory): big buckets, overlap on."""
        return cls(**{"bucket_mb": 50.0, "overlap": True, "prefetch": True, **overrides})

    @classmethod
    def for_low_bandwidth(cls, **overrides: Any) -> ShardingConfiguration:
        """Slow network (Ethernet between nodes): fewer, larger messages; accumulate more
        micro-batches per exchange."""
        return cls(**{"bucket_mb": 200.0, "overlap": True, "micro_batches": 4, **overrides})

    def to_dict(self) -> dict[str, Any]:
        """The fields except the mesh, as plain values (for checkpoint attributes)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("mesh", "device")}
