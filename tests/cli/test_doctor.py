"""``mpidist doctor``'s merge of flight-recorder dumps, on synthetic dumps (no MPI): the
first collective not every member entered and who did not, a rank without a dump, chains of
waiting ranks, point-to-point waits, aborts, healthy dumps taken at different moments,
dumps of an earlier job, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpidist.cli import main
from mpidist.cli.doctor import FORMAT, diagnose, load_dumps, render

T = 1_800_000_000.0  # the dumps' wall-clock time
HOSTS = {r: f"node{r // 2}:{100 + r}" for r in range(8)}


def call(comm: str, seq: int, op: str = "Allreduce", *, waited: float | None = None,
         kind: str = "coll", peer: int = -1, step: int = 3, phase: str = "backward",
         t: float = T - 100) -> dict:
    """A recorded call; ``waited``: in flight for that long at the dump (else completed)."""
    enter = T - waited if waited is not None else t
    return {"comm": comm, "seq": seq, "kind": kind, "op": op, "count": 8, "dtype": "float32",
            "peer": peer, "t_enter": enter, "t_exit": None if waited is not None else enter + 1,
            "step": step, "phase": phase, "error": 0, "thread": 1}


def dump(rank: int, size: int, comms: dict[str, tuple[list[int], int]], calls=(),
         inside=(), *, reason: str = "hang: test", job: str = "j1", time: float = T,
         steps_done: int = 2, step: int = 3, phase: str = "backward",
         timeout: float = 5.0, stack=(("train.py", 10, "main", "run()"),)) -> dict:
    """A rank's dump; ``comms``: id -> (members, collective calls entered)."""
    return {"format": FORMAT, "job": job, "reason": reason, "time": time,
            "host": HOSTS[rank].split(":")[0], "pid": int(HOSTS[rank].split(":")[1]),
            "world_rank": rank, "world_size": size, "hang_timeout": timeout, "step": step,
            "phase": phase, "steps_done": steps_done, "last_progress_s": 12.0,
            "ranks": {str(r): HOSTS[r] for r in range(size)},
            "communicators": [{"id": cid, "label": "dp" if cid == "w.1" else "",
                               "size": len(m), "rank": m.index(rank), "members": m,
                               "coll_seq": n, "p2p_seq": 0}
                              for cid, (m, n) in comms.items() if rank in m],
            "inside": [{"thread": 1, "thread_name": "MainThread", "waiting_s": T - c["t_enter"],
                        "call": c} for c in inside],
            "recorder_size": 4096, "calls": list(calls),
            "stacks": [{"thread": 1, "name": "MainThread", "frames": [list(f) for f in stack]},
                       {"thread": 2, "name": "mpidist-recorder", "frames": []}]}


def waiting_rank(rank: int, size: int, seq: int = 5, comm: str = "w.1", **kw) -> dict:
    """A rank blocked ``waited`` seconds in collective ``seq`` of ``comm``."""
    c = call(comm, seq, waited=kw.pop("waited", 20.0))
    members = kw.pop("members", list(range(size)))
    return dump(rank, size, {comm: (members, seq + 1)},
                [call(comm, s) for s in range(seq)] + [c], [c], **kw)


def test_a_held_rank_is_named_with_its_stack():
    held = dump(1, 3, {"w.1": ([0, 1, 2], 5)}, [call("w.1", s) for s in range(5)],
                reason="hang: no progress for 12 s",
                stack=[("engine.py", 340, "forward_backward", "with phase('backward'):"),
                       ("recorder.py", 450, "hold", "time.sleep(s)")])
    found = diagnose([waiting_rank(0, 3), held, waiting_rank(2, 3)])
    f = found["finding"]
    assert found["status"] == "stuck"
    assert (f["comm"], f["seq"], f["op"], f["step"], f["phase"]) == ("w.1", 5, "Allreduce", 3,
                                                                       "backward")
    assert f["entered"] == [0, 2] and f["not_entered"] == [1] and f["no_dump"] == []
    (c,) = found["culprits"]
    assert c["rank"] == 1 and c["dumped"] and c["waiting_in"] is None
    assert c["stack"][-1][2] == "hold"
    text = "\n".join(render(found))
    assert "stuck: Allreduce #5 on w.1 (dp), step 3, phase backward" in text
    assert "entered: rank 0 (node0:100), 2 (node1:102)" in text
    assert "waiting for: rank 1 (node0:101): not entered; at step 3, phase backward" in text
    assert "recorder.py:450 in hold" in text
    assert "last step every rank that dumped completed: 2" in text


def test_a_stopped_rank_is_named_without_a_dump():
    dumps = [waiting_rank(r, 4) for r in (0, 1, 3)]
    found = diagnose(dumps)
    f = found["finding"]
    assert f["entered"] == [0, 1, 3] and f["not_entered"] == [] and f["no_dump"] == [2]
    assert found["culprits"] == [{"rank": 2, "host": "node1:102", "dumped": False}]
    text = "\n".join(render(found))
    assert "waiting for: rank 2 (node1:102): no dump (a stopped or dead process" in text
    assert "dumps from 3 of 4 ranks" in text and "note:" not in text


def test_healthy_dumps_taken_at_different_moments_are_nothing_wrong():
    # SIGUSR2 reaches the ranks at slightly different times: their counts differ, and one
    # is inside a collective, but nobody has waited long
    dumps = [waiting_rank(0, 3, seq=7, waited=0.01, reason="SIGUSR2"),
             dump(1, 3, {"w.1": ([0, 1, 2], 7)}, reason="SIGUSR2"),
             dump(2, 3, {"w.1": ([0, 1, 2], 9)}, reason="SIGUSR2")]
    found = diagnose(dumps)
    assert found["status"] == "ok" and found["finding"] is None and found["culprits"] == []
    assert found["min_wait"] == 5.0  # the dumps' hang timeout (at most 10 s)
    text = render(found)
    assert text[1].startswith("nothing wrong: no rank has waited 5 s or more")
    assert "SIGUSR2 (3)" in text[0]


def test_the_minimum_wait_can_be_given():
    dumps = [waiting_rank(0, 2, waited=3.0), dump(1, 2, {"w.1": ([0, 1], 5)})]
    assert diagnose(dumps)["status"] == "ok"
    assert diagnose(dumps, min_wait=2.0)["finding"]["not_entered"] == [1]


def test_the_chain_ends_at_the_rank_that_waits_for_nothing():
    # ranks 0 and 2 wait on w.1 for rank 1, which itself waits on w.2 for rank 3 (free)
    comms = {"w.1": ([0, 1, 2], 5), "w.2": ([1, 3], 4)}
    r1 = dump(1, 4, {"w.1": ([0, 1, 2], 4), "w.2": ([1, 3], 4)},
              [call("w.2", 3, waited=30.0)], [call("w.2", 3, waited=30.0)])
    r3 = dump(3, 4, {"w.2": ([1, 3], 3)}, reason="hang: no progress")
    dumps = [waiting_rank(0, 4, members=[0, 1, 2]), r1,
             waiting_rank(2, 4, members=[0, 1, 2]), r3]
    assert comms  # (the picture above)
    found = diagnose(dumps)
    assert (found["finding"]["comm"], found["finding"]["seq"]) == ("w.2", 3)
    assert [c["rank"] for c in found["culprits"]] == [3]


def test_a_waiting_culprit_is_shown_waiting():
    r1 = dump(1, 3, {"w.1": ([0, 1, 2], 4), "w.2": ([1], 1)},
              [call("w.9", 0, "Recv", kind="p2p", peer=0, waited=30.0)])
    found = diagnose([waiting_rank(0, 3), r1, waiting_rank(2, 3)])
    (c,) = found["culprits"]
    assert c["rank"] == 1 and c["waiting_in"]["op"] == "Recv"
    assert "not entered; itself waiting 30 s in Recv #0 on w.9" in "\n".join(render(found))


def test_a_rank_held_up_in_an_earlier_call_is_not_the_culprit():
    # rank 2 was stopped inside nonblocking collective #4 after giving ranks 1 and 3 what
    # they needed: they completed it and wait in #5; rank 0 still waits in #4
    r0 = waiting_rank(0, 4, seq=4)
    found = diagnose([r0, waiting_rank(1, 4), waiting_rank(3, 4)])
    f = found["finding"]
    assert (f["seq"], f["entered"], f["not_entered"], f["no_dump"]) == (5, [1, 3], [0], [2])
    assert [c["rank"] for c in found["culprits"]] == [2]
    assert [c["rank"] for c in found["also_behind"]] == [0]
    text = "\n".join(render(found))
    assert "waiting for: rank 2 (node1:102): no dump" in text
    assert "also behind: rank 0 (node0:100): not entered; itself waiting 20 s in " \
           "Allreduce #4 on w.1" in text


def test_a_point_to_point_wait_names_the_peer():
    recv = call("w.3", 7, "Recv", kind="p2p", peer=0, waited=15.0)
    waiting = dump(3, 4, {"w.3": ([1, 3], 2)}, [recv], [recv])
    free = dump(1, 4, {"w.3": ([1, 3], 2)}, reason="hang: no progress")
    others = [dump(r, 4, {"w.3": ([1, 3], 2)}) for r in (0, 2)]
    found = diagnose([waiting, free, *others])
    f = found["finding"]
    assert f["kind"] == "p2p" and f["entered"] == [3] and f["not_entered"] == [1]
    assert "stuck: Recv (point-to-point) on w.3" in "\n".join(render(found))


def test_every_member_entered_and_none_completed():
    found = diagnose([waiting_rank(r, 2) for r in (0, 1)])
    assert found["status"] == "stuck" and found["culprits"] == []
    assert "every member entered it and none completed it" in "\n".join(render(found))


def test_an_abort_is_named():
    dumps = [dump(0, 2, {"w.1": ([0, 1], 3)}, reason="abort: ValueError: bad batch"),
             dump(1, 2, {"w.1": ([0, 1], 3)}, reason="SIGUSR2")]
    found = diagnose(dumps)
    assert found["status"] == "stuck" and found["aborted"][0]["rank"] == 0
    assert "aborted: rank 0 (node0:100): ValueError: bad batch" in render(found)


def test_an_earlier_jobs_dumps_and_a_ranks_older_dump_are_ignored():
    old = [waiting_rank(r, 3, job="old", time=T - 1000) for r in range(3)]
    new = [dump(r, 3, {"w.1": ([0, 1, 2], 5)}, reason="SIGUSR2") for r in range(3)]
    stale = dump(1, 3, {"w.1": ([0, 1, 2], 1)}, time=T - 50)
    found = diagnose([*old, *new, stale])
    assert found["status"] == "ok" and found["job"] == "j1"
    assert found["notes"] == ["ignored 3 dump(s) of 1 earlier job(s)"]


def test_missing_dumps_in_a_healthy_set_are_noted():
    found = diagnose([dump(0, 3, {"w.1": ([0, 1, 2], 5)}, reason="SIGUSR2")])
    assert found["status"] == "ok"
    assert found["notes"] == ["no dump from rank 1 (node0:101), 2 (node1:102)"]


def _write(directory: Path, dumps: list[dict]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for d in dumps:
        (directory / f"rank-{d['world_rank']}.json").write_text(json.dumps(d))


def test_load_reads_the_run_or_the_dump_directory(tmp_path: Path):
    _write(tmp_path / "run" / "hang", [dump(r, 2, {"w.1": ([0, 1], 1)}) for r in (0, 1)])
    (tmp_path / "run" / "hang" / "rank-5.json").write_text("{not json")
    (tmp_path / "run" / "hang" / "rank-6.json").write_text('{"format": "other"}')
    (tmp_path / "run" / "hang" / "notes.json").write_text("{}")
    for where in (tmp_path / "run", tmp_path / "run" / "hang"):
        directory, dumps, notes = load_dumps(str(where))
        assert directory == str(tmp_path / "run" / "hang") and len(dumps) == 2
        assert [n.split(":")[0] for n in notes] == ["skipped rank-5.json",
                                                    "skipped rank-6.json"]
    with pytest.raises(ValueError, match="no flight-recorder dumps in"):
        load_dumps(str(tmp_path))
    with pytest.raises(ValueError, match="no such directory"):
        load_dumps(str(tmp_path / "nowhere"))


def _doctor(*args: str) -> int:
    try:
        return main(["doctor", *args])
    except SystemExit as exc:
        return int(exc.code)


def test_exit_status(tmp_path: Path, capsys):
    _write(tmp_path / "ok" / "hang", [dump(r, 2, {"w.1": ([0, 1], 1)}, reason="SIGUSR2")
                                      for r in (0, 1)])
    _write(tmp_path / "stuck", [waiting_rank(r, 3) for r in (0, 2)])
    assert _doctor(str(tmp_path / "ok")) == 0
    assert "nothing wrong" in capsys.readouterr().out
    assert _doctor(str(tmp_path / "stuck"), "--json") == 1
    found = json.loads(capsys.readouterr().out)
    assert found["culprits"][0]["rank"] == 1 and found["directory"] == str(tmp_path / "stuck")
    assert _doctor(str(tmp_path / "empty-nothing")) == 2
    assert "mpidist doctor: error: " in capsys.readouterr().err
    assert _doctor(str(tmp_path / "ok"), "--min-wait", "-1") == 2
