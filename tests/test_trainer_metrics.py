"""What a trainer reports where its user already looks: each committed snapshot's stall, commit time and bytes
in DeepSpeed's own monitor (its CSV writer, read back), the controls of the DeepSpeed handle (snapshot now,
flush to disk now), and the restore line on stderr on every rank that restores, with no logging configured and
once with the application's own. Real engines and SMPs, each trainer a subprocess (one process group each)."""
import csv
import json
import subprocess
import sys
import textwrap

from ds_harness import free_port
from inmem_ft.smp import control, paths

DS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch, deepspeed
    from inmem_ft.integrations.deepspeed import cpu_setup, install

    cpu_setup()
    deepspeed.init_distributed(dist_backend="gloo")
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))

    def engine():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                  "csv_monitor": {"enabled": True, "output_path": sys.argv[3], "job_name": "run"},
                  "inmem_ft": {"interval": 2, "job": sys.argv[2]}}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    def train(e, steps):
        for _ in range(steps):
            e.backward(e(x).pow(2).mean())
            e.step()

    first = engine()
    handle = install(first)
    print("FIRST " + json.dumps(handle.restored is None), flush=True)
    train(first, 5)  # snapshots at 2 and 4, each reported once committed, at a later step or snapshot
    handle.snapshot()  # step 5, now
    out = {"flushed": handle.flush()}
    handle.close()
    second = engine()
    handle = install(second)
    out.update(step=handle.restored.step, tier=handle.restored.tier)
    handle.close()
    print("RESULT " + json.dumps(out))
    from inmem_ft.teardown import run_main
    run_main(lambda: None)  # the gloo groups go before the interpreter finalizes (teardown.py)
""")


def test_deepspeed_reports_snapshots_to_its_monitor_and_flushes_on_demand(job, runtime):
    disk = runtime / "disk"
    control.start(job, 0, 64 << 20, extra_args=["--persist-dir", str(disk)])
    try:
        proc = subprocess.run([sys.executable, "-c", DS_SCRIPT, str(free_port()), job, str(runtime / "monitor")],
                              capture_output=True, text=True, timeout=300)
    finally:
        control.stop(paths.default_socket(job, 0), wipe=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["flushed"] == {"step": 5, "nodes": {"0": 5}} and (disk / job / "node0" / "step5.done").exists()
    assert (out["step"], out["tier"]) == (5, "memory")
    # The restore line reached stderr with no logging configured, once.
    restores = [line for line in proc.stderr.splitlines() if "restore rank=0 step=" in line]
    assert len(restores) == 1 and "restore rank=0 step=5 source=memory seconds=" in restores[0], restores
    # DeepSpeed's CSV monitor, read back: one row per committed snapshot reported, at its own step.
    rows = {}
    for name in ("snapshot_stall_s", "snapshot_commit_s", "snapshot_bytes"):
        with open(runtime / "monitor" / "run" / f"inmem_ft_{name}.csv") as f:
            table = list(csv.reader(f))
        assert table[0] == ["step", name]
        rows[name] = {int(step): float(value) for step, value in table[1:]}
    assert set(rows["snapshot_bytes"]) == {2, 4, 5}
    assert set(rows["snapshot_stall_s"]) == set(rows["snapshot_commit_s"]) == set(rows["snapshot_bytes"])
    assert all(v > 0 for name in rows for v in rows[name].values())
    assert len(set(rows["snapshot_bytes"].values())) == 1  # the same state each time


PLAIN_SCRIPT = textwrap.dedent("""
    import logging, sys
    import torch
    from inmem_ft import SnapshotConfig, Snapshotter

    if sys.argv[2] == "configured":
        logging.basicConfig(level=logging.INFO, format="APP %(name)s %(message)s")
    with Snapshotter(SnapshotConfig(job=sys.argv[1])) as snap:
        if snap.restore() is None:
            snap.save(3, {"w": torch.ones(100)})
""")


def test_the_restore_line_shows_once_with_or_without_the_applications_logging(job, smp):
    def run(mode):
        proc = subprocess.run([sys.executable, "-c", PLAIN_SCRIPT, job, mode], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [line for line in proc.stderr.splitlines() if "restore rank=0 step=3 source=memory" in line]

    assert run("bare") == []  # nothing to restore yet: the first run snapshots step 3
    [line] = run("bare")
    assert line.startswith("restore rank=0 step=3 source=memory seconds=")
    [line] = run("configured")
    assert line.startswith("APP inmem_ft.capture restore rank=0 step=3 source=memory seconds=")
