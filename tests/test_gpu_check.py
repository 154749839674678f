"""benchmarks/gpu_check.py on CPU (--quick), so the one-GPU check never rots while no GPU is at hand: every
phase is in its JSON, run or skipped with its reason, and the figures that CPU can give are there."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_runs_on_cpu_with_every_phase_accounted_for(runtime, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--device", "cpu",
                           "--quick"], env=dict(os.environ, OUT=str(out)), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "gpu_check.json").read_text())
    assert {"machine", "date", "commit", "command"} <= set(results["meta"])
    phases = results["phases"]
    assert list(phases) == ["gpu_tests", "training", "many_tensors", "restore", "deepspeed"]
    for name, phase in phases.items():
        assert phase["status"] in ("ran", "skipped"), (name, phase)
        assert phase["status"] == "ran" or phase["reason"], (name, phase)
    assert phases["gpu_tests"]["status"] == "skipped"  # no accelerator asked for
    assert phases["restore"]["bit_exact"] is True
    for key in ("step_ratio", "wait_per_snapshot_s", "copy_vs_pinned", "commit_s"):
        assert phases["training"][key] > 0
    assert phases["many_tensors"]["ratio"] > 0
    assert "gpu_check on" in done.stdout
