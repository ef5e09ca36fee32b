"""torch's distributed conformance suite, loaded for a backend and run one test at a time.

torch ships its distributed test suite in the wheel
(``torch/testing/_internal/distributed/distributed_test.py``, class
``DistributedTest._DistTestBase``). torch's own runner combines it with ``TestDistBackend``,
whose ``setUp`` spawns one process per rank; each child then builds the test case, sets its
``rank`` and ``file_name``, initialises the process group with ``init_method=file://...``,
meets the others at a file barrier, runs the test method, meets them again and destroys the
group. Here every MPI rank is one of those children: :func:`run_test` does what a child does.

The suite decides much of what runs when it is imported, from the names it knows (``gloo``,
``nccl``, ``ucc``, ``mpi``), and quietly skips tests for names it does not know. So that a
new backend is held to everything gloo is held to on a CPU, :func:`load_suite` applies the
patches listed in :data:`PATCHES`; each entry says what it changes and why it is fair.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import sys
import time
import traceback
import types
import unittest
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"
SUITE_FILE = "distributed_test.py"
REFERENCE = "gloo"

#: What :func:`load_suite` changes in the suite, and why each change is fair.
PATCHES: dict[str, str] = {
    "import-as-gloo": (
        "The suite is imported with BACKEND=gloo, so every decision it takes at import time "
        "(skip decorators such as 'Only gloo backend supports timeouts', the "
        "DistTestCases.backend_feature sets for gpu/ddp/subgroup, require_backend_is_available, "
        "require_n_gpus_for_nccl_backend, nccl_skip_if_lt_x_gpu) is exactly the one it takes "
        "for gloo. Fair: the reference is what torch itself runs for gloo; the target is held "
        "to the same list of tests, no more and no fewer."
    ),
    "runtime-name": (
        "After the import, the module global BACKEND and the BACKEND environment variable hold "
        "the target's name: init_process_group, new_group(backend=...), the name checks of "
        "test_get_backend and test_Backend_enum_class and the run-time skip helpers of "
        "common_distributed (which only compare with 'mpi' and 'nccl') all see the real name."
    ),
    "gloo-branches": (
        "The run-time BACKEND is a str equal to both the target's name and 'gloo', so a test "
        "body that branches on BACKEND == 'gloo' takes gloo's branch (in torch 2.13 one site: "
        "_test_accumulate_gradients_no_sync builds its CPU model only for 'mpi' or 'gloo', and "
        "would otherwise end in UnboundLocalError). Fair: that branch is the CPU code path, "
        "not a gloo-specific expectation; f-strings and .lower() still give the real name."
    ),
    "profiling-lists": (
        "Only with the driver's --profiling (off by default): the target is added to "
        "PROFILING_SUPPORTED_BACKENDS, CUDA_PROFILING_SUPPORTED_BACKENDS and "
        "SEND_RECV_PROFILING_SUPPORTED_BACKENDS, which test bodies read at run time to decide "
        "whether to assert that torch's profiler recorded one async '<backend>:<op>' event "
        "per collective, with its input shapes. gloo is in these lists, so gloo is held to "
        "these assertions and, without the switch, the target is not: that is the one known "
        "gap between the two. It is off by default because the check comes before the "
        "result check in call_dist_op, so a backend without profiler events would fail "
        "almost every collective test for that one reason and hide everything else."
    ),
    "file-init": (
        "INIT_METHOD is a file:// URL (torch's CI runs gloo with both file:// and env://); "
        "file:// enables test_barrier_timeout_global and the save/reload step of the DDP "
        "tests, which env:// skips. Each test gets a fresh file."
    ),
    "cpu-only": (
        "CUDA_VISIBLE_DEVICES is emptied by the driver so that the reference is gloo on the "
        "CPU on every machine: GPU tests skip with 'CUDA is not available.' for every backend."
    ),
    "extended": (
        "Only with the driver's --extended (on by default for a target other than gloo; "
        "--no-extended turns it off, and gloo can be run with it to give the reference). "
        "(a) mpi-gated: the tests that the suite runs for its own 'mpi' backend on the CPU "
        "and skips for gloo at import time (in torch 2.13 the 12 all_to_all and "
        "all_to_all_single tests, 'Only MPI supports ...'; the driver finds them by importing "
        "the suite as 'mpi' and comparing) run too: the test bodies are the same. "
        "(b) small-world: at 3 or more ranks, the run-time skip_if_small_worldsize (which "
        "skips unless BACKEND is 'mpi' or WORLD_SIZE >= 8; the group tests on ranks [1, 2] "
        "and a few others) is lifted, by setting the BACKEND environment variable to 'mpi' "
        "while the test runs; in torch 2.13 that variable is read at run time only by that "
        "helper, by skip_if_odd_worldsize and by comparisons with 'nccl'. Extra coverage of "
        "all_to_all and of subgroup collectives; gloo itself does not run these by default."
    ),
}

#: Categories of the default selection, as regular expressions on test names (searched,
#: case-insensitive). A test belongs to the first category that matches.
CATEGORIES: dict[str, str] = {
    "p2p": r"send|recv",
    "collective": (
        r"all_reduce|allreduce|all_gather|allgather|reduce_scatter|reduce|broadcast|gather"
        r"|scatter|all_to_all|barrier|coalesc|_object"
    ),
    "group": r"group",
    "ddp": (
        r"ddp|distributeddataparallel|syncbatchnorm|sync_bn|static_graph|accumulate_gradients"
        r"|no_sync|bucket|across_rank|unused|get_future|data_parallel|output_unused"
    ),
    "algorithms": r"model_averager|average_parameters|localsgd",
    "basic": r".",
}
DEFAULT_CATEGORIES = ("p2p", "collective", "group", "ddp")


def category(name: str) -> str:
    """The first category of :data:`CATEGORIES` whose pattern the test name matches."""
    for cat, pattern in CATEGORIES.items():
        if re.search(pattern, name, flags=re.IGNORECASE):
            return cat
    return "basic"


class _TargetName(str):
    """The target backend's name, which also compares equal to ``"gloo"`` (see PATCHES)."""

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other) is True or other == REFERENCE

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__


@dataclass
class Outcome:
    """One rank's outcome of one test."""

    test: str
    rank: int
    outcome: str  # passed | failed | errored | skipped | hung
    reason: str = ""  # skip reason or first error line
    where: str = ""  # innermost suite line of the traceback
    raised_at: str = ""  # innermost line of the traceback (often in the backend)
    phase: str = "test"  # init | test | teardown
    seconds: float = 0.0
    detail: str = ""  # the traceback's last lines
    failed_at: float = 0.0  # time.time() when the exception was caught
    notes: list[str] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """The JSON-ready form written to the results file."""
        return {"kind": "result", **asdict(self)}


def prepare_environment(world_size: int, init_file: str, as_backend: str = REFERENCE) -> None:
    """Set the variables the suite reads when it is imported (BACKEND, WORLD_SIZE, ...)."""
    os.environ["BACKEND"] = as_backend
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["INIT_METHOD"] = "file://" + init_file
    os.environ.setdefault("TEMP_DIR", os.path.dirname(init_file))
    os.environ.setdefault("MASTER_ADDR", "localhost")  # what TestDistBackend.setUpClass sets


def suite_class(module: types.ModuleType) -> type:
    """``TestDistBackend`` combined with ``DistributedTest._DistTestBase``, as torch's
    spawning runner combines them, minus the spawning ``setUp``."""

    class ConformanceCase(module.TestDistBackend, module.DistributedTest._DistTestBase):
        """One test of the suite, run inside an already started rank."""

    return ConformanceCase


def import_suite(world_size: int, init_file: str, as_backend: str = REFERENCE) -> types.ModuleType:
    """Import the suite as ``as_backend`` would see it (import-time decisions only)."""
    prepare_environment(world_size, init_file, as_backend)
    return importlib.import_module(SUITE_MODULE)


def load_suite(target: str, world_size: int, init_file: str,
               profiling: bool = False) -> tuple[types.ModuleType, type]:
    """Import the suite as gloo, then patch it for ``target`` (see :data:`PATCHES`)."""
    module = import_suite(world_size, init_file, REFERENCE)
    if target != REFERENCE:
        module.BACKEND = _TargetName(target)
        os.environ["BACKEND"] = target
    if profiling:
        for name in ("PROFILING_SUPPORTED_BACKENDS", "CUDA_PROFILING_SUPPORTED_BACKENDS",
                     "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"):
            backends = getattr(module, name, None)
            if isinstance(backends, list) and target not in backends:
                backends.append(target)
    return module, suite_class(module)


def static_skip(cls: type, name: str) -> str | None:
    """The reason a decorator gave for skipping the test at import time, or None."""
    method = getattr(cls, name)
    if getattr(method, "__unittest_skip__", False):
        return str(getattr(method, "__unittest_skip_why__", "skipped"))
    return None


def list_tests(cls: type) -> list[dict[str, Any]]:
    """Every test of the suite with its category and its import-time skip reason."""
    names = unittest.TestLoader().getTestCaseNames(cls)
    return [{"test": n, "category": category(n), "static_skip": static_skip(cls, n)}
            for n in names]


def gloo_branches(module: types.ModuleType) -> list[str]:
    """Where a test body compares BACKEND with "gloo" at run time: the places that the
    gloo-branches patch sends the target down gloo's branch (listed in the report, so that
    a new torch version's new sites are seen)."""
    source = inspect.getsource(module)
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in (n for stmt in fn.body for n in ast.walk(stmt)):
            if not isinstance(node, ast.Compare):
                continue
            parts = [node.left, *node.comparators]
            names = {p.id for p in parts if isinstance(p, ast.Name)}
            consts = {p.value for p in parts if isinstance(p, ast.Constant)}
            if "BACKEND" in names and REFERENCE in consts:
                found.append(f"{SUITE_FILE}:{node.lineno} in {fn.name}")
    return sorted(set(found), key=lambda s: int(s.split(":")[1].split()[0]))


def _first_line(exc: BaseException) -> str:
    """The exception's type and first line; for an assertion, its first two lines (torch's
    assertEqual says "Scalars are not equal!" first and the values next)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines[:2] if isinstance(exc, AssertionError) else lines[:1])
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _line(frame: traceback.FrameSummary, short: bool = False) -> str:
    """``file:line in function: code``; the path from site-packages or from the package
    ``mpidist``, or (``short``) the file name alone."""
    path = frame.filename.replace(os.sep, "/")
    if short:
        path = path.rsplit("/", 1)[-1]
    elif "/site-packages/" in path:
        path = path.split("/site-packages/", 1)[1]
    elif "/mpidist/" in path:
        path = "mpidist/" + path.split("/mpidist/", 1)[1]
    return f"{path}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def locate(frames: list[traceback.FrameSummary]) -> tuple[str, str]:
    """The innermost line of the suite among ``frames``, and the innermost line of all."""
    if not frames:
        return "", ""
    inside = [f for f in frames if f.filename.endswith(SUITE_FILE)]
    return (_line(inside[-1], short=True) if inside else ""), _line(frames[-1])


def _exit_outcome(code: object, skips: dict[int, str]) -> tuple[str, str]:
    """The outcome of ``sys.exit(code)`` inside a test, as torch's parent process reads it."""
    if code in (0, None):
        return "passed", "the test called sys.exit(0)"
    if isinstance(code, int) and code in skips:
        return "skipped", skips[code]
    return "errored", f"the test called sys.exit({code!r})"


def _exception_outcome(out: Outcome, exc: BaseException, skips: dict[int, str]) -> None:
    out.failed_at = round(time.time(), 3)
    if isinstance(exc, unittest.SkipTest):
        out.outcome, out.reason = "skipped", str(exc)
        return
    if isinstance(exc, SystemExit):
        out.outcome, out.reason = _exit_outcome(exc.code, skips)
        return
    out.outcome = "failed" if isinstance(exc, AssertionError) else "errored"
    out.reason = _first_line(exc)
    out.where, out.raised_at = locate(traceback.extract_tb(exc.__traceback__))
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    out.detail = "".join(lines)[-6000:]


def _init_group(module: types.ModuleType, case: Any, name: str, target: str, rank: int) -> None:
    """What ``TestDistBackend._run`` does before the test: init, then the file barrier."""
    import torch.distributed as dist

    seconds = module.CUSTOM_PG_TIMEOUT.get(name, module.default_pg_timeout)
    dist.init_process_group(
        init_method=case.init_method,
        backend=target,
        world_size=int(case.world_size),
        rank=rank,
        timeout=timedelta(seconds=seconds),
    )
    case._barrier()


def _teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_test(module: types.ModuleType, cls: type, name: str, target: str, rank: int,
             file_name: str, unskip: bool = False, small_world: bool = False) -> Outcome:
    """Run one test in this rank as torch's spawned child would, and say how it went.

    The process group is initialised and destroyed around the test; the environment and
    torch's default dtype are restored afterwards so that one test does not leak into the
    next. ``unskip`` ignores an import-time skip, ``small_world`` lifts the run-time
    skip_if_small_worldsize (the driver's --extended; see PATCHES).
    """
    import torch
    from torch.testing._internal import common_distributed, common_utils

    out = Outcome(test=name, rank=rank, outcome="passed")
    reason = static_skip(cls, name)
    if reason is not None and not unskip:
        out.outcome, out.reason = "skipped", reason
        return out
    if reason is not None:
        out.notes.append(f"extended (mpi-gated): import-time skip ignored: {reason}")
    skips = {s.exit_code: s.message for s in common_distributed.TEST_SKIPS.values()}
    environ = dict(os.environ)
    dtype = torch.get_default_dtype()
    start = time.monotonic()
    case = cls(name)
    case.rank = rank
    case.file_name = file_name
    module.Barrier.barrier_id = 0
    try:
        out.phase = "init"
        _init_group(module, case, name, target, rank)
        out.phase = "test"
        os.environ["TORCH_SHOW_CPP_STACKTRACES"] = "1"
        if small_world:
            os.environ["BACKEND"] = "mpi"  # what skip_if_small_worldsize compares with
        common_utils.set_rng_seed()
        getattr(case, name)()
        out.phase = "teardown"
        case._barrier()
        out.phase = "test"
    except BaseException as exc:  # noqa: B036 - SystemExit is how the suite skips
        if isinstance(exc, KeyboardInterrupt):
            raise
        _exception_outcome(out, exc, skips)
    finally:
        try:
            _teardown()
        except Exception as exc:  # a teardown error fails a test that passed
            if out.outcome in ("passed", "skipped"):
                out.phase = "teardown"
                _exception_outcome(out, exc, skips)
        os.environ.clear()
        os.environ.update(environ)
        torch.set_default_dtype(dtype)
        out.seconds = round(time.monotonic() - start, 3)
        sys.stdout.flush()
        sys.stderr.flush()
    return out
