"""Checks of Chrome trace events shared by the timeline tests (core and run)."""

from __future__ import annotations


def improperly_nested(events: list[dict]) -> list[str]:
    """The "X" events of ``events`` that break proper nesting on their (pid, tid) track:
    a slice that starts inside another and ends after it."""
    tracks: dict[tuple[int, int], list[dict]] = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    bad = []
    for evs in tracks.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in evs:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - 1e-6:
                stack.pop()
            if stack and e["ts"] + e["dur"] > stack[-1]["ts"] + stack[-1]["dur"] + 1e-6:
                bad.append(f"{e['name']} crosses {stack[-1]['name']} (tid {e['tid']})")
            stack.append(e)
    return bad
