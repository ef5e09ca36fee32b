"""``ZeroRedundancyOptimizer`` over MPI, with torch's interface and semantics (ZeRO-1).

The parameters are partitioned as torch does (per group, largest first, each to the rank
with the fewest elements so far); they are views of one flat tensor per dtype and device,
laid out rank by rank, so ``step()`` shares them with one in-place ``Allgatherv`` each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from mpidist.core import collectives as C
from mpidist.torch._common import HostView, agree, resolve_comm

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Optimizer state sharded over the ranks of ``comm``; torch's interface.

    Collective construction over ``comm`` (default: every rank): the parameters' shapes,
    dtypes and the hyperparameters are checked to agree between ranks (the same
    ``ValueError`` on every rank otherwise). ``step()`` is collective over ``comm``;
    ``zero_grad()``, ``param_groups`` and learning-rate schedulers work as on any torch
    optimizer. ``consolidate_state_dict(to)`` (collective) gathers the whole state on rank
    ``to``, whose ``state_dict()`` is then the state dict of a plain ``optimizer_class`` over
    all parameters; ``load_state_dict`` (every rank, the same dict) keeps each rank's part.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        optimizer_class: the local optimizer, e.g. ``torch.optim.AdamW``.
        process_group: an mpi4py communicator (alias of ``comm``).
        parameters_as_bucket_view: accepted for compatibility; the parameters always become
            views of per-device flat tensors.
        overlap_with_ddp: not supported (``ValueError``).
        comm: an mpi4py intracommunicator.
        **defaults: the local optimizer's hyperparameters (``lr=...``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        process_group: Any = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        comm: Any = None,
        **defaults: Any,
    ) -> None:
        comm = resolve_comm(comm, process_group)
        super().__init__(params, defaults)
        del parameters_as_bucket_view
        error = None
        if overlap_with_ddp:
            error = "overlap_with_ddp=True is not supported; step after backward instead"
        elif not (isinstance(optimizer_class, type)
                  and issubclass(optimizer_class, torch.optim.Optimizer)):
            error = f"optimizer_class={optimizer_class!r} is not a torch optimizer class"
        items = [f"{optimizer_class!r}", repr(sorted(defaults.items()))]
        items += [f"group {g} param {i} {tuple(p.shape)} {p.dtype} {p.device.type}"
                  for g, group in enumerate(self.param_groups)
                  for i, p in enumerate(group["params"])]
        agree(comm, "ZeroRedundancyOptimizer", error, items)
        self.comm = comm
        self.world_size, self.rank = comm.Get_size(), comm.Get_rank()
        self.optimizer_class = optimizer_class
        self._build()
        self._all_state_dicts: list[dict[str, Any]] = []

    # -- partition -------------------------------------------------------------------------
    def _build(self) -> None:
        """torch's greedy partition (``[group][rank] -> parameters``), the local optimizer over
        this rank's part and the flat layouts."""
        sizes = [0] * self.world_size
        self._partition: list[list[list[torch.Tensor]]] = []
        for group in self.param_groups:
            per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
            for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
                r = int(np.argmin(sizes))
                per_rank[r].append(p)
                sizes[r] += p.numel()
            self._partition.append(per_rank)
        self.optim = self.optimizer_class(self._local_groups(), **self.defaults)
        self._layouts = self._make_layouts()

    def _local_groups(self) -> list[dict[str, Any]]:
        groups = []
        for group, per_rank in zip(self.param_groups, self._partition, strict=True):
            local = {k: v for k, v in group.items() if k != "params"}
            local["params"] = per_rank[self.rank]
            groups.append(local)
        return groups

    def _make_layouts(self) -> list[_Layout]:
        """Per (dtype, device): one flat tensor holding every parameter, rank by rank; each
        parameter's ``.data`` becomes its view."""
        keys: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
        for per_rank in self._partition:
            for r, ps in enumerate(per_rank):
                for p in ps:
                    keys.setdefault((p.dtype, p.device), [[] for _ in per_rank])[r].append(p)
        return [_Layout(per_rank) for per_rank in keys.values()]

    # -- torch's interface -------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """Update this rank's partition, then share the parameters. Collective over comm."""
        self.sync_param_groups(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(closure) if closure is not None else self.optim.step()
        self.sync_param_groups(self.optim.param_groups, self.param_groups)
        for layout in self._layouts:
            layout.allgather(self.comm)
        return loss

    def sync_param_groups(self, src: list[dict[str, Any]], dst: list[dict[str, Any]]) -> None:
        """Copy every hyperparameter (all but ``params``) of the groups ``src`` into the
        groups ``dst`` (this wrapper's groups and the local optimizer's). Not collective."""
        for a, b in zip(src, dst, strict=True):
            for k, v in a.items():
                if k != "params":
                    b[k] = v

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (before the first step only; re-partitions). Collective
        over ``comm`` once the optimizer exists."""
        super().add_param_group(param_group)
        if hasattr(self, "optim"):  # after construction: repartition everything
            if any(self.optim.state.values()):
                raise RuntimeError("add_param_group after the first step() is not supported")
            self._build()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state on rank ``to``. Collective over ``comm``."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"to={to} is outside a group of {self.world_size} ranks")
        local = self.optim.state_dict()
        gathered = self.comm.gather(_to_cpu(local), root=to)
        self._all_state_dicts = gathered if self.rank == to else []

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in torch's format (rank ``to`` of the last
        :meth:`consolidate_state_dict`). Not collective."""
        if not self._all_state_dicts:
            raise RuntimeError(
                "optimizer state has not been consolidated on this rank; call "
                f"consolidate_state_dict(to={self.rank}) on every rank first"
            )
        self.sync_param_groups(self.optim.param_groups, self.param_groups)
        index = self._positions()
        out = super().state_dict()
        out["state"] = {}
        for r, local in enumerate(self._all_state_dicts):
            for lg, per_rank in zip(local["param_groups"], self._partition, strict=True):
                for li, p in zip(lg["params"], per_rank[r], strict=True):
                    if li in local["state"]:
                        out["state"][index[p]] = local["state"][li]
        out["state"] = dict(sorted(out["state"].items()))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state dict (from :meth:`state_dict` or a plain optimizer over the same
        parameters); each rank keeps its partition. Not collective."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(groups)} parameter groups, the "
                             f"optimizer {len(self.param_groups)}")
        for g, (saved, mine) in enumerate(zip(groups, self.param_groups, strict=True)):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(f"parameter group {g}: the state dict has "
                                 f"{len(saved['params'])} parameters, the optimizer "
                                 f"{len(mine['params'])}")
        self.sync_param_groups(groups, self.param_groups)
        # A torch state dict names parameters by their position over all groups.
        saved_index = [i for g in groups for i in g["params"]]
        position = self._positions()
        local: dict[str, Any] = {"state": {}, "param_groups": self._local_groups()}
        here = 0  # a parameter's position in the local optimizer
        for lg in local["param_groups"]:
            params, lg["params"] = lg["params"], []
            for p in params:
                key = saved_index[position[p]]
                if key in state_dict["state"]:
                    local["state"][here] = state_dict["state"][key]
                lg["params"].append(here)
                here += 1
        self.optim.load_state_dict(local)

    def _positions(self) -> dict[torch.Tensor, int]:
        """Each parameter's position over all groups (its first, if repeated)."""
        out: dict[torch.Tensor, int] = {}
        for p in (p for g in self.param_groups for p in g["params"]):
            out.setdefault(p, len(out))
        return out


class _Layout:
    """Parameters of one dtype and device as views of one flat tensor, rank by rank."""

    def __init__(self, per_rank: list[list[torch.Tensor]]) -> None:
        self.counts = [sum(p.numel() for p in ps) for ps in per_rank]
        params = [p for ps in per_rank for p in ps]
        self.flat = torch.empty(sum(self.counts), dtype=params[0].dtype, device=params[0].device)
        for p, view in zip(params, self.flat.split([p.numel() for p in params]), strict=True):
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
        self.view = HostView(self.flat)

    def allgather(self, comm: Any) -> None:
        """Every rank's segment to every rank, in place. Collective over ``comm``."""
        if comm.Get_size() == 1:
            return
        C.allgather_varied(self.view.to_host(), self.counts, comm=comm)
        self.view.to_device()


def _to_cpu(obj: Any) -> Any:
    """A copy of a state dict with every tensor on the CPU (for gathering)."""
    if torch.is_tensor(obj):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
