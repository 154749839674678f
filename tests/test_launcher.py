"""`inmem-ft launch`: one agent per node (`inmem-ft run`, what production runs) recovers from a killed rank, a
lost node (a replacement agent, its SMP rebuilt from its EC group) and a hung rank, injected from outside, and the
job ends on exactly the uninterrupted run's losses."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from inmem_ft.agent.timelost import PARTS

CLOCK_RESOLUTION_S = 0.001  # the rank logs' timestamps, which the restore's boundaries come from


def test_launch_recovers_from_kill_node_loss_and_hang_with_exact_losses(runtime, job):
    work = runtime / "launch"
    # The SIGCONT that lets the hung rank print its stacks lets it train on until it is killed: steps to spare
    # after the hang, so that it cannot reach the job's end in that moment on a loaded box.
    out = subprocess.run(
        [sys.executable, "-m", "inmem_ft", "launch", "--job", job, "--work-dir", str(work), "--parity", "1",
         "--kill-rank", "8:3", "--kill-node", "13:1", "--hang-rank", "17:1", "--heartbeat-timeout", "8", "--plot",
         str(work / "plot.png"), "--", "-m", "inmem_ft.examples.plain_pytorch", "--steps", "32", "--interval", "5"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    timeline = json.loads((work / "timeline.json").read_text())
    kinds = [e["kind"] for e in timeline["events"]]
    assert kinds.count("failure") == 3 and kinds.count("detected") == 3 and kinds.count("replace") == 1
    detected = [e["text"] for e in timeline["events"] if e["kind"] == "detected"]
    # A lost node is noticed by the survivor's agent: its ranks' collectives fail, or the replacement joins.
    assert "rank 3 exited with -9" in detected[0] and detected[1].startswith("node 0's agent: ")
    assert "no heartbeat" in detected[2]
    restores = [e for e in timeline["events"] if e["kind"] == "restore" and e["step"]]
    # Which snapshot each restart finds depends on how far training got before the signal landed; that
    # it is a snapshot step, from memory (the lost node's from peer parity), and the exact losses do not.
    steps = [e["step"] for e in restores]
    assert len(steps) == 3 and steps == sorted(steps) and all(s % 5 == 0 for s in steps)
    assert all("memory" in e["text"] for e in restores) and "peer_reconstruction" in restores[1]["text"]
    assert timeline["matches_reference"] is True
    assert "equals the uninterrupted run's" in out.stdout and (work / "plot.png").stat().st_size > 0
    fired = [e["text"] for e in timeline["events"] if e["kind"] == "failure"]
    assert [split["failure"] for split in timeline["time_lost"]] == fired
    for split in timeline["time_lost"]:
        assert_split_adds_up(split)
    assert out.stdout.count("back at step") == 3 and "time lost per failure (s)" in out.stdout


def assert_split_adds_up(split):
    """Every part measured on its own, from recorded timestamps, and together they are the total."""
    assert [p["part"] for p in split["parts"]] == list(PARTS) and all(p["note"] == "" for p in split["parts"])
    bounds = split["boundaries"]  # in causal order, up to the logs' resolution (a restore's start is derived)
    assert all(b - a >= -2 * CLOCK_RESOLUTION_S for a, b in zip(bounds, bounds[1:])), bounds
    assert abs(sum(p["seconds"] for p in split["parts"]) - split["total_s"]) <= CLOCK_RESOLUTION_S
    assert split["steps_recomputed"] == split["reached_step"] - split["restored_step"] >= 0


def test_a_boundary_nobody_recorded_merges_its_parts_and_says_why():
    """A rank whose log has no restore line, a hang nobody injected: no figure is guessed."""
    from inmem_ft.agent.timelost import RankReport, Restart, measure

    t = 1_700_000_000.0
    restore = {"wall": t + 9, "event": "restore", "source": {"role": "rank", "node": 0, "rank": 0},
               "fields": {"step": 10, "source": "memory", "seconds": 1.0, "list_s": 0.001}}
    ranks = {0: RankReport({"standby": True, "ready": t, "assigned": t + 3, "rendezvous_start": t + 4,
                            "rendezvous_end": t + 5}, [restore]),
             1: RankReport({"standby": False, "rendezvous_start": t + 4.5, "rendezvous_end": t + 5}, [])}
    losses = [{"step": 12, "time": t - 1}, {"step": 11, "time": t + 10}, {"step": 12, "time": t + 11}]
    split = measure(Restart("kill", t, t + 1, t + 2, 12, attempt=2, launched_at=t + 3), ranks, losses)
    assert [(p["part"], p["seconds"]) for p in split["parts"]] == [
        ("detection", 1), ("teardown", 1), ("agent rendezvous", 1), ("start and imports", 1.5),
        ("rendezvous", 0.5), ("setup + restore + recompute", 6)]
    assert "restore start not recorded by rank(s) [1]" in split["parts"][5]["note"]
    assert "restore end not recorded by rank(s) [1]" in split["parts"][5]["note"]
    assert split["total_s"] == 11 and split["starts"] == {"standby": 1, "cold": 1}
    assert split["restored_step"] == 10 and split["steps_recomputed"] == 2
    hang = measure(Restart("hang", None, t + 1, t + 2, 12, "stopped by itself", 2, t + 3), ranks, losses)
    assert hang["parts"][0] == {"part": "detection", "seconds": None, "note": "stopped by itself"}
    assert hang["total_s"] is None and sum(p["seconds"] or 0 for p in hang["parts"]) == 10


def test_steps_a_rank_beat_after_the_failure_was_detected_count_as_reached(tmp_path):
    """A hung rank continued to print its stacks may finish a step, and its snapshot, before it is killed: the
    restart restores that step, which must not be past the step the failure is said to have reached."""
    from inmem_ft.agent.clock import RecoveryClock

    said = []
    clock = RecoveryClock(str(tmp_path / "time_lost.json"), lambda event, **_: said.append(f"event={event}"),
                          str(tmp_path / "events.jsonl"))
    clock.failed("hang", {0: {"step": 19, "time": 1.0}, 1: {"step": 19, "time": 1.0}}, failed_at=1.0, note="-")
    clock.stopped({0: {"step": 20, "time": 2.0}, 1: {"step": 19, "time": 1.0}})
    clock.close()
    (split,) = clock.splits
    assert split["reached_step"] == 20 and said[-1].startswith("event=time_lost")


def launch(work, job, *args, steps=8):
    """A short job restarted cold (--no-standby): warm standbys are covered above and in test_standby.py."""
    return subprocess.run(
        [sys.executable, "-m", "inmem_ft", "launch", "--job", job, "--work-dir", str(work), "--nodes", "1",
         "--no-compare", "--no-standby", *args, "--", "-m", "inmem_ft.examples.plain_pytorch", "--steps",
         str(steps), "--interval", "3"], capture_output=True, text=True, timeout=300)


def test_a_second_run_in_the_same_work_dir_reports_only_itself_and_a_failure_that_never_happened_fails_it(
        runtime, job):
    work = runtime / "launch"
    first = launch(work, job, "--kill-rank", "4:1", "--heartbeat-timeout", "30")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "exited with -9" in first.stdout and re.search(r"restore +step [36] from memory", first.stdout)
    (split,) = json.loads((work / "timeline.json").read_text())["time_lost"]
    assert_split_adds_up(split)
    assert split["starts"] == {"cold": 2} and "standby" not in first.stdout
    # Same folder, same job id: nothing of the first run (heartbeats, losses, snapshots) may show up.
    second = launch(work, job, "--kill-rank", "99:0", "--heartbeat-timeout", "30")
    assert second.returncode == 1, second.stdout + second.stderr
    timeline = json.loads((work / "timeline.json").read_text())
    kinds = [e["kind"] for e in timeline["events"]]
    assert kinds.count("start") == 1 and "detected" not in kinds and "failure" not in kinds
    assert [e["text"] for e in timeline["events"] if e["kind"] == "restore"] == ["no snapshot: starting from step 0"]
    assert timeline["missed"] == ["kill -9 rank 0 at step 99"] and timeline["passed"] is False
    assert "FAILED: requested failure(s) never happened (kill -9 rank 0 at step 99)" in second.stdout
    # Lines come out as they happen, before the verdict.
    assert second.stdout.index("restore     no snapshot") < second.stdout.index("FAILED")
    # Every key=value line the trainers and SMPs logged carries the documented prefix.
    logs = [*(work / "agents").rglob("std*.log"), *(work / "run").rglob("node*.log")]
    logged = [line for log in logs for line in log.read_text().splitlines() if re.search(r"\b(event|rank|node)=\S", line)]
    assert any("event=commit" in line for line in logged)
    assert all("INFO [inmem_ft] " in line or "WARNING [inmem_ft] " in line for line in logged), logged


def test_a_failure_outside_the_job_is_refused_before_anything_starts(runtime, job):
    out = launch(runtime / "launch", job, "--kill-node", "5")
    assert out.returncode == 1 and out.stderr.strip() == "inmem-ft: error: --kill-node '5': expected STEP:NODE, e.g. 12:1"
    out = launch(runtime / "launch", job, "--kill-rank", "10:99")
    assert out.returncode == 1 and out.stderr.strip() == (
        "inmem-ft: error: --kill-rank 10:99: the job has 2 ranks (0..1), so this failure could never happen")
    out = launch(runtime / "launch", job, "--parity", "1")  # one node: no group to protect it
    assert out.returncode == 1 and out.stderr.startswith("inmem-ft: error: --parity 1 --nodes 1: ")
    assert not (runtime / "launch").exists()


LINGERS_ON_NODE_1 = """
import os, time
import inmem_ft
from inmem_ft.examples import plain_pytorch

close = inmem_ft.Snapshotter.close


def lingering(self):  # node 1's ranks are past the job's last step, alive and not done yet, when their node is lost
    if os.environ["INMEM_FT_NODE"] == "1":
        time.sleep(120)
    close(self)


inmem_ft.Snapshotter.close = lingering
plain_pytorch.main()
"""


def test_a_node_lost_after_the_jobs_last_step_ends_the_run_as_missed_not_in_torchs_exit_barrier(runtime, job):
    """No agent would ever notice that loss: node 0's ranks are done, and its agent would wait in torch's exit
    barrier for the lost agent (300 s)."""
    script = runtime / "train.py"
    script.write_text(LINGERS_ON_NODE_1)
    work = runtime / "launch"
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "inmem_ft", "launch", "--job", job, "--work-dir", str(work), "--no-compare",
         "--no-standby", "--kill-node", "4:1", "--", str(script), "--steps", "4", "--interval", "3"],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 1, out.stdout + out.stderr
    assert time.monotonic() - started < 150, out.stdout  # the loss lands at once; the exit barrier is 300 s
    timeline = json.loads((work / "timeline.json").read_text())
    assert timeline["missed"] == ["lose node 1 (processes, SMP, memory) at step 4: landed after the job's last step"]
    assert timeline["ok"] is True and "detected" not in [e["kind"] for e in timeline["events"]]
    assert "rank(s) [0, 1] had finished training" in out.stdout
    assert "FAILED: requested failure(s) never happened (lose node 1" in out.stdout


@pytest.mark.slow
def test_make_demo_twice_in_the_same_folder_reports_each_run_truthfully(runtime):
    """What `make demo` runs, twice in one folder: the second run must not see the first's heartbeats,
    losses or snapshots, and must report the same kind of recovery."""
    env = {**os.environ, "INMEM_FT_DEMO_DIR": str(runtime / "out" / "demo")}
    for run in (1, 2):
        out = subprocess.run([sys.executable, "-m", "inmem_ft.demo"], env=env, capture_output=True, text=True,
                             timeout=1800)
        assert out.returncode == 0, f"run {run}:\n{out.stdout}{out.stderr}"
        timeline = json.loads((runtime / "out" / "demo" / "timeline.json").read_text())
        kinds = [e["kind"] for e in timeline["events"]]
        assert kinds.count("start") == 1 and kinds.count("detected") == 2 and kinds.count("failure") == 2
        assert "no heartbeat" not in out.stdout and timeline["missed"] == []
        restores = [e["text"] for e in timeline["events"] if e["kind"] == "restore" and e["step"]]
        assert len(restores) == 2 and "from memory in" in restores[0] and "peer_reconstruction" in restores[1]
        assert "equals the uninterrupted run's" in out.stdout and (runtime / "out" / "demo.png").stat().st_size
        assert [s["failure"] for s in timeline["time_lost"]] == [
            e["text"] for e in timeline["events"] if e["kind"] == "failure"]
        for split in timeline["time_lost"]:
            assert_split_adds_up(split)
        assert "time lost per failure (s)" in out.stdout


KILLED_AT_COMMIT = """
import os, signal, time
from inmem_ft.examples import plain_pytorch
from inmem_ft.smp import control, paths
from inmem_ft.smp.client import SMPClient

NODES, RANKS, STEP, VICTIM, PACE_S = 2, 4, 10, 3, 0.5
call = SMPClient.call


def committed_everywhere():
    held = set()
    for node in range(NODES):
        for r in control.call(paths.default_socket(os.environ["INMEM_FT_JOB"], node), "status")["ranks"]:
            if any(s["state"] == "committed" and s["step"] == STEP for s in r["slots"]):
                held.add(r["rank"])
    return held == set(range(RANKS))


def call_then_die(self, op, **fields):
    reply = call(self, op, **fields)
    # Only the first attempt commits STEP: every restart resumes from it. (Not told by TORCHELASTIC_RESTART_COUNT:
    # torch does not count the restart of a node whose agent was asked for a new round by a peer's.)
    if op == "commit" and fields["rank"] == VICTIM and fields["step"] == STEP:
        while not committed_everywhere():  # every rank holds the step; the agreement that it is complete never runs
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    return reply


SMPClient.call = call_then_die
batch = plain_pytorch.batch


# The steps after STEP (only restarts run them) take PACE_S before their collectives, as a real step's compute would:
# the node loss, injected once node 1's ranks beat step 13, lands while step 14 waits for them. Paced after the
# step's collectives (before its heartbeat), step 14 would be over, the job done, before the loss landed.
def paced(step, *args, **kwargs):
    if step > STEP:
        time.sleep(PACE_S)
    return batch(step, *args, **kwargs)


plain_pytorch.batch = paced
plain_pytorch.main()
"""


def test_a_step_resumed_from_that_no_complete_named_is_protected_before_the_next_node_loss(runtime, job):
    """Issue 23: rank 3 killed right at the snapshot of step 10 (every rank committed it, the job's agreement that
    it is complete never ran, so no SMP was told); the restart resumes from step 10. Its SMPs protect it at once
    (the timeline says from when), so node 1, lost before the next snapshot, is rebuilt at step 10, not step 5."""
    script = runtime / "train.py"
    script.write_text(KILLED_AT_COMMIT)
    work = runtime / "launch"
    out = subprocess.run(
        [sys.executable, "-m", "inmem_ft", "launch", "--job", job, "--work-dir", str(work), "--parity", "1",
         "--no-compare", "--kill-node", "13:1", "--", str(script), "--steps", "14", "--interval", "5"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    events = json.loads((work / "timeline.json").read_text())["events"]
    at = {kind: [e for e in events if e["kind"] == kind] for kind in {e["kind"] for e in events}}
    detected = [e["text"] for e in at["detected"]]
    assert detected[0].startswith("node 1's agent: ") and "rank 3 exited with -9" in detected[0], out.stdout
    assert detected[1].startswith("node 0's agent: "), out.stdout  # the survivor notices the lost node
    assert [e["step"] for e in at["restore"]] == [None, 10, 10], out.stdout
    assert "memory" in at["restore"][1]["text"] and "peer_reconstruction" in at["restore"][2]["text"]
    assert [e["text"] for e in at["rebuild"]][0].startswith("node 1 rebuilding from its EC group: step=10 ")
    assert "ec failed" not in at
    # Step 5 protected on its `complete`; step 10 once the job resumed from it, before node 1 was lost.
    assert [e["step"] for e in at["protected"]] == [5, 10], out.stdout
    resumed = at["protected"][1]
    assert "[protected because the job resumed from step 10]" in resumed["text"]
    assert at["restore"][1]["t"] <= resumed["t"] <= at["failure"][0]["t"]
    assert f"step 10 protected on every node since {resumed['t']:.1f} s" in at["detected"][1]["text"]
    splits = json.loads((work / "timeline.json").read_text())["time_lost"]
    assert [(s["protected_step"], s["restored_step"]) for s in splits] == [(5, 10), (10, 10)]
    assert "protected   step 10 on every node" in out.stdout
