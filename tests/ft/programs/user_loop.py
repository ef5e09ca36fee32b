"""A user's own loop around ``step()``, and ``optimize``, through a lost rank (the library,
not ``mpidist train``): ZeRO at the level given (argument 1) on a small GPT in float64.

The loop catches :class:`MeshChanged`, takes its model and redoes the batch (the
optimizer's sampler was rewound); then ``optimize`` runs more steps and recovers by itself.
Event ``losses``: every step's loss with the single-process reference's. With a directory
as argument 2, an asynchronous ``opt.save`` into it after step 1 (a test holds its writer)
is in flight at the failure: the event says whether it was abandoned or committed. With
``robin`` as argument 3, the mesh numbers the ranks as if they were dealt round-robin onto
two nodes (``mpirun --map-by node``): mesh rank order 0, 2, 1, 3.
"""

import ftprog  # noqa: I001 - first: output capture and pid

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "parallel"))

import numpy as np  # noqa: E402
from strategy_helpers import make_case, reference_run  # noqa: E402

from mpidist import ShardingConfiguration  # noqa: E402
from mpidist.core.comms import world  # noqa: E402
from mpidist.core.failure import leave_if_survived  # noqa: E402
from mpidist.core.mesh import ProcessMesh  # noqa: E402
from mpidist.data import GlobalBatchSampler  # noqa: E402
from mpidist.parallel import MeshChanged, ShardedOptimizer  # noqa: E402

LEVEL, LOOP, MORE, BATCH = int(sys.argv[1]), 4, 3, 12
SAVE_INTO = sys.argv[2] if len(sys.argv) > 2 else ""
ROBIN = len(sys.argv) > 3 and sys.argv[3] == "robin"

make_model, data, loss, make_opt = make_case("gpt")
if ROBIN:
    top = world()
    mesh = ProcessMesh(top, nodes=[r % 2 for r in range(top.Get_size())])
    opt = ShardedOptimizer(make_opt(), ShardingConfiguration(dtype="float64", mesh=mesh),
                           level=LEVEL, loss=loss, comm=top)
else:
    opt = ShardedOptimizer(make_opt(), ShardingConfiguration(dtype="float64"), level=LEVEL,
                           loss=loss)
model = opt.wrap(make_model(), seed=0)
opt.sampler = GlobalBatchSampler(len(data), BATCH, seed=0)
ftprog.event("recovery", status=opt.recovery_status(), order=list(model.mesh.order))
losses: dict[int, float] = {}
changes = []
handle = None
while opt.step_count < LOOP:
    step = opt.step_count + 1
    x, y = data.batch(opt.sampler.next_local(model.dp_rank, model.dp_size))
    try:
        losses[step] = opt.step(model, (x, y))
        if SAVE_INTO and step == 1:
            handle = opt.save(os.path.join(SAVE_INTO, "ckpt-1.h5"), async_=True)
    except MeshChanged as changed:
        model = changed.model  # the mesh changed: redo the batch on the survivors
        changes.append({"step": changed.step, "dead": changed.dead,
                        "size": changed.world_size})
result = opt.optimize(opt.model, data, MORE, global_batch_size=BATCH)
for i, value in enumerate(result.losses):
    losses[LOOP + 1 + i] = value
ref, _ = reference_run("gpt", LOOP + MORE, BATCH, "float64")
got = [losses.get(s, float("nan")) for s in range(1, LOOP + MORE + 1)]
ftprog.event("losses", got=got, ref=ref.tolist(), changes=changes,
             size=opt.model.dp_size, maxdiff=float(np.max(np.abs(np.array(got) - ref))),
             save=None if handle is None else {"abandoned": handle.abandoned,
                                               "committed": handle.committed})
leave_if_survived(0)
