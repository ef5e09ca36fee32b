"""The process group of the "mpidist" backend: each torch.distributed operation as MPI calls
on the group's own communicators (:mod:`mpidist.torch.backend` has the whole picture), with
the argument conventions of torch's ``ProcessGroup`` methods. Sums, minima, maxima,
all-gathers and broadcasts are mpidist.core.collectives' calls (two levels across nodes);
every check that could fail runs before anything is communicated.

:class:`ProcessGroupMPI` holds the collective operations (reductions, gathers, scatters,
all-to-all); it inherits the barriers and point-to-point operations from
:mod:`mpidist.torch.group_p2p` and the communicators, lifecycle and execution plumbing
from :mod:`mpidist.torch.group_base`. ``BACKEND`` and :func:`live_communicators` are
re-exported from there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d  # the options classes torch passes

from mpidist.core import collectives as C
from mpidist.core.comms import mpi
from mpidist.torch import ops
from mpidist.torch.group_base import BACKEND, live_communicators, one_tensor
from mpidist.torch.group_p2p import P2PGroup
from mpidist.torch.mixed import handoff
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


def _same_dtype(what: str, dtype: torch.dtype, tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if t.dtype != dtype:
            raise ValueError(f"{what}: tensors of {dtype} and {t.dtype} mixed in one call")


class ProcessGroupMPI(P2PGroup):
    """A torch ProcessGroup whose operations are MPI calls on its own communicators.

    Made by torch through :func:`register`'s creator for ``init_process_group("mpidist")``,
    ``new_group(..., backend="mpidist")`` and DeviceMesh; not constructed by users.
    """

    # -- reductions ----------------------------------------------------------------------
    @handoff("allreduce", (0, 0), c10d.AllreduceOptions, 1)
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        t = one_tensor(tensors, "all_reduce")
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
        t = one_tensor(tensors, "reduce")
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
        out, ins = one_tensor(outputs, "reduce_scatter"), one_tensor(inputs, "reduce_scatter")
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
        t = one_tensor(tensors, "broadcast")
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
        t, outs = one_tensor(inputs, "all_gather"), one_tensor(outputs, "all_gather")
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
        t = one_tensor(inputs, "gather")
        root = self._check_root(opts.rootRank, "gather")
        src = as_host(t)
        if self._r == root:
            outs = one_tensor(outputs, "gather")
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
        out = one_tensor(outputs, "scatter")
        root = self._check_root(opts.rootRank, "scatter")
        buf = scratch(out)
        if self._r == root:
            ins = one_tensor(inputs, "scatter")
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

    def _check_root(self, root: int, what: str) -> int:
        if not 0 <= root < self._n:
            raise ValueError(f"{what}: root {root} is outside a group of {self._n}")
        return root
