"""``mpidist doctor RUN``: what a hung job waits for, from its ranks' flight-recorder dumps.

Every rank's flight recorder (:mod:`mpidist.core.recorder`) dumps into ``RUN/hang`` (the
``--out`` of ``mpidist train``) or the directory ``MPIDIST_HANG_DIR`` names when it hangs,
on SIGUSR2 and when the job is aborted. The doctor reads whatever dumps exist (the newest
job's, each rank's latest) and prints, in a few lines:

- the first collective that not every rank of its communicator entered: on a communicator
  where some rank waits (a call in flight for at least ``--min-wait`` seconds), the lowest
  sequence number that some member has not reached (each dump holds, per communicator,
  how many collective calls its rank entered);
- which ranks entered it and which did not, as world ranks with host:pid; of those that
  did not, the stack of each one that dumped, or that it left no dump (a stopped or dead
  process cannot write one);
- ranks that aborted the job, and the last step every rank completed.

Exit status: 0 nothing wrong (no rank waits, none aborted: e.g. a healthy run dumped with
SIGUSR2), 1 a culprit named, 2 bad input (no dumps). Runs without MPI.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

__all__ = ["add_parser", "diagnose", "load_dumps", "render"]

FORMAT = "mpidist-flight-recorder/1"  # (mpidist.core.recorder.FORMAT, without importing MPI)
_MIN_WAIT = 10.0


def add_parser(sub: Any) -> None:
    """Register ``mpidist doctor``."""
    p = sub.add_parser("doctor", help="what a hung job waits for: merge its ranks' "
                       "flight-recorder dumps and name the rank the others wait for",
                       description="Merge the flight-recorder dumps of a hung job's "
                       "ranks (RUN/hang, or a directory of dumps) and name the first "
                       "collective not every rank entered, the ranks the others wait for "
                       "(with their stacks where they could dump) and the last step every "
                       "rank completed. Exit status: 0 nothing wrong, 1 a rank named, 2 no "
                       "dumps.")
    p.add_argument("run", metavar="RUN", help="the run's directory (mpidist train --out: its "
                   "hang/ is read) or a directory of dumps (MPIDIST_HANG_DIR)")
    p.add_argument("--min-wait", type=float, default=None, metavar="S",
                   help="seconds a call must have been in flight to count as waiting "
                   f"(default: the dumps' hang timeout, at most {_MIN_WAIT:g})")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.min_wait is not None and args.min_wait < 0:
        raise ValueError(f"--min-wait {args.min_wait} must be >= 0")
    directory, dumps, skipped = load_dumps(args.run)
    found = diagnose(dumps, min_wait=args.min_wait)
    found["directory"] = directory
    found["notes"] = skipped + found["notes"]
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        print("\n".join(render(found)))
    return 1 if found["status"] == "stuck" else 0


def load_dumps(path: str) -> tuple[str, list[dict[str, Any]], list[str]]:
    """The dumps in ``path/hang`` (or in ``path`` itself): ``(directory, dumps, notes on
    files skipped)``. ValueError (one line) when there is no such directory or no dump."""
    directory = os.path.join(path, "hang") if os.path.isdir(os.path.join(path, "hang")) \
        else path
    if not os.path.isdir(directory):
        raise ValueError(f"{path}: no such directory")
    dumps, notes = [], []
    for name in sorted(os.listdir(directory)):
        if not (name.endswith(".json") and name.startswith(("rank-", "spawned-"))):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError) as exc:
            notes.append(f"skipped {name}: {exc}")
            continue
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            notes.append(f"skipped {name}: not a flight-recorder dump ({FORMAT})")
            continue
        dumps.append(d)
    if not dumps:
        raise ValueError(f"no flight-recorder dumps in {directory} (rank-<r>.json: a rank "
                         "writes one when it hangs, on SIGUSR2, or when the job is aborted)")
    return directory, dumps, notes


# -- the analysis (pure) -------------------------------------------------------------------
class _Job:
    """The newest job's dumps, one per rank, and what they say together."""

    def __init__(self, dumps: list[dict[str, Any]], min_wait: float | None) -> None:
        jobs: dict[str, list[dict[str, Any]]] = {}
        for d in dumps:
            jobs.setdefault(str(d.get("job", "")), []).append(d)
        self.job = max(jobs, key=lambda j: max(d["time"] for d in jobs[j]))
        self.notes = []
        if len(jobs) > 1:
            older = sum(len(v) for k, v in jobs.items() if k != self.job)
            self.notes.append(f"ignored {older} dump(s) of {len(jobs) - 1} earlier job(s)")
        self.by_rank: dict[int, dict[str, Any]] = {}
        for d in jobs[self.job]:
            r = int(d["world_rank"])
            if r not in self.by_rank or d["time"] > self.by_rank[r]["time"]:
                self.by_rank[r] = d
        self.hosts: dict[int, str] = {}
        for d in self.by_rank.values():
            self.hosts.update({int(k): v for k, v in d.get("ranks", {}).items()})
        for r, d in self.by_rank.items():
            self.hosts[r] = f"{d['host']}:{d['pid']}"
        self.size = max(int(d.get("world_size", 1)) for d in self.by_rank.values())
        self.comms: dict[str, dict[str, Any]] = {}
        self.entered: dict[tuple[str, int], int] = {}  # (comm, rank) -> last seq entered
        for r, d in self.by_rank.items():
            for c in d.get("communicators", []):
                known = self.comms.setdefault(c["id"], dict(c))
                if c.get("label") and not known.get("label"):
                    known["label"] = c["label"]
                self.entered[(c["id"], r)] = int(c["coll_seq"]) - 1
        if min_wait is None:
            limits = [float(d["hang_timeout"]) for d in self.by_rank.values()
                      if float(d.get("hang_timeout") or 0) > 0]
            min_wait = min([_MIN_WAIT, *limits])
        self.min_wait = min_wait
        self.waiting = {r: self._waiting(d) for r, d in self.by_rank.items()}

    def _waiting(self, d: dict[str, Any]) -> list[dict[str, Any]]:
        """The calls of dump ``d`` in flight for at least ``min_wait`` seconds (blocked in,
        or posted and not completed), oldest first, each with ``waited``."""
        out: dict[tuple[str, str, int], dict[str, Any]] = {}
        pending = [c for c in d.get("calls", []) if c.get("t_exit") is None]
        for c in pending + [x["call"] for x in d.get("inside", [])]:
            waited = d["time"] - c["t_enter"]
            if waited >= self.min_wait:
                out[(c["comm"], c["kind"], c["seq"])] = dict(c, waited=round(waited, 1))
        return sorted(out.values(), key=lambda c: c["t_enter"])

    def who(self, r: int) -> str:
        return f"{r} ({self.hosts.get(r, 'host:pid unknown')})"

    def record(self, cid: str, seq: int, ranks: list[int]) -> tuple[dict[str, Any], float]:
        """The call ``(cid, seq)`` as the first of ``ranks`` that has it recorded it, and the
        earliest time any of them entered it (inf: none has it in its ring)."""
        found: dict[str, Any] = {}
        first = float("inf")
        for r in ranks:
            for c in self.by_rank[r].get("calls", []):
                if c["comm"] == cid and c["kind"] == "coll" and c["seq"] == seq:
                    found = found or c
                    first = min(first, c["t_enter"])
        return found, first


def _collective_findings(job: _Job) -> list[dict[str, Any]]:
    out = []
    for cid, c in job.comms.items():
        members = [m for m in c.get("members", []) if m >= 0]
        if len(members) < 2:
            continue
        have = [r for r in members if r in job.by_rank]
        stuck = [w for r in have for w in job.waiting[r]
                 if w["comm"] == cid and w["kind"] == "coll"]
        if not stuck:
            continue
        seqs = {r: job.entered.get((cid, r), -1) for r in have}
        top = max(seqs.values())
        behind = [r for r in have if seqs[r] < top]
        seq = min(seqs[r] + 1 for r in behind) if behind else min(w["seq"] for w in stuck)
        did = [r for r in have if seqs[r] >= seq]
        call, first = job.record(cid, seq, did)
        out.append({"kind": "collective", "comm": cid, "label": c.get("label", ""),
                    "members": members, "seq": seq, "op": call.get("op", "?"),
                    "step": call.get("step"), "phase": call.get("phase"),
                    "count": call.get("count"), "dtype": call.get("dtype"),
                    "entered": did, "not_entered": [r for r in have if seqs[r] < seq],
                    "no_dump": [r for r in members if r not in job.by_rank],
                    "waited": max(w["waited"] for w in stuck), "first": first})
    return out


def _p2p_findings(job: _Job) -> list[dict[str, Any]]:
    out = []
    for r, calls in job.waiting.items():
        for w in calls:
            members = job.comms.get(w["comm"], {}).get("members", [])
            if w["kind"] != "p2p" or not 0 <= w["peer"] < len(members):
                continue
            peer = members[w["peer"]]
            out.append({"kind": "p2p", "comm": w["comm"],
                        "label": job.comms[w["comm"]].get("label", ""), "seq": w["seq"],
                        "op": w["op"], "step": w["step"], "phase": w["phase"],
                        "count": w["count"], "dtype": w["dtype"], "entered": [r],
                        "not_entered": [peer] if peer in job.by_rank else [],
                        "no_dump": [] if peer in job.by_rank else [peer],
                        "waited": w["waited"], "first": w["t_enter"]})
    return out


def _state(job: _Job, r: int) -> dict[str, Any]:
    """What rank ``r`` was doing: its dump's reason, step and phase, the call it waits in
    (if any), its main stack; or that it left no dump."""
    d = job.by_rank.get(r)
    if d is None:
        return {"rank": r, "host": job.hosts.get(r, ""), "dumped": False}
    waits = job.waiting[r]
    stacks = [s for s in d.get("stacks", []) if s.get("name") != "mpidist-recorder"]
    main = next((s for s in stacks if s.get("name") == "MainThread"), stacks[0] if stacks
                else {"frames": []})
    return {"rank": r, "host": job.hosts.get(r, ""), "dumped": True, "reason": d["reason"],
            "step": d.get("step"), "phase": d.get("phase"),
            "last_progress_s": d.get("last_progress_s"),
            "waiting_in": waits[0] if waits else None, "stack": main["frames"][-8:]}


def diagnose(dumps: list[dict[str, Any]], min_wait: float | None = None) -> dict[str, Any]:
    """What the dumps say together (JSON-serialisable): ``status`` ("stuck" when a
    culprit is named, else "ok"), ``finding`` (the first collective, or point-to-point
    call, that a waiting rank's peers did not all enter; None), ``culprits`` (the ranks
    that did not enter it and wait for nothing else, or left no dump: their states,
    :func:`_state`), ``also_behind`` (those that did not enter it because they wait in
    another call), ``aborted`` (ranks that aborted the job, with the reason),
    ``steps_done`` (the last step every rank that dumped completed), ``ranks_dumped``,
    ``world_size``, ``notes``. Pure."""
    job = _Job(dumps, min_wait)
    findings = _collective_findings(job) + _p2p_findings(job)

    def free(f: dict[str, Any]) -> bool:  # a culprit not itself waiting: the chain's end
        return any(not job.waiting.get(r) for r in f["not_entered"] + f["no_dump"])

    findings.sort(key=lambda f: (not free(f), f["first"], f["kind"] != "collective"))
    finding = findings[0] if findings else None
    aborted = [{"rank": r, "host": job.hosts.get(r, ""), "reason": d["reason"]}
               for r, d in sorted(job.by_rank.items()) if d["reason"].startswith("abort")]
    # The ranks named: those that did not enter it and wait for nothing themselves (or left
    # no dump); one that waits in another call (an earlier one on the same communicator,
    # which the missing rank holds up too) is shown as also behind.
    behind = [] if finding is None else sorted(finding["not_entered"] + finding["no_dump"])
    named = [r for r in behind if not job.waiting.get(r)] or behind
    culprits = [_state(job, r) for r in named]
    also = [_state(job, r) for r in behind if r not in named]
    done = [int(d.get("steps_done", -1)) for d in job.by_rank.values()]
    missing = [r for r in range(job.size) if r not in job.by_rank]
    notes = list(job.notes)
    if missing and not (finding and set(missing) <= set(finding["no_dump"])):
        notes.append("no dump from rank " + ", ".join(job.who(r) for r in missing))
    if finding is not None:
        finding = dict(finding, first=None if finding["first"] == float("inf")
                       else finding["first"])
    return {"status": "stuck" if finding is not None or aborted else "ok",
            "job": job.job, "world_size": job.size, "ranks_dumped": sorted(job.by_rank),
            "reasons": {str(r): d["reason"] for r, d in sorted(job.by_rank.items())},
            "hosts": {str(r): h for r, h in sorted(job.hosts.items())},
            "min_wait": job.min_wait, "finding": finding, "culprits": culprits,
            "also_behind": also, "aborted": aborted,
            "steps_done": min(done) if done and min(done) >= 0 else None, "notes": notes}


# -- the report --------------------------------------------------------------------------------
def _ranks(found: dict[str, Any], ranks: list[int]) -> str:
    hosts = found["hosts"]
    return ", ".join(f"{r} ({hosts.get(str(r), 'host:pid unknown')})" for r in ranks)


def _culprit_lines(found: dict[str, Any], c: dict[str, Any],
                   head: str = "waiting for") -> list[str]:
    who = _ranks(found, [c["rank"]])
    if not c["dumped"]:
        return [f"  {head}: rank {who}: no dump (a stopped or dead process cannot "
                "write one)"]
    w = c["waiting_in"]
    if w is not None:
        return [f"  {head}: rank {who}: not entered; itself waiting {w['waited']:g} s "
                f"in {w['op']} #{w['seq']} on {w['comm']} (step {w['step']}, phase "
                f"{w['phase'] or '-'})"]
    lines = [f"  {head}: rank {who}: not entered; at step {c['step']}, phase "
             f"{c['phase'] or '-'}, no MPI progress for {c['last_progress_s']:.0f} s; its "
             "stack (innermost last):"]
    for file, line, func, code in c["stack"]:
        lines.append(f"      {file}:{line} in {func}" + (f": {code}" if code else ""))
    return lines


def render(found: dict[str, Any]) -> list[str]:
    """The report of :func:`diagnose` (with ``directory``) as a few lines."""
    reasons: dict[str, int] = {}
    for text in found["reasons"].values():
        key = text.split(":")[0]
        reasons[key] = reasons.get(key, 0) + 1
    why = ", ".join(f"{k} ({n})" for k, n in sorted(reasons.items()))
    lines = [f"mpidist doctor: {found.get('directory', '')}: dumps from "
             f"{len(found['ranks_dumped'])} of {found['world_size']} ranks (job "
             f"{found['job'] or '?'}; {why})"]
    for a in found["aborted"]:
        lines.append(f"aborted: rank {_ranks(found, [a['rank']])}: {a['reason'][6:].strip()}")
    f = found["finding"]
    if f is not None:
        what = f"{f['op']} #{f['seq']} on {f['comm']}" + (f" ({f['label']})" if f["label"]
                                                          else "")
        if f["kind"] == "p2p":
            what = f"{f['op']} (point-to-point) on {f['comm']}"
        lines.append(f"stuck: {what}, step {f['step']}, phase {f['phase'] or '-'}, "
                     f"{f['count']} x {f['dtype'] or '-'}")
        lines.append(f"  entered: rank {_ranks(found, f['entered'])}; waiting "
                     f"{f['waited']:g} s")
        for c in found["culprits"]:
            lines.extend(_culprit_lines(found, c))
        for c in found["also_behind"]:
            lines.extend(_culprit_lines(found, c, "also behind"))
        if not found["culprits"]:
            lines.append("  every member entered it and none completed it: MPI itself or "
                         "the network")
    elif not found["aborted"]:
        lines.append(f"nothing wrong: no rank has waited {found['min_wait']:g} s or more "
                     "for an MPI call, and none aborted")
    done = found["steps_done"]
    lines.append(f"last step every rank that dumped completed: "
                 f"{done if done is not None else 'none recorded'}")
    lines.extend(f"note: {n}" for n in found["notes"])
    return lines
