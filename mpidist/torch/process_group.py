"""The process group of the "mpidist" backend: each torch.distributed operation as MPI calls
on the group's own communicators (:mod:`mpidist.torch.backend` has the whole picture), with
the argument conventions of torch's ``ProcessGroup`` methods. Sums, minima, maxima,
all-gathers and broadcasts are mpidist.core.collectives' calls (two levels across nodes);
every check that could fail runs before anything is communicated.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d  # the options classes torch passes

from mpidist.core import collectives as C
from mpidist.core.comms import mpi
from mpidist.torch import ops
from mpidist.torch._common import overlap
from mpidist.torch.mixed import handoff, make_backend, parse_config
from mpidist.torch.ops import (
    Work,
    as_host,
    counts_spec,
    reduction,
    scratch,
    spec,
    words_array,
    write_back,
)

__all__ = ["BACKEND", "ProcessGroupMPI", "live_communicators"]

BACKEND = "mpidist"
_MONITOR_TAG = 32000  # (MPI guarantees tags up to 32767)
_GROUPS: weakref.WeakSet = weakref.WeakSet()


def live_communicators() -> int:
    """How many MPI communicators the backend's groups hold now (two per live group)."""
    return sum(g.communicators() for g in list(_GROUPS))


def _one(tensors: Sequence[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"{what}: the mpidist backend takes one tensor (or one list) per "
                         f"call; got {len(tensors)}")
    return tensors[0]


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _same_dtype(what: str, dtype: torch.dtype, tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if t.dtype != dtype:
            raise ValueError(f"{what}: tensors of {dtype} and {t.dtype} mixed in one call")


class _Call:
    """One operation's stay in MPI (see :meth:`ProcessGroupMPI._on`)."""

    __slots__ = ("_extra", "_group", "_guard", "_lock", "_tensors", "_what", "side")

    def __init__(self, group: ProcessGroupMPI, what: str, tensors: tuple, extra: Any) -> None:
        self._group, self._what, self._tensors, self._extra = group, what, tensors, extra
        self._lock: Any = None
        self._guard: Any = None
        # Which communicator is decided by the thread that issues the call (the group's
        # communication thread runs calls issued by the thread that made the group).
        self.side = threading.get_ident() != group._owner

    def _label(self) -> str:
        g = self._group
        return f"{self._what} on group {g._name or '?'} ({g._n} ranks)"

    def __enter__(self) -> Any:
        g = self._group
        g._check_live(self._what)
        if not self.side:
            comm = g._comm
        else:
            comm, self._lock = g._side, g._side_lock
            self._lock.acquire()
        try:
            if C.debug_enabled():
                shapes = " ".join(_describe(t) for t in self._tensors)
                C.check_signature(comm, f"{self._what} {self._extra} {shapes}")
            self._guard = ops.watch(self._label, g._timeout)
            self._guard.__enter__()
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise
        return comm

    def __exit__(self, *exc: Any) -> None:
        self._guard.__exit__(*exc)
        if self._lock is not None:
            self._lock.release()


def _execute(call: _Call, body: Callable[[Any], None]) -> None:
    with call as comm:
        body(comm)


class ProcessGroupMPI(dist.ProcessGroup):
    """A torch ProcessGroup whose operations are MPI calls on its own communicators.

    Made by torch through :func:`register`'s creator for ``init_process_group("mpidist")``,
    ``new_group(..., backend="mpidist")`` and DeviceMesh; not constructed by users.
    """

    def __init__(self, comm: Any, side: Any, base: Any, timeout: timedelta,
                 store: Any = None) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._comm, self._side, self._base = comm, side, base
        self._n, self._r = comm.Get_size(), comm.Get_rank()
        self._owner = threading.get_ident()
        self._side_lock = threading.RLock()
        self._timeout = timeout
        self._store = store
        self._name = ""
        self._desc = ""
        self._coalescing: list[Work] | None = None
        self._config: dict[str, str] | None = None
        self._others: dict[str, Any] = {}
        self._overlap = overlap()
        self._thread: ops.CommThread | None = None
        _GROUPS.add(self)

    # -- identity ------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's C++ name
        return BACKEND

    name = _get_backend_name = getBackendName

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_desc(self) -> str:
        return self._desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def comm(self) -> Any:
        """The group's MPI communicator (the backend's own duplicate; use it only for
        reading its size and ranks, or for MPI calls no torch operation overlaps)."""
        return self._comm

    @property
    def base(self) -> Any:
        """The communicator this group's ranks are numbered in (the world it was made in)."""
        return self._base

    def communicators(self) -> int:
        """How many MPI communicators this group still holds."""
        return int(self._comm is not None) + int(self._side is not None)

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the group's timeout (see the module docstring)."""
        self._timeout = timeout

    def shutdown(self) -> None:
        """Free the group's communicators (torch calls it in ``destroy_process_group``)."""
        if self._thread is not None:
            self._thread.close()
            self._thread = None
        finalized = mpi().Is_finalized()
        for attr in ("_side", "_comm"):
            comm = getattr(self, attr)
            if comm is not None and comm != mpi().COMM_NULL and not finalized:
                comm.Free()
            setattr(self, attr, None)
        for other in self._others.values():
            with contextlib.suppress(Exception):
                other.shutdown()
        self._others.clear()

    def abort(self) -> None:
        """Same as :meth:`shutdown` (MPI operations cannot be cancelled)."""
        self.shutdown()

    # -- plumbing ------------------------------------------------------------------------
    def _on(self, what: str, *tensors: torch.Tensor, extra: Any = "") -> _Call:
        """``with self._on(...) as comm``: the communicator to use from this thread, after
        the debug check (``what``, ``extra``, the tensors' dtypes and shapes), under the
        watchdog."""
        return _Call(self, what, tensors, extra)

    def _check_live(self, what: str) -> None:
        if self._comm is None:
            raise RuntimeError(f"{what}: process group {self._name!r} was destroyed")

    def _work(self, work: Work) -> Work:
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    def _done(self, result: list[torch.Tensor]) -> Work:
        return self._work(Work(result))

    def _run(self, call: _Call, body: Callable[[Any], None], result: list[torch.Tensor],
             opts: Any) -> Work:
        """Run an operation's MPI call and what follows it (``body(comm)``): now, on this
        thread; or, for an asynchronous call (``opts.asyncOp``) with overlap on, on the
        group's communication thread, in the order the calls were issued."""
        if not call.side and self._overlap and getattr(opts, "asyncOp", False):
            if self._thread is None:
                self._thread = ops.CommThread(f"mpidist-comm-{self._name or '?'}")
            work = Work(result, pending=True, what=call._what, timeout=self._timeout)
            self._thread.submit(lambda: _execute(call, body), work)
            return self._work(work)
        if not call.side:
            self._drain()
        _execute(call, body)
        return self._done(result)

    def _drain(self) -> None:
        """Wait until the communication thread has run every call issued before."""
        if self._thread is not None:
            self._thread.drain()

    def backend_for(self, device: str) -> Any:
        """The torch backend that runs this group's operations on ``device`` tensors when
        the group was made with a mixed backend string (``"cpu:mpidist,cuda:nccl"``),
        created on first use (collective over the group); None where mpidist runs them."""
        if self._config is None:
            try:
                self._config = parse_config(dist.get_backend_config(self))
            except Exception:  # not registered with torch (yet): ours alone
                return None
        name = self._config.get(device, BACKEND)
        if name == BACKEND:
            return None
        if device not in self._others:
            self._others[device] = make_backend(name, device, self._store, self._r, self._n,
                                                self._timeout, self._name)
        return self._others[device]

    def _start_coalescing(self, device: Any = None) -> None:
        self._coalescing = []

    def _end_coalescing(self, device: Any = None) -> Work:
        works, self._coalescing = self._coalescing or [], None
        result = [t for w in works for t in w.outputs]
        return ops.CoalescedWork(works, result)

    # -- reductions ----------------------------------------------------------------------
    @handoff("allreduce", (0, 0), c10d.AllreduceOptions, 1)
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        t = _one(tensors, "all_reduce")
        op = (opts or c10d.AllreduceOptions()).reduceOp
        if t.layout == torch.sparse_coo:
            return self._sparse_allreduce(t, op)
        return self._allreduce_flat([t], op, "all_reduce", opts)

    def _sparse_allreduce(self, t: torch.Tensor, op: Any) -> Work:
        """SUM of sparse COO tensors: every rank's indices and values gathered, then
        coalesced (as gloo does); the result replaces ``t``'s contents."""
        if getattr(op, "op", op) != dist.ReduceOp.SUM:
            raise ValueError("all_reduce of a sparse tensor: the mpidist backend sums "
                             f"(ReduceOp.SUM) only; got {getattr(op, 'op', op)}")
        self._drain()
        local = t.detach().coalesce().to("cpu")
        indices = local.indices().t().contiguous()
        values = local.values().contiguous()
        with self._on("all_reduce (sparse)", t) as comm:
            counts = comm.allgather(indices.shape[0])

            def rows(x: torch.Tensor) -> torch.Tensor:  # every rank's rows of x
                out = torch.empty((sum(counts), *x.shape[1:]), dtype=x.dtype)
                width = math.prod(x.shape[1:])
                comm.Allgatherv(spec(x), counts_spec(out, [c * width for c in counts]))
                return out

            all_indices, all_values = rows(indices), rows(values)
        total = torch.sparse_coo_tensor(all_indices.t(), all_values, t.shape).coalesce()
        with torch.no_grad():
            t.copy_(total.to(t.device))
        return self._done([t])

    @handoff("allreduce_coalesced", (0, 0), c10d.AllreduceCoalescedOptions, 1)
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        if not tensors:
            return self._done([])
        op = (opts or c10d.AllreduceCoalescedOptions()).reduceOp
        _same_dtype("all_reduce_coalesced", tensors[0].dtype, tensors)
        return self._allreduce_flat(list(tensors), op, "all_reduce_coalesced", opts)

    def _allreduce_flat(self, tensors: list[torch.Tensor], op: Any, what: str,
                        opts: Any) -> Work:
        red = reduction(op, tensors[0].dtype, what)
        if len(tensors) == 1:
            wire = red.prepare(tensors[0])
        else:
            wire = torch.cat([red.prepare(t).reshape(-1) for t in tensors])

        def body(comm: Any) -> None:
            if red.plain is not None:
                C.allreduce(wire.detach().numpy(), red.plain, comm=comm)
            else:
                comm.Allreduce(mpi().IN_PLACE, spec(wire, red.datatype), red.mpi_op)
            red.finish(wire, self._n)
            if len(tensors) == 1:
                write_back(tensors[0], wire)
            else:
                sizes = [t.numel() for t in tensors]
                for t, piece in zip(tensors, wire.split(sizes), strict=True):
                    write_back(t, piece)

        return self._run(self._on(what, *tensors, extra=red.name), body, tensors, opts)

    @handoff("reduce", (0, 0), c10d.ReduceOptions, 1)
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts or c10d.ReduceOptions()
        t = _one(tensors, "reduce")
        root = self._check_root(opts.rootRank, "reduce")
        red = reduction(opts.reduceOp, t.dtype, "reduce")
        wire = red.prepare(t)

        def body(comm: Any) -> None:
            if self._r == root:
                comm.Reduce(mpi().IN_PLACE, spec(wire, red.datatype), red.mpi_op, root)
                red.finish(wire, self._n, out=t)
            else:
                comm.Reduce(spec(wire, red.datatype), None, red.mpi_op, root)

        return self._run(self._on("reduce", t, extra=(red.name, root)), body, [t], opts)

    @handoff("reduce_scatter", (0, 0), c10d.ReduceScatterOptions, 2)
    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> Work:
        opts = opts or c10d.ReduceScatterOptions()
        out, ins = _one(outputs, "reduce_scatter"), _one(inputs, "reduce_scatter")
        n, r = self._n, self._r
        if len(ins) != n:
            raise ValueError(f"reduce_scatter: {len(ins)} input tensors for a group of {n}")
        _same_dtype("reduce_scatter", out.dtype, ins)
        if ins[r].numel() != out.numel():
            raise ValueError(f"reduce_scatter: output has {out.numel()} elements but this "
                             f"rank's input piece {ins[r].numel()}")
        red = reduction(opts.reduceOp, out.dtype, "reduce_scatter")
        counts = [t.numel() for t in ins]
        wire_in = torch.cat([red.prepare(t).reshape(-1) for t in ins])
        wire_out = torch.empty(out.shape, dtype=red.wire)

        def body(comm: Any) -> None:
            comm.Reduce_scatter(spec(wire_in, red.datatype), spec(wire_out, red.datatype),
                                counts, red.mpi_op)
            red.finish(wire_out, n, out=out)

        call = self._on("reduce_scatter", out, extra=(red.name, counts))
        return self._run(call, body, [out], opts)

    @handoff("_reduce_scatter_base", (0,), c10d.ReduceScatterOptions, 2)
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Work:
        opts = opts or c10d.ReduceScatterOptions()
        n = self._n
        if input.numel() != n * output.numel():
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements; "
                             f"need {n} x {output.numel()} (the output) for a group of {n}")
        _same_dtype("reduce_scatter_tensor", output.dtype, [input])
        red = reduction(opts.reduceOp, output.dtype, "reduce_scatter_tensor")
        wire_in = red.prepare(input)
        direct = red.wire == output.dtype and not ops.overlaps(wire_in, output)
        wire_out = scratch(output) if direct else torch.empty(output.shape, dtype=red.wire)

        def body(comm: Any) -> None:
            if red.plain == "sum":
                C.reduce_scatter(wire_in.detach().numpy(), "sum", comm=comm,
                                 out=wire_out.detach().numpy())
            else:
                comm.Reduce_scatter_block(spec(wire_in, red.datatype, parts=n),
                                          spec(wire_out, red.datatype), red.mpi_op)
            red.finish(wire_out, n, out=output)

        call = self._on("reduce_scatter_tensor", input, extra=red.name)
        return self._run(call, body, [output], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Work:
        return self._pairwise(self.reduce_scatter_single, outputs, inputs, opts)

    def _pairwise(self, one: Callable[..., Work], outputs: Sequence[torch.Tensor],
                  inputs: Sequence[torch.Tensor], opts: Any) -> Work:
        """A coalesced form: ``one(output, input, opts)`` for each pair, one Work."""
        works = [one(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return ops.CoalescedWork(works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement -------------------------------------------------------------------
    @handoff("broadcast", (0, 0), c10d.BroadcastOptions, 1)
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts or c10d.BroadcastOptions()
        t = _one(tensors, "broadcast")
        root = self._check_root(opts.rootRank, "broadcast")
        buf = as_host(t) if self._r == root else scratch(t)

        def body(comm: Any) -> None:
            C.broadcast(words_array(buf), root, comm=comm)
            if self._r != root:
                write_back(t, buf)

        return self._run(self._on("broadcast", t, extra=root), body, [t], opts)

    @handoff("allgather", (1, 0), c10d.AllgatherOptions, 2)
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> Work:
        t, outs = _one(inputs, "all_gather"), _one(outputs, "all_gather")
        self._gather_lists("all_gather", t, outs)
        counts = [o.numel() for o in outs]
        buf = torch.empty(sum(counts), dtype=t.dtype)
        mine = buf[sum(counts[:self._r]):sum(counts[:self._r + 1])]

        def body(comm: Any) -> None:
            mine.copy_(t.detach().reshape(-1))
            words = words_array(buf)
            per = words.size // buf.numel() if buf.numel() else 1
            C.allgather_varied(words, [c * per for c in counts], comm=comm)
            for o, piece in zip(outs, buf.split(counts), strict=True):
                write_back(o, piece)

        return self._run(self._on("all_gather", t), body, list(outs), opts)

    def _gather_lists(self, what: str, t: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        n, r = self._n, self._r
        if len(outs) != n:
            raise ValueError(f"{what}: {len(outs)} output tensors for a group of {n}")
        _same_dtype(what, t.dtype, outs)
        if outs[r].numel() != t.numel():
            raise ValueError(f"{what}: input has {t.numel()} elements but this rank's "
                             f"output slot {outs[r].numel()}")

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any = None) -> Work:
        # outputs[r][i] receives rank r's inputs[i]
        if len(outputs) != self._n or any(len(o) != len(inputs) for o in outputs):
            raise ValueError(f"all_gather_coalesced: need {self._n} output lists (one per "
                             f"rank) of {len(inputs)} tensors (one per input)")
        works = [self.allgather([[o[i] for o in outputs]], [t], opts)
                 for i, t in enumerate(inputs)]
        return ops.CoalescedWork(works, [t for o in outputs for t in o])

    @handoff("_allgather_base", (0,), c10d.AllgatherOptions, 2)
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Work:
        n, r = self._n, self._r
        if output.numel() != n * input.numel():
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements; "
                             f"need {n} x {input.numel()} (the input) for a group of {n}")
        _same_dtype("all_gather_into_tensor", output.dtype, [input])
        out = scratch(output)
        src = as_host(input)
        k = input.numel() * input.element_size()
        in_place = src.data_ptr() == out.data_ptr() + r * k and src is input
        if not in_place and ops.overlaps(src, out):
            src = src.clone()

        def body(comm: Any) -> None:
            if in_place:
                C.allgather_inplace(words_array(out), comm=comm)
            else:
                C.allgather(words_array(src), comm=comm, out=words_array(out))
            write_back(output, out)

        return self._run(self._on("all_gather_into_tensor", input), body, [output], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> Work:
        return self._pairwise(self.all_gather_single, outputs, inputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @handoff("gather", (1, 0), c10d.GatherOptions, 2)
    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any = None) -> Work:
        opts = opts or c10d.GatherOptions()
        t = _one(inputs, "gather")
        root = self._check_root(opts.rootRank, "gather")
        src = as_host(t)
        if self._r == root:
            outs = _one(outputs, "gather")
            self._gather_lists("gather", t, outs)
            counts = [o.numel() for o in outs]
            buf = torch.empty(sum(counts), dtype=t.dtype)

            def body(comm: Any) -> None:
                comm.Gatherv(spec(src), counts_spec(buf, counts), root)
                for o, piece in zip(outs, buf.split(counts), strict=True):
                    write_back(o, piece)

            return self._run(self._on("gather", t, extra=root), body, list(outs), opts)
        if outputs and any(len(o) for o in outputs):
            raise ValueError(f"gather: rank {self._r} is not the root ({root}) and must "
                             "pass no output list")
        return self._run(self._on("gather", t, extra=root),
                         lambda comm: comm.Gatherv(spec(src), None, root), [], opts)

    @handoff("scatter", (0, 0), c10d.ScatterOptions, 2)
    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any = None) -> Work:
        opts = opts or c10d.ScatterOptions()
        out = _one(outputs, "scatter")
        root = self._check_root(opts.rootRank, "scatter")
        buf = scratch(out)
        if self._r == root:
            ins = _one(inputs, "scatter")
            self._gather_lists("scatter", out, ins)
            counts = [t.numel() for t in ins]
            send: torch.Tensor | None = torch.cat([as_host(t).reshape(-1) for t in ins])
        elif inputs and any(len(i) for i in inputs):
            raise ValueError(f"scatter: rank {self._r} is not the root ({root}) and "
                             "must pass no input list")
        else:
            send, counts = None, []

        def body(comm: Any) -> None:
            # (the spec points at send's memory: send must stay referenced until here)
            comm.Scatterv(None if send is None else counts_spec(send, counts), spec(buf), root)
            write_back(out, buf)

        return self._run(self._on("scatter", out, extra=root), body, [out], opts)

    @handoff("alltoall", (1, 0), c10d.AllToAllOptions, 2)
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> Work:
        n = self._n
        if len(inputs) != n or len(outputs) != n:
            raise ValueError(f"all_to_all: {len(inputs)} inputs and {len(outputs)} outputs "
                             f"for a group of {n}")
        _same_dtype("all_to_all", inputs[0].dtype, list(inputs) + list(outputs))
        send_counts = [t.numel() for t in inputs]
        recv_counts = [t.numel() for t in outputs]
        send = torch.cat([as_host(t).reshape(-1) for t in inputs])
        recv = torch.empty(sum(recv_counts), dtype=inputs[0].dtype)

        def body(comm: Any) -> None:
            comm.Alltoallv(counts_spec(send, send_counts), counts_spec(recv, recv_counts))
            for o, piece in zip(outputs, recv.split(recv_counts), strict=True):
                write_back(o, piece)

        return self._run(self._on("all_to_all", extra=inputs[0].dtype), body, list(outputs),
                         opts)

    @handoff("alltoall_base", (1,), c10d.AllToAllOptions, 4)
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> Work:
        _same_dtype("all_to_all_single", input.dtype, [output])
        send_counts = self._splits("input", input, input_split_sizes)
        recv_counts = self._splits("output", output, output_split_sizes)
        src = as_host(input)
        dst = scratch(output)
        if ops.overlaps(src, dst):
            src = src.clone()

        def body(comm: Any) -> None:
            comm.Alltoallv(counts_spec(src, send_counts), counts_spec(dst, recv_counts))
            write_back(output, dst)

        return self._run(self._on("all_to_all_single", extra=input.dtype), body, [output],
                         opts)

    alltoall_base = all_to_all_single

    def _splits(self, what: str, t: torch.Tensor, sizes: Sequence[int]) -> list[int]:
        n = self._n
        rows = t.shape[0] if t.dim() else 1
        row = t.numel() // rows if rows else 0
        if not sizes:
            if rows % n:
                raise ValueError(f"all_to_all_single: the {what}'s {rows} rows do not split "
                                 f"evenly over {n} ranks; give {what}_split_sizes")
            sizes = [rows // n] * n
        if len(sizes) != n or sum(sizes) != rows:
            raise ValueError(f"all_to_all_single: {what}_split_sizes={list(sizes)} must be "
                             f"{n} sizes summing to the {what}'s {rows} rows")
        return [int(s) * row for s in sizes]

    def barrier(self, opts: Any = None) -> Work:
        """Wait for every rank. Past the group's timeout: RuntimeError on this rank (a
        barrier holds no data, so it can be left behind, unlike a data collective)."""
        timeout = self._timeout
        if opts is not None and opts.timeout.total_seconds() > 0:
            timeout = opts.timeout
        self._drain()
        with self._on("barrier") as comm:
            req = comm.Ibarrier()
        if not ops.wait_until(req, timeout.total_seconds()):
            raise RuntimeError(f"barrier on group {self._name!r}: Timed out after "
                               f"{timeout.total_seconds():g} s waiting for the other ranks ")
        return self._done([])

    def monitored_barrier(self, timeout: timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier: rank 0 waits ``timeout`` (default the group's) for
        every other rank and raises RuntimeError naming the first rank that did not arrive
        (every such rank with ``wait_all_ranks``); the others wait for rank 0's release."""
        limit = (self._timeout if timeout is None else timeout).total_seconds()
        rank, n = self._r, self._n
        self._check_live("monitored_barrier")
        self._drain()
        tag = _MONITOR_TAG
        token = torch.zeros(1, dtype=torch.uint8)
        if rank != 0:
            self._comm.Send(spec(token), 0, tag)
            if not ops.wait_until(self._comm.Irecv(spec(token), 0, tag), limit):
                raise RuntimeError(f"Rank {rank} successfully reached monitoredBarrier, but "
                                   f"was not released by rank 0 within {limit:g} s")
            return
        if limit <= 0 and n > 1:
            raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {limit * 1e3:g} ms")
        tokens = [torch.zeros(1, dtype=torch.uint8) for _ in range(n)]
        reqs = {r: self._comm.Irecv(spec(tokens[r]), r, tag) for r in range(1, n)}
        ops.wait_until(None, limit, pending=reqs)
        late = sorted(r for r, req in reqs.items() if not req.Test())
        if late:
            for r in late:
                reqs[r].Cancel()
                ops.abandon(reqs[r])
            shown = late if wait_all_ranks else late[:1]
            who = "Ranks " + ", ".join(map(str, shown)) if len(shown) > 1 else f"Rank {late[0]}"
            raise RuntimeError(f"{who} failed to pass monitoredBarrier in {limit * 1e3:g} ms")
        for r in range(1, n):
            self._comm.Send(spec(token), r, tag)

    def _check_root(self, root: int, what: str) -> int:
        if not 0 <= root < self._n:
            raise ValueError(f"{what}: root {root} is outside a group of {self._n}")
        return root

    # -- point to point ------------------------------------------------------------------
    def _peer(self, peer: int, what: str, tag: int) -> None:
        if not 0 <= peer < self._n:
            raise ValueError(f"{what}: rank {peer} is outside a group of {self._n}")
        if tag < 0:
            raise ValueError(f"{what}: tag={tag} must be >= 0 for MPI")
        self._check_live(what)

    @handoff("send", (0, 0))
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        t = _one(tensors, "send")
        self._peer(dst, "send", tag)
        src = as_host(t)
        req = self._comm.Isend(spec(src), dst, tag)
        return self._work(Work([t], [req], keep=(src,), what=f"send to {dst}",
                               timeout=self._timeout))

    @handoff("recv", (0, 0))
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        t = _one(tensors, "recv")
        self._peer(src, "recv", tag)
        return self._irecv(t, src, tag, f"recv from {src}")

    @handoff("recv_anysource", (0, 0))
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        t = _one(tensors, "recv")
        self._peer(0, "recv", tag)
        return self._irecv(t, mpi().ANY_SOURCE, tag, "recv from any source")

    def _irecv(self, t: torch.Tensor, src: int, tag: int, what: str) -> Work:
        buf = scratch(t)
        req = self._comm.Irecv(spec(buf), src, tag)
        return self._work(Work([t], [req], finish=lambda: write_back(t, buf), keep=(buf,),
                               what=what, timeout=self._timeout))
