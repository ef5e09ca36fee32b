"""Launching: abort-on-failure for MPI entry points, environment detection."""

from mpidist.run.launch.env import (
    RuntimeEnvironment,
    detect_environment,
    launcher_from_env,
    launcher_from_env_summary,
)
from mpidist.run.launch.guard import abort_on_failure

__all__ = [
    "RuntimeEnvironment",
    "abort_on_failure",
    "detect_environment",
    "launcher_from_env",
    "launcher_from_env_summary",
]
