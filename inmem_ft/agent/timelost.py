"""The time a failure costs, from the failure to training back at the step it had reached, split into its parts.

Every boundary is a timestamp this run recorded (time.time(), one clock for every process of the machine). The
node's agent (agent/clock.py) records them; `inmem-ft launch`, which injected the failure, knows its moment:

    failure            the signal was sent (an injected failure); for a crash, the agent's last poll that found
                       every local rank running; for a hang, the hung rank's last heartbeat
    detected           the agent noticed the exit, the heartbeat timeout expired, or a peer node's agent asked
                       for a new rendezvous round
    stopped            every local rank was stopped
    launched           the agents' new rendezvous round is done, and the ranks of the restart begin to start
    rendezvous start   the last rank called init_process_group (its worker's record)
    rendezvous end     the last rank's init_process_group returned (its worker's record)
    restore start      the last rank began its restore (its restore event, `restore rank=... seconds=T`, less T)
    restore end        the last rank finished it (that event's time)
    back               every rank is at the step the job had reached, again

The parts between consecutive boundaries add up to the total. A boundary nobody recorded is not guessed: the
parts on either side of it are reported as one ("setup + restore") with a note saying what was missing.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

PARTS = ("detection", "teardown", "agent rendezvous", "start and imports", "rendezvous", "setup", "restore",
         "recompute")
# A restart onto another node count (a shrink, a grow): the same boundaries, with the agents' rendezvous split at
# the start of its wait for a spare (the round had its minimum of nodes: agent/rendezvous.py's LastCall), and the
# restore split into the reads of the lost node's bytes from parity (reconstruction) and the rest (reshard).
RESIZE_PARTS = ("detection", "teardown", "agents' rendezvous", "spare wait", "start and imports", "rendezvous",
                "setup", "reconstruction", "reshard", "first step")


@dataclass
class Restart:
    """What the supervisor recorded of one failure and the restart that followed it."""

    cause: str
    failed_at: float | None  # None: a rank that stopped by itself, at a moment nobody saw
    detected_at: float
    stopped_at: float
    reached: int | None  # the newest step the failed attempt's ranks beat at before they were stopped
    failed_note: str = ""
    attempt: int | None = None  # the attempt that restarted the job
    launched_at: float | None = None
    protected: int | None = None  # with erasure coding: the newest step protected on every node at the failure
    resize: dict | None = None  # onto another node count: {how: shrink|grow, nodes: "3->2", spare_wait: (start, end)}


@dataclass
class RankReport:
    """What one rank of the restart recorded: its worker's record and its restore events (inmem_ft/events.py)."""

    record: dict | None
    restores: list[dict]


def restore_span(restores: list[dict]) -> tuple[float, float, int, dict] | None:
    """(start, end, step, phases) of the rank's restore, from its last restore event (an adapter reports the whole
    restore after the snapshot's own, so the last one spans it all)."""
    if not restores:
        return None
    fields, end = restores[-1]["fields"], restores[-1]["wall"]
    phases = {k[:-len("_s")]: v for k, v in fields.items() if k.endswith("_s")}
    return end - fields["seconds"], end, fields["step"], phases


def _latest(values: dict[int, float | None], what: str) -> tuple[float | None, str]:
    """The last rank's time (the restart waits for it), or None and which ranks did not record it."""
    if not values:
        return None, f"{what} not recorded: no rank was started again"
    missing = sorted(r for r, v in values.items() if v is None)
    if missing:
        return None, f"{what} not recorded by rank(s) {missing}"
    return max(values.values()), ""


def measure(restart: Restart, ranks: dict[int, RankReport], back: list[dict], end_note: str = "") -> dict:
    """The split of one restart. `back`: (step, time) records of the restart's own ranks (the agent's clock takes
    them from the heartbeats of the processes it runs now, so a late beat of the failed attempt is never one);
    `end_note` says why training is not back yet when it is not (the run ended, the restart failed too)."""
    records = {r: rep.record or {} for r, rep in ranks.items()}
    bounds: list[float | None] = [restart.failed_at, restart.detected_at, restart.stopped_at, restart.launched_at]
    notes = [restart.failed_note, "", "", "" if restart.launched_at else "the job was not restarted"]
    worker_note = " (the command did not run through the worker, or never called init_process_group)"
    for key in ("rendezvous_start", "rendezvous_end"):
        t, note = _latest({r: rec.get(key) for r, rec in records.items()}, key.replace("_", " "))
        bounds.append(t)
        notes.append(note + worker_note if note else "")
    spans = {r: restore_span(rep.restores) for r, rep in ranks.items()}
    restored = {s[2] for s in spans.values() if s}
    for i, what in ((0, "restore start"), (1, "restore end")):
        t, note = _latest({r: s[i] if s else None for r, s in spans.items()}, what)
        bounds.append(t)
        notes.append(note + " (no snapshot restored, or no restore event reached the node's events file: "
                            "$INMEM_FT_EVENTS, which `inmem-ft run` sets)" if note else "")
    restored_step = max(restored) if len(restored) == 1 else None
    back_at, back_note = _back(restart, back, restored_step, bounds[-1], end_note)
    bounds.append(back_at)
    notes.append(back_note)
    parts, total = _parts(bounds, notes, PARTS)
    slowest = max((s for s in spans.values() if s), key=lambda s: s[1] - s[0], default=None)
    resized = {"resize": resized_parts(restart.resize, bounds, slowest[3] if slowest else {})} if restart.resize else {}
    return {**resized, "failure": restart.cause, "attempt": restart.attempt, "reached_step": restart.reached,
            "restored_step": restored_step, "protected_step": restart.protected,
            "steps_recomputed": (max(restart.reached - restored_step, 0)
                                 if restart.reached is not None and restored_step is not None else None),
            "total_s": total, "parts": parts,
            "starts": dict(Counter(_start(rec, restart.launched_at) for rec in records.values())),
            "restore_phases": slowest[3] if slowest else {}, "boundaries": bounds}


def resized_parts(resize: dict, bounds: list[float | None], phases: dict) -> dict:
    """The parts of a restart onto another node count (RESIZE_PARTS), from measure()'s boundaries, the round's
    wait for a spare, and the slowest rank's restore phases (its parity reads are the reconstruction). A part
    whose boundaries were not both recorded is None, and so is then the total."""
    failed, detected, stopped, launched, rdzv_start, rdzv_end, restore_start, restore_end, back = bounds
    spare = resize.get("spare_wait")
    waited_from = launched  # the round did not wait for a spare: the maximum of nodes joined
    if spare is not None and None not in (stopped, launched):
        waited_from = min(max(spare[0], stopped), launched)
    marks = [failed, detected, stopped, waited_from, launched, rdzv_start, rdzv_end, restore_start, restore_end, back]
    seconds = [max(b - a, 0.0) if a is not None and b is not None else None for a, b in zip(marks, marks[1:])]
    restore = seconds[7]
    parity = None if restore is None else min(phases.get("read_parity", 0.0), restore)
    seconds[7:8] = [parity, None if restore is None else restore - parity]
    parts = dict(zip(RESIZE_PARTS, seconds))
    total = None if None in seconds else sum(seconds)
    return {"how": resize["how"], "nodes": resize["nodes"], "total_s": total, "parts": parts}


def field(part: str) -> str:
    """A part's name as an event's field: "agents' rendezvous" -> agents_rendezvous_s."""
    return part.replace("'", "").replace(" ", "_") + "_s"


def counted_from(split: dict, cause: str, failed_at: float) -> dict:
    """`split` (measure()'s) of a failure whose moment someone outside knew (`inmem-ft launch` injected it at
    `failed_at`): detection counted from there, whatever the measuring agent could tell of it."""
    detected = split["boundaries"][1]  # always recorded
    parts = [{"part": split["parts"][0]["part"].split(" + ")[0], "seconds": max(detected - failed_at, 0.0),
              "note": ""}, *split["parts"][1:]]
    back = split["boundaries"][-1] is not None and all(p["seconds"] is not None for p in parts)
    return {**split, "failure": cause, "parts": parts, "boundaries": [failed_at, *split["boundaries"][1:]],
            "total_s": sum(p["seconds"] for p in parts) if back else None}


def _start(record: dict, launched_at: float | None) -> str:
    """How a rank of the restart started: "cold", "standby" (it was waiting), "standby still importing" (it ran
    the rank once done), or "unrecorded" (the command did not run through the worker)."""
    if not record:
        return "unrecorded"
    if not record["standby"]:
        return "cold"
    return "standby" if launched_at is None or record["ready"] <= launched_at else "standby still importing"


def _back(restart: Restart, back: list[dict], restored_step: int | None, restore_end: float | None,
          end_note: str) -> tuple[float | None, str]:
    if restart.launched_at is None:
        return None, end_note
    if restart.reached is None:
        return None, ("no rank had beaten before the failure (the command does not call Snapshotter.maybe_save "
                      "or Snapshotter.heartbeat, or failed before its first step)")
    if restored_step is not None and restored_step >= restart.reached and restore_end is not None:
        return restore_end, ""  # restored a step at or past the one reached: nothing to compute again
    again = next((rec["time"] for rec in back
                  if rec["time"] > restart.launched_at and rec["step"] >= restart.reached), None)
    if again is None:
        return None, end_note or f"training is not back at step {restart.reached} yet"
    return again, ""


def _parts(bounds: list[float | None], notes: list[str], names: tuple[str, ...]) -> tuple[list[dict], float | None]:
    """Parts between consecutive recorded boundaries, merging across unrecorded ones; the total from the first
    recorded boundary to the last (None unless both the failure and the recovery were recorded)."""
    known = [i for i, b in enumerate(bounds) if b is not None]
    parts = [{"part": names[i], "seconds": None, "note": notes[i]} for i in range(known[0])]
    prev = bounds[known[0]]
    for a, b in zip(known, known[1:]):
        end = max(bounds[b], prev)  # two clocks' resolutions may put a later mark a hair earlier
        missing = "; ".join(notes[i] for i in range(a + 1, b) if notes[i])
        parts.append({"part": " + ".join(names[a:b]), "seconds": end - prev, "note": missing})
        prev = end
    parts += [{"part": names[i], "seconds": None, "note": notes[i + 1]} for i in range(known[-1], len(names))]
    complete = bounds[0] is not None and bounds[-1] is not None
    return parts, (prev - bounds[0] if complete else None)


def describe(split: dict) -> str:
    """One line: the total and each part, in seconds."""
    parts = []
    for p in split["parts"]:
        figure = "not measured" if p["seconds"] is None else f"{p['seconds']:.3f}"
        if p["part"].endswith("recompute") and split["steps_recomputed"] is not None:
            figure += f" ({split['steps_recomputed']} steps)"
        parts.append(f"{p['part']} {figure}")
    total = "time lost not measured" if split["total_s"] is None else f"{split['total_s']:.2f} s lost"
    notes = "; ".join(p["note"] for p in split["parts"] if p["note"])
    return f"{total}: " + ", ".join(parts) + (f" [{notes}]" if notes else "")


def table(splits: list[dict]) -> str:
    """Seconds lost per failure, one row each, one column per part; a part merged with the one before it
    (a boundary between them was not recorded) shows `<`, one not measured `-`."""
    widths = [max(len(n), 7) for n in PARTS]
    rows = [f"{'failure':<40} {'total':>7} " + " ".join(f"{n:>{w}}" for n, w in zip(PARTS, widths))]
    for s in splits:
        cells = {}
        for p in s["parts"]:
            first, *rest = p["part"].split(" + ")
            cells[first] = "-" if p["seconds"] is None else f"{p['seconds']:.3f}"
            cells.update((n, "<") for n in rest)
        total = "-" if s["total_s"] is None else f"{s['total_s']:.2f}"
        rows.append(f"{s['failure'][:40]:<40} {total:>7} "
                    + " ".join(f"{cells[n]:>{w}}" for n, w in zip(PARTS, widths)))
    return "\n".join(rows)
