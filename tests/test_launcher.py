"""`inmem-ft launch`: the supervisor's restart loop recovers from a killed rank, a lost node (rebuilt from
its EC group) and a hung rank, and the job ends on exactly the uninterrupted run's losses."""
import json
import subprocess
import sys


def test_launch_recovers_from_kill_node_loss_and_hang_with_exact_losses(runtime, job):
    work = runtime / "launch"
    out = subprocess.run(
        [sys.executable, "-m", "inmem_ft", "launch", "--job", job, "--work-dir", str(work), "--parity", "1",
         "--kill-rank", "8:3", "--kill-node", "13:1", "--hang-rank", "17:1", "--heartbeat-timeout", "8", "--plot", str(work / "plot.png"), "--",
         "-m", "inmem_ft.examples.plain_pytorch", "--steps", "24", "--interval", "5"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    timeline = json.loads((work / "timeline.json").read_text())
    kinds = [e["kind"] for e in timeline["events"]]
    assert kinds.count("failure") == 3 and kinds.count("detected") == 3 and kinds.count("replace") == 1
    detected = [e["text"] for e in timeline["events"] if e["kind"] == "detected"]
    assert "exited with -9" in detected[0] and "exited with -9" in detected[1] and "no heartbeat" in detected[2]
    restores = [e for e in timeline["events"] if e["kind"] == "restore" and e["step"]]
    # Which snapshot each restart finds depends on how far training got before the signal landed; that
    # it is a snapshot step, from memory (the lost node's from peer parity), and the exact losses do not.
    steps = [e["step"] for e in restores]
    assert len(steps) == 3 and steps == sorted(steps) and all(s % 5 == 0 for s in steps)
    assert all("memory" in e["text"] for e in restores) and "peer reconstruction" in restores[1]["text"]
    assert timeline["matches_reference"] is True
    assert "equals the uninterrupted run's" in out.stdout and (work / "plot.png").stat().st_size > 0
