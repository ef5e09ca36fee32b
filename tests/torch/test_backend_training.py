"""torch's own parallel stack on the "mpidist" backend equals single-process training on the
same global batch (float64, 1e-10): DDP (unused parameters, no_sync, buffers), FSDP2 with
meta-device init, full state dicts and clipping, tensor parallelism with FSDP2 on a 2-D
mesh, and pipeline schedules. The world sizes 2, 3 and 4 give shards of uneven length."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_models as M  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

GB = 24  # the global batch: divisible by 2, 3 and 4 ranks
STEPS = 4


def reference(kind: str, steps: int = STEPS, clip: float | None = None,
              accumulate: int = 1) -> tuple[list[float], dict[str, np.ndarray]]:
    """Single-process training on the whole global batch."""
    model = M.make(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(steps):
        x, y = M.batch(kind, step, GB)
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate), strict=True):
            loss = M.loss_of(kind, model, xs, ys) / accumulate
            loss.backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total)
    return losses, M.params_of(model)


# -- DDP ------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_ddp_no_sync_equals_single_process(world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = world
    model = DDP(M.make("gpt", seed=rank))  # rank 0's parameters are broadcast
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for step in range(STEPS):
        x, y = (M.local(t, rank, n) for t in M.batch("gpt", step, GB))
        opt.zero_grad()
        with model.no_sync():  # the first half accumulates locally
            (M.loss_of("gpt", model, x[:GB // n // 2], y[:GB // n // 2]) / 2).backward()
        (M.loss_of("gpt", model, x[GB // n // 2:], y[GB // n // 2:]) / 2).backward()
        opt.step()
    _, ref_params = reference("gpt")
    M.assert_close({k.removeprefix("module."): v for k, v in M.params_of(model).items()},
                   ref_params, what="ddp")


@pytest.mark.mpi(min_size=2)
def test_ddp_buffers_and_unused_parameters_equal_replicas(world):
    """BatchNorm statistics are per rank: the single-process oracle keeps one replica per
    rank, copies replica 0's buffers to the others before each forward (DDP's
    broadcast_buffers), and averages the replicas' gradients."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = world
    model = DDP(M.make("bn", seed=rank), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    replicas = [M.make("bn") for _ in range(n)]
    opts = [torch.optim.SGD(r.parameters(), lr=0.1, momentum=0.9) for r in replicas]
    for step in range(STEPS):
        x, y = M.batch("bn", step, GB)
        opt.zero_grad()
        M.loss_of("bn", model, M.local(x, rank, n), M.local(y, rank, n)).backward()
        opt.step()
        for rep in replicas[1:]:
            for mine, first in zip(rep.buffers(), replicas[0].buffers(), strict=True):
                mine.data.copy_(first)
        for r, (rep, o) in enumerate(zip(replicas, opts, strict=True)):
            o.zero_grad()
            M.loss_of("bn", rep, M.local(x, r, n), M.local(y, r, n)).backward()
        with torch.no_grad():
            for ps in zip(*(rep.parameters() for rep in replicas), strict=True):
                if ps[0].grad is not None:
                    mean = sum(p.grad for p in ps) / n
                    for p in ps:
                        p.grad.copy_(mean)
        for o in opts:
            o.step()
    assert model.module.unused.weight.grad is None  # never used, never reduced
    mine = replicas[rank]
    M.assert_close(M.params_of(model.module), M.params_of(mine), rtol=1e-12, what="params")
    M.assert_close({k: v.numpy() for k, v in model.module.named_buffers()},
                   {k: v.numpy() for k, v in mine.named_buffers()}, rtol=1e-12,
                   what="buffers")


# -- FSDP2 ----------------------------------------------------------------------------------
def fsdp_gpt(mesh) -> torch.nn.Module:
    """TinyGPT built on the meta device, sharded, materialised, loaded from a full state
    dict broadcast from rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = M.TinyGPT().double()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    state = M.make("gpt").state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(model, state, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    return model


@pytest.mark.mpi(min_size=2)
def test_fsdp2_meta_init_full_state_dict_and_clipping(world):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    rank, n = world
    model = fsdp_gpt(init_device_mesh("cpu", (n,)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for step in range(STEPS):
        x, y = (M.local(t, rank, n) for t in M.batch("gpt", step, GB))
        opt.zero_grad()
        M.loss_of("gpt", model, x, y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    _, ref = reference("gpt", clip=0.05)
    M.assert_close(M.params_of(model), ref, what="fsdp2")
    assert norm.full_tensor().item() > 0.05  # the clipping was active
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    if rank == 0:
        M.assert_close({k: v.numpy() for k, v in state.items() if k in ref}, ref,
                       what="full state dict")
    else:
        assert state == {}


@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_with_fsdp2_on_a_2d_mesh(world):
    rank, n = world
    dp = 2 if n == 4 else 1
    model, mesh = M.tp_fsdp_mlp(dp, n // dp)
    plain = M.make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    d = mesh["dp"].get_local_rank()
    for step in range(STEPS):
        x, y = M.batch("mlp", step, GB)
        opt.zero_grad()
        F.cross_entropy(model(M.local(x, d, dp)), M.local(y, d, dp)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        popt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        popt.step()
    M.assert_close(M.params_of(model), M.params_of(plain), what="tp+fsdp2")


# -- pipelining -----------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B"])
def test_pipeline_schedules_equal_single_process(world, schedule):
    from torch.distributed import pipelining as P

    rank, n = world
    per_rank = 2 if schedule == "Interleaved1F1B" else 1
    stages = n * per_rank
    plain = M.make_chain(stages)
    model = M.make_chain(stages)
    mine = [rank + k * n for k in range(per_rank)]  # interleaved: rank r holds r, r+n

    def loss_fn(out, target):
        return F.cross_entropy(out, target)

    pipe = [P.PipelineStage(model.stages[s], s, stages, torch.device("cpu")) for s in mine]
    micro = 2 * n
    if schedule == "Interleaved1F1B":
        sched = P.ScheduleInterleaved1F1B(pipe, n_microbatches=micro, loss_fn=loss_fn)
    else:
        cls = P.ScheduleGPipe if schedule == "GPipe" else P.Schedule1F1B
        sched = cls(pipe[0], n_microbatches=micro, loss_fn=loss_fn)
    params = [p for s in mine for p in model.stages[s].parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = M.batch("mlp", step, GB)
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x, target=y if n == 1 else None, losses=losses)
        elif rank == n - 1:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        popt.zero_grad()
        ref = torch.stack([loss_fn(plain(a), b) for a, b in
                           zip(x.chunk(micro), y.chunk(micro), strict=True)])
        ref.mean().backward()
        popt.step()
        if rank == n - 1:
            torch.testing.assert_close(torch.stack(losses), ref.detach(), rtol=1e-10, atol=0)
    ours = {f"stages.{s}.{k}": v for s in mine for k, v in
            M.params_of(model.stages[s]).items()}
    M.assert_close(ours, {k: v for k, v in M.params_of(plain).items() if k in ours},
                   what=schedule)
