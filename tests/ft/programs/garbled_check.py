"""``mpidist train`` (the arguments are mpidist's) with world rank 1's batch check fed
garbage at one step, as ULFM can leave it: a collective that returns *success* on a
survivor although a member died in it, the dead member's slots unwritten (seen across
nodes: the batch check's Allreduce table kept ``INT64_MIN`` in a slot, and the job
aborted with "a local batch of -9223372036854775808 samples").

``GARBLED_STEP=S``: at step S rank 1 waits ``GARBLED_WAIT`` seconds (default 1; the rank
the kill points name dies meanwhile), then checks a table whose slot 0 is ``INT64_MIN``.
The check fails with a ValueError; the library must see the lost rank behind it and
recover, or, where no rank was lost, end the job with the ValueError's line.
"""

import ftprog  # noqa: I001 - first: output capture and pid

import os
import sys
import time

import numpy as np

from mpidist.cli import main
from mpidist.core import calls
from mpidist.core.comms import world
from mpidist.parallel import engine

STEP = int(os.environ["GARBLED_STEP"])
WAIT = float(os.environ.get("GARBLED_WAIT", "1"))
_real = engine.check_local_sizes
_done: list[int] = []


def _garbled(sizes, m):
    step, _ = calls.step_phase()
    if world().Get_rank() == 1 and step == STEP and not _done:
        _done.append(step)
        ftprog.event("garbled", step=step)
        time.sleep(WAIT)
        sizes = np.array(sizes, dtype=np.int64)
        sizes[0] = np.iinfo(np.int64).min
    return _real(sizes, m)


engine.check_local_sizes = _garbled
sys.exit(main(sys.argv[1:]))
