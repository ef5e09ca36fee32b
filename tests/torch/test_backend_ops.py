"""Every operation of the "mpidist" torch.distributed backend against values computed in one
process: each ReduceOp and dtype, uneven sizes, non-contiguous tensors, async Work, point to
point, coalesced, object and functional collectives, clear errors before communication."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from mpidist.torch import backend  # noqa: E402

R = dist.ReduceOp
pytestmark = pytest.mark.filterwarnings("ignore:.*deprecated:FutureWarning",
                                      "ignore:Sparse invariant:UserWarning")


def data(rank: int, shape=(5,), dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) + 1.5
    return torch.randint(1, 7, shape, generator=g).to(dtype)


def every(n, **kw):
    return [data(r, **kw) for r in range(n)]


_FOLD = {R.SUM: torch.add, R.PRODUCT: torch.mul, R.MIN: torch.minimum, R.MAX: torch.maximum,
         R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}


def fold(op, xs):
    """The reduction of ``xs`` by ``op`` in one process (on bool: SUM is or, PRODUCT and)."""
    if xs[0].dtype == torch.bool:
        op = {R.SUM: R.BOR, R.PRODUCT: R.BAND}.get(op, op)
    return functools.reduce(_FOLD[op], xs)


INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *INTS, torch.bool])
def test_all_reduce_every_op_and_dtype(world, dtype):
    rank, n = world
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
    if not dtype.is_floating_point:
        ops += [R.BAND, R.BOR, R.BXOR]
    for op in ops:
        t = data(rank, dtype=dtype)
        dist.all_reduce(t, op=op)
        ref = fold(op, every(n, dtype=dtype))
        if dtype.is_floating_point:  # MPI may associate the terms in another order
            torch.testing.assert_close(t, ref, rtol=4 * torch.finfo(dtype).eps, atol=0)
        else:
            assert torch.equal(t, ref), (op, dtype)


@pytest.mark.mpi(min_size=2)
def test_all_reduce_avg_premul_and_complex(world):
    rank, n = world
    t = data(rank)
    dist.all_reduce(t, op=R.AVG)
    torch.testing.assert_close(t, sum(every(n)) / n, rtol=1e-14, atol=0)
    t = data(rank, dtype=torch.int64)
    dist.all_reduce(t, op=R.AVG)
    assert torch.equal(t, torch.div(sum(every(n, dtype=torch.int64)), n, rounding_mode="trunc"))
    for factor in (0.25, torch.tensor([0.5], dtype=torch.float64)):
        t = data(rank)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))
        f = float(factor) if not isinstance(factor, torch.Tensor) else factor.item()
        torch.testing.assert_close(t, sum(x * f for x in every(n)), rtol=1e-14, atol=0)
    t = data(rank, dtype=torch.complex128)
    dist.all_reduce(t)  # torch passes complex tensors as real views
    torch.testing.assert_close(t, sum(every(n, dtype=torch.complex128)), rtol=1e-14, atol=0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_floats_reduce_with_float32_accumulation(world, dtype):
    rank, n = world
    # Values whose sum in 16 bits would round at every step: 1 + n-1 tiny terms.
    t = torch.full((64,), 1.0 if rank == 0 else 2.0 ** -9, dtype=dtype)
    dist.all_reduce(t)
    exact = torch.tensor(1.0 + (n - 1) * 2.0 ** -9, dtype=torch.float32).to(dtype)
    assert torch.equal(t, torch.full((64,), exact.item(), dtype=dtype))
    out = torch.empty(4, dtype=dtype)
    dist.reduce_scatter_tensor(out, torch.arange(4.0 * n, dtype=dtype) + rank, op=R.AVG)
    ref = (torch.arange(4.0 * n) + (n - 1) / 2)[4 * rank:4 * rank + 4].to(dtype)
    assert torch.equal(out, ref)


@pytest.mark.mpi(min_size=2)
def test_async_work_and_future(world):
    rank, n = world
    t = data(rank)
    work = dist.all_reduce(t, async_op=True)
    assert work is not None
    work.wait()
    assert work.is_completed() and work.is_success()
    fut = work.get_future()
    assert torch.equal(fut.wait()[0], t)
    torch.testing.assert_close(t, sum(every(n)), rtol=1e-14, atol=0)
    chained = dist.all_reduce(data(rank), async_op=True).get_future().then(
        lambda f: f.value()[0] * 2)
    torch.testing.assert_close(chained.wait(), 2 * sum(every(n)), rtol=1e-14, atol=0)


@pytest.mark.mpi(min_size=2)
def test_non_contiguous_tensors(world):
    rank, n = world
    base = data(rank, shape=(6, 4))
    t = base.t()  # non-contiguous
    dist.all_reduce(t)
    torch.testing.assert_close(base, sum(every(n, shape=(6, 4))), rtol=1e-14, atol=0)
    outs = [torch.empty(4, 3).t() for _ in range(n)]
    dist.all_gather(outs, data(rank, shape=(4, 3), dtype=torch.float32).t())
    for r, o in enumerate(outs):
        assert torch.equal(o, data(r, shape=(4, 3), dtype=torch.float32).t())
    b = torch.zeros(3, 5)[:, ::2]
    if rank == 0:
        b.copy_(torch.arange(9.0).reshape(3, 3))
    dist.broadcast(b, src=0)
    assert torch.equal(b, torch.arange(9.0).reshape(3, 3))


@pytest.mark.mpi(min_size=2)
def test_gathers_with_uneven_sizes(world):
    rank, n = world
    sizes = [r + 1 for r in range(n)]  # rank r contributes r+1 elements
    outs = [torch.empty(s, dtype=torch.int32) for s in sizes]
    dist.all_gather(outs, torch.full((sizes[rank],), rank, dtype=torch.int32))
    assert [o.tolist() for o in outs] == [[r] * s for r, s in enumerate(sizes)]
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "text": "x" * rank})
    assert objs == [{"rank": r, "text": "x" * r} for r in range(n)]
    gathered = [None] * n if rank == n - 1 else None
    dist.gather_object(("from", rank), gathered, dst=n - 1)
    if rank == n - 1:
        assert gathered == [("from", r) for r in range(n)]
    box = [["a", rank]] if rank == 1 else [None]
    dist.broadcast_object_list(box, src=1)
    assert box == [["a", 1]]
    got = [None]
    dist.scatter_object_list(got, [{"for": r} for r in range(n)] if rank == 0 else None, src=0)
    assert got == [{"for": rank}]


@pytest.mark.mpi(min_size=2)
def test_into_tensor_forms_in_place_and_odd_lengths(world):
    rank, n = world
    k = 3  # not divisible by most world sizes: the per-rank chunk is what matters
    out = torch.empty(n * k, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, torch.full((k,), rank, dtype=torch.bfloat16))
    assert out.tolist() == [float(r) for r in range(n) for _ in range(k)]
    buf = torch.zeros(n, k, dtype=torch.float64)
    buf[rank] = rank + 0.5
    dist.all_gather_into_tensor(buf, buf[rank])  # input aliases its slot of the output
    assert buf[:, 0].tolist() == [r + 0.5 for r in range(n)]
    rs = torch.empty(k)
    dist.reduce_scatter_tensor(rs, torch.arange(n * k, dtype=torch.float32) * (rank + 1))
    total = n * (n + 1) / 2
    assert rs.tolist() == [total * v for v in range(rank * k, rank * k + k)]
    ins = [torch.full((r + 2,), float(rank + 1)) for r in range(n)]
    out = torch.empty(rank + 2)
    dist.reduce_scatter(out, ins, op=R.MAX)
    assert out.tolist() == [float(n)] * (rank + 2)


@pytest.mark.mpi(min_size=2)
def test_rooted_collectives(world):
    rank, n = world
    root = n - 1
    t = data(rank, dtype=torch.int64)
    dist.reduce(t, dst=root, op=R.SUM)
    if rank == root:
        assert torch.equal(t, sum(every(n, dtype=torch.int64)))
    g = [torch.empty(2, 2) for _ in range(n)] if rank == root else None
    dist.gather(torch.full((2, 2), float(rank)), g, dst=root)
    if rank == root:
        assert [x[0, 0].item() for x in g] == [float(r) for r in range(n)]
    out = torch.empty(3, dtype=torch.int16)
    src = [torch.full((3,), r, dtype=torch.int16) for r in range(n)] if rank == 0 else None
    dist.scatter(out, src, src=0)
    assert out.tolist() == [rank] * 3
    b = torch.arange(4) if rank == 1 else torch.zeros(4, dtype=torch.int64)
    dist.broadcast(b, src=1)
    assert b.tolist() == [0, 1, 2, 3]


@pytest.mark.mpi(min_size=2)
def test_all_to_all_even_and_uneven(world):
    rank, n = world
    inp = torch.arange(n * 2, dtype=torch.float64) + 100 * rank
    out = torch.empty(n * 2, dtype=torch.float64)
    dist.all_to_all_single(out, inp)
    assert out.tolist() == [100 * s + 2 * rank + i for s in range(n) for i in range(2)]
    # rank r sends (d + 1) rows of width 2 to rank d
    send = [d + 1 for d in range(n)]
    recv = [rank + 1] * n
    inp = torch.cat([torch.full((d + 1, 2), float(10 * rank + d)) for d in range(n)])
    out = torch.empty(sum(recv), 2)
    dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
    assert out[:, 0].tolist() == [float(10 * s + rank) for s in range(n) for _ in range(rank + 1)]
    outs = [torch.empty(s + 1, dtype=torch.int32) for s in range(n)]
    dist.all_to_all(outs, [torch.full((rank + 1,), rank * n + d, dtype=torch.int32)
                           for d in range(n)])
    assert [o.tolist() for o in outs] == [[s * n + rank] * (s + 1) for s in range(n)]


@pytest.mark.mpi(min_size=2)
def test_point_to_point(world):
    rank, n = world
    right, left = (rank + 1) % n, (rank - 1) % n
    got = torch.empty(1000, dtype=torch.float64)  # large enough not to go eagerly
    reqs = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, torch.full((1000,), float(rank), dtype=torch.float64), right),
        dist.P2POp(dist.irecv, got, left)])
    for r in reqs:
        r.wait()
    assert got[0].item() == left and reqs[1].is_completed()
    if rank == 0:
        senders = []
        for _ in range(1, n):
            x = torch.empty(2, dtype=torch.int64)
            senders.append(dist.recv(x))  # any source: returns the sender's rank
            assert x.tolist() == [senders[-1]] * 2
        assert sorted(senders) == list(range(1, n))
    else:
        dist.send(torch.tensor([rank, rank]), dst=0)
    if rank == 0:
        dist.send(torch.tensor([7.0]), dst=1, tag=5)
        dist.send(torch.tensor([9.0]), dst=1, tag=6)
    elif rank == 1:
        a, b = torch.empty(1), torch.empty(1)
        wb = dist.irecv(b, src=0, tag=6)
        dist.recv(a, src=0, tag=5)
        wb.wait()
        assert (a.item(), b.item()) == (7.0, 9.0)


@pytest.mark.mpi(min_size=2)
def test_coalesced_forms(world):
    rank, n = world
    from torch.distributed.distributed_c10d import _coalescing_manager

    ts = [data(rank, shape=(s,), seed=s) for s in (1, 4, 7)]
    dist.all_reduce_coalesced(ts)
    for s, t in zip((1, 4, 7), ts, strict=True):
        torch.testing.assert_close(t, sum(every(n, shape=(s,), seed=s)), rtol=1e-14, atol=0)
    outs = [torch.empty(n * 2) for _ in range(3)]
    with _coalescing_manager(async_ops=True) as cm:
        for i, o in enumerate(outs):
            dist.all_gather_into_tensor(o, torch.full((2,), float(rank + i)))
    cm.wait()
    for i, o in enumerate(outs):
        assert o.tolist() == [float(r + i) for r in range(n) for _ in range(2)]
    ts = [torch.ones(3) * rank, torch.ones(2) * rank]
    with _coalescing_manager(device=torch.device("cpu")):
        for t in ts:
            dist.all_reduce(t)
    assert ts[0].tolist() == [n * (n - 1) / 2] * 3


@pytest.mark.mpi(min_size=2)
def test_functional_collectives(world):
    import torch.distributed._functional_collectives as fc

    rank, n = world
    group = dist.group.WORLD
    out = fc.all_reduce(data(rank), "sum", group)
    torch.testing.assert_close(out, sum(every(n)), rtol=1e-14, atol=0)
    out = fc.all_gather_tensor(torch.full((2, 3), float(rank)), 0, group)
    assert out[::2, 0].tolist() == [float(r) for r in range(n)]
    out = fc.reduce_scatter_tensor(torch.ones(n * 2, 3), "sum", 0, group)
    assert out.shape == (2, 3) and out.eq(n).all()
    out = fc.all_to_all_single(torch.arange(n, dtype=torch.float64) + 10 * rank, None, None,
                               group)
    assert out.tolist() == [10.0 * s + rank for s in range(n)]


@pytest.mark.mpi(min_size=2)
def test_unsupported_is_a_clear_error_before_communicating(world):
    rank, n = world
    with pytest.raises(ValueError, match="BAND needs an integer or bool tensor; got"):
        dist.all_reduce(torch.ones(2), op=R.BAND)
    with pytest.raises(ValueError, match="AVG is not defined on bool"):
        dist.all_reduce(torch.ones(2, dtype=torch.bool), op=R.AVG)
    with pytest.raises(ValueError, match="complex"):
        dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=R.MAX)
    with pytest.raises(ValueError, match="need .* x 3"):
        dist.all_gather_into_tensor(torch.empty(n * 3 + 1), torch.empty(3))
    with pytest.raises(ValueError, match="split_sizes"):
        dist.all_to_all_single(torch.empty(n), torch.empty(n), input_split_sizes=[n + 1] * n,
                               output_split_sizes=[1] * n)
    with pytest.raises(ValueError, match="tag=-1"):
        dist.send(torch.ones(1), dst=(rank + 1) % n, tag=-1)
    dist.barrier()  # nothing above reached MPI: the ranks are still in step


@pytest.mark.mpi(min_size=2)
def test_debug_check_names_the_ranks_that_differ(world):
    from mpidist.core import collectives as C

    rank, n = world
    previous = C.set_debug(True)
    try:
        with pytest.raises(C.CollectiveMismatchError, match=r"ranks \[0\]"):
            dist.all_reduce(torch.ones(3 if rank == 0 else 4))
        with pytest.raises(C.CollectiveMismatchError):
            if rank == 0:
                dist.broadcast(torch.ones(2), src=0)
            else:
                dist.all_reduce(torch.ones(2))
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [n, n]
    finally:
        C.set_debug(previous)


@pytest.mark.mpi(min_size=2)
def test_groups_are_communicators_of_their_members(world):
    rank, n = world
    evens = list(range(0, n, 2))
    before = backend.live_communicators()
    for _ in range(20):  # created and destroyed again and again: no communicator leaks
        g = dist.new_group(evens)
        if rank in evens:
            assert g.comm.Get_size() == len(evens)
            t = torch.ones(1)
            dist.all_reduce(t, group=g)
            assert t.item() == len(evens)
        dist.destroy_process_group(g)
    assert backend.live_communicators() == before
    sub, _ = dist.new_subgroups(group_size=1 if n % 2 else 2)
    t = torch.full((1,), float(rank))
    dist.all_reduce(t, group=sub)
    members = dist.get_process_group_ranks(sub)
    assert t.item() == sum(members) and rank in members
    assert dist.get_rank(sub) == members.index(rank)
    odd = dist.new_group([r for r in range(n) if r % 2], backend="mpidist")
    if rank % 2:
        x = torch.ones(1) * rank
        dist.broadcast(x, group_src=0, group=odd)
        assert x.item() == 1.0


@pytest.mark.mpi(min_size=2)
def test_device_mesh_of_any_shape(world):
    from torch.distributed.device_mesh import init_device_mesh

    rank, n = world
    shapes = [(n,)] + ([(2, n // 2)] if n % 2 == 0 else [(1, n)])
    for shape in shapes:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=tuple("ab"[:len(shape)]))
        for dim, name in enumerate(mesh.mesh_dim_names):
            group = mesh.get_group(name)
            ranks = dist.get_process_group_ranks(group)
            t = torch.full((1,), float(rank))
            dist.all_reduce(t, group=group)
            assert t.item() == sum(ranks) and len(ranks) == shape[dim]


@pytest.mark.mpi(min_size=2)
def test_samplers_and_queries_behave_as_with_gloo(world):
    from torch.utils.data import DistributedSampler

    rank, n = world
    assert dist.is_initialized() and dist.get_backend() == "mpidist"
    assert dist.group.WORLD.group_name and dist.group.WORLD.name() == "mpidist"
    assert list(DistributedSampler(list(range(11)), shuffle=False)) == list(
        DistributedSampler(list(range(11)), num_replicas=n, rank=rank, shuffle=False))
    assert dist.get_process_group_ranks(dist.group.WORLD) == list(range(n))


@pytest.mark.mpi(min_size=2)
def test_sparse_all_reduce_and_all_gather_coalesced(world):
    rank, n = world
    i = torch.tensor([[rank, 0], [0, rank + 1]])
    t = torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0]), (n + 1, n + 2))
    dist.all_reduce(t)
    dense = sum(torch.sparse_coo_tensor(torch.tensor([[r, 0], [0, r + 1]]),
                                        torch.tensor([1.0, 2.0]), (n + 1, n + 2)).to_dense()
                for r in range(n))
    assert torch.equal(t.to_dense(), dense)
    inputs = [torch.full((2,), float(rank)), torch.full((3,), 10.0 + rank)]
    outputs = [[torch.empty(2), torch.empty(3)] for _ in range(n)]
    dist.all_gather_coalesced(outputs, inputs)
    assert [o[0].tolist() for o in outputs] == [[float(r)] * 2 for r in range(n)]
    assert [o[1].tolist() for o in outputs] == [[10.0 + r] * 3 for r in range(n)]


@pytest.mark.mpi(min_size=2)
def test_barrier_and_monitored_barrier_time_out_with_an_error(world):
    import datetime

    rank, n = world
    g = dist.new_group(timeout=datetime.timedelta(seconds=1))
    g.monitored_barrier(datetime.timedelta(seconds=30))  # everyone: passes
    if rank == 0:
        with pytest.raises(RuntimeError, match=" Timed out "):
            dist.barrier(group=g)  # nobody else comes
    last = n - 1
    if rank == 0:
        with pytest.raises(RuntimeError, match=f"Rank {last} failed to pass monitoredBarrier"):
            g.monitored_barrier(datetime.timedelta(seconds=1))
    elif rank != last:
        with pytest.raises(RuntimeError, match="not released by rank 0"):
            g.monitored_barrier(datetime.timedelta(seconds=3))
    dist.barrier()  # the default group is untouched


def test_a_world_of_one_and_methods_called_without_options():
    """Plain pytest (no mpiexec): a world of one, every method of the group called directly
    as torch's C++ callers may, without an options object."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("mpidist")
    try:
        pg = dist.group.WORLD
        t = torch.arange(4.0)
        for work in (pg.allreduce([t]), pg.allreduce_coalesced([t]), pg.reduce([t]),
                     pg.broadcast([t]), pg.barrier()):
            assert work.wait() and work.is_completed()
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        out = torch.empty(4)
        pg.allgather([[out]], [t]).wait()
        pg.all_gather_single(out, t).wait()
        pg.reduce_scatter_single(out, t).wait()
        pg.reduce_scatter([out], [[t]]).wait()
        pg.gather([[out]], [t]).wait()
        pg.scatter([out], [[t]]).wait()
        pg.alltoall([out], [t]).wait()
        pg.all_to_all_single(out, t, [], []).wait()
        assert out.tolist() == t.tolist()
        assert dist.get_rank() == 0 and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
    assert backend.live_communicators() == 0


@pytest.mark.mpi(min_size=2)
def test_overlap_runs_async_calls_on_a_thread_in_issue_order(world, monkeypatch):
    rank, n = world
    monkeypatch.setenv("MPIDIST_TORCH_OVERLAP", "1")  # read when a group is made
    g = dist.new_group()
    ts = [torch.full((5000,), float(rank + i)) for i in range(12)]
    works = [dist.all_reduce(t, group=g, async_op=True) for t in ts]
    chained = works[0].get_future().then(lambda f: f.value()[0][:2] * 2)
    b = torch.arange(3.0) * rank
    dist.broadcast(b, group=g, group_src=n - 1)  # synchronous: runs after the queued calls
    assert b.tolist() == [0.0, n - 1.0, 2 * (n - 1.0)]
    for i, (t, w) in enumerate(zip(ts, works, strict=True)):
        assert w.wait() and w.is_completed() and w.is_success()
        assert t[0].item() == n * i + n * (n - 1) / 2
    assert chained.wait().tolist() == [n * (n - 1.0)] * 2
    out = torch.empty(n * 2)
    w = dist.all_gather_into_tensor(out, torch.full((2,), float(rank)), group=g, async_op=True)
    w.wait()
    assert out.tolist() == [float(r) for r in range(n) for _ in range(2)]
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=4)
def test_collectives_take_two_levels_across_nodes(world, monkeypatch):
    """The backend's reductions and gathers are mpidist.core.collectives': on a group spanning
    nodes (declared here: two halves) they run in two levels, with the flat results."""
    from mpidist.core import topology

    rank, n = world
    if n % 2:
        pytest.skip("two nodes of equal size need an even world")
    ran = {"allreduce": 0, "reduce_scatter": 0, "allgather": 0}
    for kind in ran:
        real = getattr(topology, f"{kind}_stages")

        def counted(*args, _real=real, _kind=kind):
            ran[_kind] += 1
            return _real(*args)

        monkeypatch.setattr(topology, f"{kind}_stages", counted)
    monkeypatch.setenv("MPIDIST_COLLECTIVES", "hierarchical")
    g = dist.new_group()
    topology.set_node_map(g.comm, [2 * r // n for r in range(n)])
    xs = [torch.arange(13, dtype=torch.float64) * (r + 1) for r in range(n)]
    t = xs[rank].clone()
    dist.all_reduce(t, group=g)
    assert torch.equal(t, fold(R.SUM, xs))
    big = [torch.arange(4.0 * n) + r for r in range(n)]
    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, big[rank], op=R.AVG, group=g)
    assert torch.equal(out, (fold(R.SUM, big) / n)[4 * rank:4 * rank + 4])
    shard = torch.full((3,), rank + 0.5, dtype=torch.bfloat16)
    full = torch.empty(3 * n, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(full, shard, group=g)
    assert full.tolist() == [r + 0.5 for r in range(n) for _ in range(3)]
    assert all(ran.values()), ran
    dist.destroy_process_group(g)
