"""``mpidist train`` under the fault-tolerance harness: the arguments are mpidist's.

Each rank emits an event ``step-S`` when it begins training step S (a context hook of the
call records), by which the harness can SIGKILL a rank from outside (``kill_on``); the
library's own kill points (``MPIDIST_FT_KILL``) kill a rank at a named phase.
"""

import ftprog  # noqa: I001 - first: output capture and pid

import sys

from mpidist.cli import main
from mpidist.core import calls

_SEEN: set[int] = set()


def _announce_step() -> None:
    step, _ = calls.step_phase()
    if step > 0 and step not in _SEEN:
        _SEEN.add(step)
        ftprog.event(f"step-{step}")


calls.add_context_hook(_announce_step)
sys.exit(main(sys.argv[1:]))
