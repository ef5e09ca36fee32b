"""mpidist: MPI-native distributed training.

The public API is re-exported here; see the submodules for the details.
"""

__version__ = "0.1.0"

from mpidist import collectives  # noqa: E402
from mpidist.buffers import Bucket, FlatBuffer  # noqa: E402
from mpidist.launch import abort_on_failure, detect_environment  # noqa: E402
from mpidist.mesh import ProcessMesh, layout  # noqa: E402

__all__ = [
    "Bucket",
    "FlatBuffer",
    "ProcessMesh",
    "__version__",
    "abort_on_failure",
    "collectives",
    "detect_environment",
    "layout",
]
