"""The flight recorder: every rank's last MPI calls, and the watchdog that dumps them.

Every rank of a job started through mpidist's entry points (``mpidist train``, the
library's meshes and so its optimizers, the torch backend's default group) keeps the last
K calls it made to MPI (``MPIDIST_RECORDER_SIZE``, default :data:`DEFAULT_SIZE`; 0 keeps
none): the :class:`~mpidist.core.calls.Call` objects themselves, appended to a ring by the
hooks' ``enter`` (one C-level ``deque.append`` per call; the call's exit time is filled in
place when it completes), made into JSON only when dumped.

A watchdog thread (a Python signal handler does not run while the main thread is blocked
in MPI) writes the ring, the registry's communicators (identity, label, members as world
ranks, collective calls so far) and every thread's stack into
``<dir>/rank-<world rank>.json`` and ``rank-<world rank>.stacks.txt``:

- when a thread of this rank has been inside one MPI call for longer than the hang
  timeout (``mpidist train --hang-timeout``, ``MPIDIST_HANG_TIMEOUT``; default
  :data:`DEFAULT_TIMEOUT` seconds; 0: never);
- when this rank has made no progress at all for that long: no MPI call completed and no
  step began (a rank stuck outside MPI, or polling a request, has nothing it is blocked in);
- on SIGUSR2 (Python's C-level handler wakes the thread through a socket at once, even
  while the main thread is blocked in MPI);
- when the job is aborted (:mod:`mpidist.run.launch.guard`, which the torch backend's own
  watchdog calls too).

``<dir>`` is ``<out>/hang`` for ``mpidist train``, else ``MPIDIST_HANG_DIR`` or
``./mpidist-hang``. The watchdog only reports: the job goes on (hanging) unless
``--hang-abort`` / ``MPIDIST_HANG_ABORT=1`` asks it to end the job with ``MPI_Abort``
(after a grace period in which the other ranks dump too). Each dump names its host, process
id and world rank, and every rank's host and process id learnt when the job started
(:func:`introduce`), so that ``mpidist doctor`` can merge the dumps of all ranks and name
a rank that could not dump (a stopped process). The watchdog's timeout checks run only in
jobs of more than one rank.

``MPIDIST_TEST_HOLD="rank=R,step=S,phase=P[,seconds=T]"`` (step, phase and seconds
optional) makes world rank R sleep T seconds (default an hour) when it enters phase P of
step S: a rank held before a collective, for tests of all this.
"""

from __future__ import annotations

import collections
import faulthandler
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
import zlib
from typing import Any

from mpidist.core import calls, comms, failure
from mpidist.core.specs import key_values

__all__ = ["DEFAULT_SIZE", "DEFAULT_TIMEOUT", "FORMAT", "cap_timeout", "dump", "hold_spec",
           "hook", "install", "installed", "introduce", "recent", "settings", "snapshot",
           "step_done"]

#: calls kept per rank unless ``MPIDIST_RECORDER_SIZE`` says otherwise
DEFAULT_SIZE = 4096
#: seconds inside one MPI call (or without progress) before the watchdog dumps
DEFAULT_TIMEOUT = 300.0
#: the ``format`` field of every dump
FORMAT = "mpidist-flight-recorder/1"

_RECORD = 256  # bytes per rank of the host/pid table's allgather
_KNOWN_MAX = 4096  # communicators remembered after they were freed


class _State:
    """This process's recorder: the ring, the settings, who is who."""

    def __init__(self) -> None:
        self.ring: collections.deque | None = None
        self.hook: _Ring | None = None
        self.directory = ""
        self.timeout = DEFAULT_TIMEOUT
        self.abort = False
        self.world_rank, self.world_size = 0, 1
        self.name = "rank-0"
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.ranks: dict[int, str] = {}
        self.introduced: set[str] = set()
        self.job = ""
        self.steps_done = -1
        self.known: dict[str, Any] = {}  # communicator id -> CommInfo, also once freed
        self.lock = threading.Lock()
        self.watchdog: _Watchdog | None = None


_R = _State()
_KNOWN_LOCK = threading.Lock()


class _Ring:
    """The hook: ``enter`` is the ring's own ``append`` (no Python frame per call)."""

    def __init__(self, ring: collections.deque) -> None:
        self.enter = ring.append


# -- settings ------------------------------------------------------------------------------
def _env_number(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None
    if value < 0:
        raise ValueError(f"{name}={text!r} must be >= 0")
    return value


def installed() -> bool:
    """Whether this process keeps a flight recorder. Not collective."""
    return _R.watchdog is not None


def settings() -> dict[str, Any]:
    """The settings :func:`install` takes, as they are now: directory, timeout, abort."""
    return {"directory": _R.directory, "timeout": _R.timeout, "abort": _R.abort}


def install(*, directory: str | None = None, timeout: float | None = None,
            abort: bool | None = None) -> dict[str, Any]:
    """Keep the flight recorder and its watchdog on this rank from now on, and set what is
    given (None: unchanged; at the first call, from the environment: ``MPIDIST_HANG_DIR``,
    ``MPIDIST_HANG_TIMEOUT``, ``MPIDIST_HANG_ABORT``). Returns the settings before this
    call (to put back with ``install(**previous)``).

    Not collective; idempotent: the ring and the thread are made once per process. A bad
    environment value raises ValueError naming it (alike on every rank).
    """
    if timeout is not None and timeout < 0:
        raise ValueError(f"hang_timeout={timeout!r} must be >= 0 (0: no timeout)")
    previous = settings()
    if _R.watchdog is None:
        _start()
    if directory is not None:
        _R.directory = os.path.abspath(directory)
    if timeout is not None:
        _R.timeout = float(timeout)
    if abort is not None:
        _R.abort = bool(abort)
    return previous


def _start() -> None:
    size = int(_env_number("MPIDIST_RECORDER_SIZE", DEFAULT_SIZE))
    _R.timeout = _env_number("MPIDIST_HANG_TIMEOUT", DEFAULT_TIMEOUT)
    _R.abort = os.environ.get("MPIDIST_HANG_ABORT", "").strip() not in ("", "0")
    _R.directory = os.path.abspath(os.environ.get("MPIDIST_HANG_DIR") or "mpidist-hang")
    MPI = comms.mpi()
    world = MPI.COMM_WORLD
    _R.world_rank, _R.world_size = world.Get_rank(), world.Get_size()
    spawned = MPI.Comm.Get_parent() != MPI.COMM_NULL  # another world: not rank-N
    _R.name = f"spawned-{_R.pid}" if spawned else f"rank-{_R.world_rank}"
    _R.ranks.setdefault(_R.world_rank, f"{_R.host}:{_R.pid}")
    _R.job = (os.environ.get("PMIX_NAMESPACE") or os.environ.get("OMPI_MCA_ess_base_jobid")
              or os.environ.get("SLURM_JOB_ID", ""))
    _hold_from_env(_R.world_rank)
    if size > 0:
        _R.ring = collections.deque(maxlen=size)
        _R.hook = _Ring(_R.ring)
        calls.add_hook(_R.hook)
    _R.watchdog = _Watchdog()
    _R.watchdog.install_signal()
    _R.watchdog.start()


def cap_timeout(seconds: float) -> None:
    """Lower the hang timeout to ``seconds`` if it is longer (or off), so that this
    watchdog dumps before another one (torch's group timeout) ends the job. Not
    collective."""
    if seconds > 0 and (_R.timeout <= 0 or _R.timeout > seconds):
        _R.timeout = float(seconds)


def step_done(step: int) -> None:
    """Training step ``step`` completed on this rank (dumps report it). Not collective."""
    _R.steps_done = int(step)


def hook() -> Any:
    """The recorder's hook object (for ``comms.remove_hook``/``add_hook``: the benchmark
    times calls with and without it); None when no ring is kept. Not collective."""
    return _R.hook


def recent() -> list[calls.Call]:
    """The calls in the ring now, oldest first (a copy). Not collective."""
    return list(_R.ring) if _R.ring is not None else []


# -- who is who ----------------------------------------------------------------------------
def introduce(comm: Any) -> None:
    """Learn every rank's host and process id over ``comm`` (so that a dump names a rank
    that could not dump, e.g. a stopped process). Collective over ``comm``, once per
    communicator identity: every member has introduced it before or none has, so later
    calls return at once on all of them. None or a single rank: nothing to learn."""
    import numpy as np

    comm = comms.traced(comm)
    cid = comms.comm_id(comm)
    if comm is None or not cid or cid in _R.introduced or comm.Get_size() == 1:
        return
    _R.introduced.add(cid)
    mine = json.dumps([_R.world_rank, _R.host[:200], _R.pid]).encode()[:_RECORD]
    send = np.zeros(_RECORD, dtype=np.uint8)
    send[:len(mine)] = np.frombuffer(mine, dtype=np.uint8)
    table = np.zeros((comm.Get_size(), _RECORD), dtype=np.uint8)
    comm.Allgather(send, table)
    for row in table:
        rank, host, pid = json.loads(row.tobytes().rstrip(b"\0").decode())
        if rank >= 0:
            _R.ranks[int(rank)] = f"{host}:{pid}"
    if cid == "world":  # the same table on every rank: the job's key in the dumps
        text = json.dumps(sorted(_R.ranks.items())).encode()
        _R.job = f"{zlib.crc32(text):08x}"


# -- the dump --------------------------------------------------------------------------------
def _call_dict(c: calls.Call, offset: float) -> dict[str, Any]:
    d = c.as_dict()
    d["t_enter"] = round(c.t_enter + offset, 6)  # wall-clock seconds: comparable across ranks
    d["t_exit"] = None if c.t_exit is None else round(c.t_exit + offset, 6)
    return d


def _remember() -> None:
    """Keep the registry's records of the communicators alive now (the watchdog does at
    every tick), so that a dump still places calls on one freed since."""
    infos = [comms.info(c) for c in comms.live()]
    with _KNOWN_LOCK:
        for st in infos:
            if st is not None:
                _R.known[st.id] = st
        while len(_R.known) > _KNOWN_MAX:
            del _R.known[next(iter(_R.known))]


def _communicators() -> list[dict[str, Any]]:
    _remember()
    with _KNOWN_LOCK:
        known = list(_R.known.values())
    return [st.as_dict() for st in known]


def _stacks(names: dict[int, str]) -> list[dict[str, Any]]:
    out = []
    for tid, frame in sys._current_frames().items():
        frames = traceback.extract_stack(frame)[-30:]
        out.append({"thread": tid, "name": names.get(tid, "?"),
                    "frames": [[f.filename, f.lineno, f.name, f.line or ""] for f in frames]})
    return out


def snapshot(reason: str) -> dict[str, Any]:
    """What a dump holds (JSON-serialisable); see the module docstring. Not collective."""
    now, wall = time.monotonic(), time.time()
    offset = wall - now
    ring = recent()
    names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
    step, phase = calls.step_phase()
    inside = [{"thread": tid, "thread_name": names.get(tid, "?"),
               "waiting_s": round(now - c.t_enter, 3), "call": _call_dict(c, offset)}
              for tid, c in calls.inside().items()]
    return {
        "format": FORMAT, "job": _R.job, "reason": reason, "time": wall,
        "host": _R.host, "pid": _R.pid, "world_rank": _R.world_rank,
        "world_size": _R.world_size, "hang_timeout": _R.timeout,
        # (a loop that only marks each step's start, as a torch script may, has done the
        # steps before it)
        "step": step, "phase": phase,
        "steps_done": _R.steps_done if _R.steps_done >= 0 else max(step - 1, -1),
        "last_progress_s": round(now - calls.last_progress(), 3),
        "ranks": {str(r): hp for r, hp in sorted(_R.ranks.items())},
        "communicators": _communicators(),
        "inside": inside,
        "recorder_size": _R.ring.maxlen if _R.ring is not None else 0,
        "calls": [_call_dict(c, offset) for c in ring],
        "stacks": _stacks(names),
    }


def _text(snap: dict[str, Any]) -> str:
    """JSON with one line per field and per call (readable with less and grep)."""
    lines = []
    for key, value in snap.items():
        if key == "calls" and value:
            body = ",\n".join(json.dumps(c) for c in value)
            lines.append(f'"calls": [\n{body}\n]')
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def dump(reason: str) -> str | None:
    """Write this rank's dump now, from any thread: ``<dir>/rank-<r>.json`` (replaced
    whole) and ``rank-<r>.stacks.txt`` (``faulthandler``'s stacks of every thread).
    Returns the JSON file's path; None when no recorder is installed or the dump cannot
    be written (a line on stderr says why). Not collective."""
    if _R.watchdog is None:
        return None
    with _R.lock:
        base = os.path.join(_R.directory, _R.name)
        try:
            os.makedirs(_R.directory, exist_ok=True)
            with open(base + ".stacks.txt", "w") as f:
                f.write(f"# {_R.host} pid {_R.pid} world rank {_R.world_rank}: {reason}\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            text = _text(snapshot(reason))
            with open(base + ".json.tmp", "w") as f:
                f.write(text)
            os.replace(base + ".json.tmp", base + ".json")
        except Exception as exc:  # noqa: BLE001 - a dump must never add a failure of its own
            _say(f"cannot write the flight recorder's dump into {_R.directory}: "
                 f"{type(exc).__name__}: {exc}")
            return None
    _say(f"{reason}; flight recorder dumped into {base}.json (merge all ranks' dumps: "
         f"mpidist doctor {_R.directory})")
    return base + ".json"


def _say(text: str) -> None:
    try:
        stream = sys.__stderr__ or sys.stderr
        stream.write(f"[rank {_R.world_rank}] mpidist: {text}\n")
        stream.flush()
    except (OSError, ValueError):
        pass


# -- the watchdog ----------------------------------------------------------------------------
class _Watchdog(threading.Thread):
    """Dumps on a hang, on no progress and on SIGUSR2 (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(name="mpidist-recorder", daemon=True)
        self.wake: socket.socket | None = None
        self._keep: socket.socket | None = None  # the write end, which signals write to
        self.handled = self.woken = self.dumped = 0  # SIGUSR2s seen by each path
        self.reported_call: calls.Call | None = None
        self.reported_progress = -1.0

    def install_signal(self) -> None:
        """SIGUSR2 wakes this thread: through Python's wakeup fd at once (a C-level
        write, even while the main thread is blocked in MPI); else (an event loop owns
        the wakeup fd) when the main thread next runs Python."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGUSR2)

        def handler(signum: int, frame: Any) -> None:
            self.handled += 1
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGUSR2, handler)
        rd, wr = socket.socketpair()
        rd.setblocking(False)
        wr.setblocking(False)
        try:
            old = signal.set_wakeup_fd(wr.fileno(), warn_on_full_buffer=False)
        except ValueError:
            old = -2
        if old != -1:  # keep whoever had it
            if old >= 0:
                signal.set_wakeup_fd(old)
            rd.close()
            wr.close()
            return
        self.wake = rd
        self._keep = wr

    def run(self) -> None:
        while True:
            t = _R.timeout
            tick = min(1.0, max(0.05, t / 4)) if t > 0 else 1.0
            try:
                if self._wait(tick):
                    dump("SIGUSR2")
                _remember()
                if t > 0 and _R.world_size > 1:
                    self._check(t)
            except Exception as exc:  # noqa: BLE001 - the watchdog must outlive its bugs
                _say(f"flight recorder's watchdog: {type(exc).__name__}: {exc}")
                time.sleep(tick)

    def _wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True when a SIGUSR2 not yet dumped arrived."""
        if self.wake is not None:
            ready, _, _ = select.select([self.wake], [], [], seconds)
            if ready:
                try:
                    data = self.wake.recv(4096)
                except OSError:
                    data = b""
                self.woken += data.count(bytes([int(signal.SIGUSR2)]))
        else:
            time.sleep(seconds)
        seen = max(self.woken, self.handled)
        if seen > self.dumped:
            self.dumped = seen
            return True
        return False

    def _check(self, timeout: float) -> None:
        now = time.monotonic()
        inside = calls.inside()
        stuck = [(now - c.t_enter, c) for c in inside.values() if now - c.t_enter > timeout]
        if stuck:
            age, c = max(stuck, key=lambda x: x[0])
            if c is self.reported_call:
                return
            self.reported_call = c
            reason = (f"hang: inside {c.op} on {c.comm} #{c.seq} for {age:.0f} s (step "
                      f"{c.step}, phase {c.phase or '-'})")
        elif not inside and now - calls.last_progress() > timeout:
            last = calls.last_progress()
            if last == self.reported_progress:
                return
            self.reported_progress = last
            step, phase = calls.step_phase()
            reason = (f"hang: no progress for {now - last:.0f} s (step {step}, phase "
                      f"{phase or '-'}, outside MPI or polling a request)")
        else:
            return
        dump(reason)
        if _R.abort:
            grace = max(5.0, timeout / 2)
            _say(f"hang_abort: ending the job in {grace:.0f} s (MPI_Abort), once the other "
                 "ranks have dumped too")
            time.sleep(grace)
            failure.abort(comms.mpi().COMM_WORLD, 1)  # (under ULFM: this rank leaves)


# -- the test hold -------------------------------------------------------------------------------
def hold_spec(spec: str) -> dict[str, Any]:
    """``MPIDIST_TEST_HOLD``'s text as ``{"rank", "step", "phase", "seconds"}`` (step and
    phase None when not given: any). ValueError naming the text when it is malformed."""
    try:
        want = key_values(spec, ("rank", "step", "phase", "seconds"))
    except ValueError:
        raise ValueError(f"MPIDIST_TEST_HOLD={spec!r}: expected rank=R[,step=S]"
                         "[,phase=P][,seconds=T]") from None
    try:
        return {"rank": int(want["rank"]),
                "step": int(want["step"]) if "step" in want else None,
                "phase": want.get("phase"), "seconds": float(want.get("seconds", 3600))}
    except (KeyError, ValueError):
        raise ValueError(f"MPIDIST_TEST_HOLD={spec!r}: rank and step must be integers, "
                         "seconds a number") from None


def _hold_from_env(world_rank: int) -> None:
    """``MPIDIST_TEST_HOLD`` (see the module docstring): hold this rank if it is named."""
    spec = os.environ.get("MPIDIST_TEST_HOLD", "").strip()
    if not spec:
        return
    want = hold_spec(spec)
    if want["rank"] != world_rank:
        return
    fired = []

    def hold() -> None:
        now_step, now_phase = calls.step_phase()
        if fired or (want["step"] is not None and now_step != want["step"]) \
                or (want["phase"] is not None and now_phase != want["phase"]):
            return
        fired.append(True)
        _say(f"MPIDIST_TEST_HOLD: holding at step {now_step}, phase {now_phase or '-'} "
             f"for {want['seconds']:g} s")
        time.sleep(want["seconds"])

    calls.add_context_hook(hold)
