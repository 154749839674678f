"""Warm standbys (inmem_ft/agent/standbys.py, zygote.py, worker.py): a rank handed to a standby runs its command as a
cold `python ...` would, a job restarted on standbys resumes bit-identically, and a command whose imports must
follow its own code turns them off instead of failing."""
import json
import os
import subprocess
import sys
import time

import pytest

from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.agent.standbys import StandbyPool
from inmem_ft.telemetry import read_losses, write_record

SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "file": __file__,
                  "x": os.environ.get("X"), "stale": os.environ.get("ONLY_AT_SPAWN"), "stdin": sys.stdin.read()}))
sys.exit(7)
"""


def wait_ready(pool, slots, timeout=300):
    deadline = time.monotonic() + timeout
    while not all(pool.ready(s) for s in slots):
        assert time.monotonic() < deadline, "standbys not ready in time"
        time.sleep(0.1)


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "spawned"])
def test_a_standby_runs_a_script_as_a_cold_python_does(runtime, fork):
    """Forked from the node's zygote (one thread: OMP_NUM_THREADS=1, as torchrun sets it) or spawned, a standby
    runs the script as `python` does; the forked one is this process's child, its exit status torch's to read."""
    tmp_path = runtime
    script = tmp_path / "sub" / "show.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    env = {**os.environ, "X": "assigned", "OMP_NUM_THREADS": "1"}
    cold = subprocess.run([sys.executable, str(script), "a", "--b"], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    previous = tmp_path / "previous.json"
    write_record(str(previous), {"modules": ["colorsys", "no_such_module_anywhere"], "argv": [str(script), "a", "--b"]})
    pool = StandbyPool(str(tmp_path), logs=True, fork=fork)
    pool.start({**env, "ONLY_AT_SPAWN": "1", "X": "spawn"}, str(previous), (0, 0))
    try:
        wait_ready(pool, [(0, 0)])
        proc = pool.hand_over([str(script), "a", "--b"], env, str(tmp_path / "rank.log"), str(tmp_path / "rank.log"),
                              slot=(0, 0))
        assert proc is not None and proc.wait(timeout=120) == cold.returncode == 7
        assert (type(proc).__name__ == "Forked") == fork and pool.forks == fork
    finally:
        pool.stop()
    assert json.loads((tmp_path / "rank.log").read_text().strip().splitlines()[-1]) == json.loads(cold.stdout)
    assert json.loads(cold.stdout)["stale"] is None and json.loads(cold.stdout)["x"] == "assigned"
    standby_log = next(tmp_path.glob("standby1-*.log")).read_text()
    assert "preloaded=1 failed=1 " in standby_log and "not_imported=no_such_module_anywhere" in standby_log
    assert ("forked_from=" in standby_log) == fork


def test_a_job_restarted_on_warm_standbys_resumes_bit_identically(job, runtime):
    """Rank 1 kills itself after step 19; the snapshot of step 15 is restored by standbys that imported what
    the ranks had imported, and steps 16-19 come out exactly as they did the first time."""
    argv = ["-m", "inmem_ft.examples.plain_pytorch", "--steps", "20", "--interval", "5", "--dp-split", "--overlap"]
    log = runtime / "loss.jsonl"
    with SimulatedCluster(1, 2, job, 64 << 20, str(runtime / "logs"), workers="standby") as cluster:
        first = cluster.run(argv + ["--loss-log", str(log), "--die-at", "19", "--die-rank", "1"])
        assert first.returncodes[1] == -9 and cluster.starts == {"cold": 2}
        before = read_losses(log)
        assert sorted(before) == list(range(1, 20))
        assert cluster.start_standbys() == 2
        wait_ready(cluster.standbys, [(0, 0), (0, 1)])
        log.unlink()
        second = cluster.run(argv + ["--loss-log", str(log)])
        assert second.ok, cluster.rank_log(second.number, 0)
        assert cluster.starts == {"standby": 2}
        records = [cluster.worker_record(2, rank) for rank in range(2)]
        assert all(r["standby"] and r["rendezvous_end"] >= r["rendezvous_start"] >= r["assigned"] for r in records)
        assert "restore rank=0 step=15 source=memory" in cluster.rank_log(2, 0)
    resumed = read_losses(log)
    assert sorted(resumed) == [16, 17, 18, 19, 20]
    assert {s: resumed[s] for s in range(16, 20)} == {s: before[s] for s in range(16, 20)}  # bit-identical


def test_a_command_whose_imports_must_follow_its_own_code_turns_standbys_off_and_still_finishes(job, runtime):
    """As the Megatron example's CPU shim does: `guard.install()` refuses once `needs_guard` is imported, which
    a standby has done already. The rank it started fails, standbys go off, the next restart is cold."""
    lib = runtime / "lib"
    lib.mkdir()
    (lib / "needs_guard.py").write_text("")
    (lib / "guard.py").write_text(
        "import sys\n\ndef install():\n    if 'needs_guard' in sys.modules:\n"
        "        raise RuntimeError('install the guard before anything imports needs_guard')\n")
    script = runtime / "train.py"
    script.write_text("import guard\nguard.install()\nimport needs_guard\n"
                      "from inmem_ft.examples.plain_pytorch import main\nmain()\n")
    env = {**os.environ, "PYTHONPATH": f"{lib}{os.pathsep}{os.environ['PYTHONPATH']}"}
    out = subprocess.run([sys.executable, "-m", "inmem_ft", "launch", "--job", job, "--work-dir",
                          str(runtime / "launch"), "--nodes", "1", "--no-compare", "--kill-rank", "5:1", "--",
                          str(script), "--steps", "12", "--interval", "3"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    timeline = json.loads((runtime / "launch" / "timeline.json").read_text())
    events = [(e["kind"], e["text"]) for e in timeline["events"]]
    off = next(i for i, (kind, text) in enumerate(events) if kind == "standby" and "standbys off" in text)
    assert "install the guard before anything imports needs_guard" in events[off][1]
    assert all("standby" in how for how in timeline["time_lost"][0]["starts"])  # before it knew: onto standbys
    assert sorted(read_losses(str(runtime / "launch" / "loss.jsonl"))) == list(range(1, 13))
