"""Issue 28, metrics where operators look: an SMP started with `inmem-ft smp start --metrics-port` serves its
state to Prometheus, `--metrics-textfile` writes it for node_exporter, and both say what `smp status` and
inmem_ft.status() say."""
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import inmem_ft
from inmem_ft import SnapshotConfig, Snapshotter
from inmem_ft.launcher.ports import free_port


def cli(*args):
    return subprocess.run([sys.executable, "-m", "inmem_ft", *args], capture_output=True, text=True, timeout=60)


def samples(text: str) -> dict:
    """(sample name, frozenset of labels) -> value."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict, name: str, **labels) -> float:
    matches = [v for (n, ls), v in found.items() if n == name and set(labels.items()) <= ls]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return samples(r.read().decode())


def snapshot(job, steps):
    snap = Snapshotter(SnapshotConfig(job=job))
    for step in steps:
        snap.save(step, {"w": torch.full((1000,), float(step)), "step": step})
    snap.close()
    return snap


def check_against_status(found: dict, status: dict) -> None:
    base = {"job": status["job"], "node": str(status["node"])}
    assert value(found, "inmem_ft_held_step", **base) == status["held_step"]
    assert value(found, "inmem_ft_complete_step", **base) == status["complete_step"]
    assert value(found, "inmem_ft_budget_bytes", **base) == status["budget"]
    assert value(found, "inmem_ft_used_bytes", **base) == status["used"]
    for name, count in status["counters"].items():
        assert value(found, f"inmem_ft_{name}_total", **base) == count
    for rank in status["ranks"]:
        newest = max((s for s in rank["slots"] if s["state"] == "committed"), key=lambda s: s["step"])
        assert value(found, "inmem_ft_rank_step", rank=str(rank["rank"])) == newest["step"]
        assert value(found, "inmem_ft_rank_snapshot_bytes", rank=str(rank["rank"])) == newest["bytes"]
        assert value(found, "inmem_ft_rank_slot_bytes", rank=str(rank["rank"])) == \
            sum(s["capacity"] for s in rank["slots"])
    assert 0 <= value(found, "inmem_ft_held_step_age_seconds", **base) < 60


def test_metrics_endpoint_says_what_smp_status_says(job, runtime):
    port = free_port()
    started = cli("smp", "start", "--job", job, "--memory-budget", "64MiB", "--metrics-port", str(port))
    assert started.returncode == 0, started.stderr
    try:
        before = scrape(port)
        assert ("inmem_ft_held_step", frozenset({("job", job), ("node", "0")})) not in before  # none yet
        assert value(before, "inmem_ft_commits_total", job=job) == 0
        snap = snapshot(job, (1, 2, 3))
        assert snap.metrics.stall_count == len(snap.metrics.stalls_s) == 3
        assert snap.metrics.max_stall_s == max(snap.metrics.stalls_s) > 0
        status = inmem_ft.status(job)
        assert status["held_step"] == 3 and status["counters"]["commits"] == 3
        check_against_status(scrape(port), status)
        shown = cli("smp", "status", "--job", job)
        assert shown.returncode == 0 and "None" not in shown.stdout, shown.stdout
        assert "newest step held by every rank of this node: 3 (committed " in shown.stdout
        assert "3 commits, 0 snapshots skipped, 0 torn and 0 corrupt" in shown.stdout
        assert "disk tier: off" in shown.stdout and "peer links: none" in shown.stdout
    finally:
        assert cli("smp", "stop", "--job", job, "--wipe").returncode == 0
    with pytest.raises(OSError):
        scrape(port)  # the endpoint went with the SMP


def test_metrics_textfile_for_node_exporter(job, runtime):
    path = runtime / "textfile" / "inmem_ft.prom"
    path.parent.mkdir()
    started = cli("smp", "start", "--job", job, "--memory-budget", "64MiB", "--metrics-textfile", str(path),
                  "--persist-dir", str(runtime / "disk"), "--persist-every-steps", "2")
    assert started.returncode == 0, started.stderr
    try:
        assert value(samples(path.read_text()), "inmem_ft_commits_total", job=job) == 0  # written at start
        snapshot(job, (1, 2))
        deadline = time.monotonic() + 30
        while value(found := samples(path.read_text()), "inmem_ft_commits_total", job=job) < 2:
            assert time.monotonic() < deadline, path.read_text()
            time.sleep(0.5)
        status = inmem_ft.status(job)
        check_against_status(found, status)
        assert status["disk"]["flushed_step"] == value(found, "inmem_ft_disk_flushed_step", job=job) == 2
        assert [p.name for p in path.parent.iterdir()] == ["inmem_ft.prom"]  # written beside it, then renamed
        shown = cli("smp", "status", "--job", job).stdout
        assert "newest step flushed 2" in shown and "None" not in shown, shown
    finally:
        assert cli("smp", "stop", "--job", job, "--wipe").returncode == 0
    assert not path.exists()  # node_exporter stops reporting an SMP that is gone


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_bad_metrics_port_is_one_line(job, runtime, port):
    out = cli("smp", "start", "--job", job, "--memory-budget", "64MiB", "--metrics-port", port)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "argument --metrics-port" in out.stderr and "or 0 for no endpoint" in out.stderr


def test_metrics_port_in_use_is_one_line_and_no_smp(job, runtime):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = cli("smp", "start", "--job", job, "--memory-budget", "64MiB", "--metrics-port", str(port))
    errors = [line for line in out.stderr.splitlines() if "warning: a memory budget" not in line]
    assert out.returncode == 1 and len(errors) == 1, out.stderr
    assert f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}: Address already in use" in errors[0]
    assert "no SMP is listening" in cli("smp", "status", "--job", job).stderr


def test_erasure_coding_disk_and_peer_metrics(job, runtime, monkeypatch):
    """The families an EC group and its peer links add, from the same state `smp status` shows."""
    from prometheus_client import CollectorRegistry, generate_latest

    from conftest import wait_protected
    from inmem_ft.launcher.simulated import SimulatedCluster
    from inmem_ft.smp import control
    from inmem_ft.smp.metrics import StatusCollector
    from test_ec_cluster import SECRET, write_step

    monkeypatch.setenv("INMEM_FT_SECRET", SECRET)
    cluster = SimulatedCluster(2, 1, job, 64 << 20, str(runtime / "logs"), parity=1).start()
    try:
        write_step(cluster, 1)
        write_step(cluster, 2)
        wait_protected(cluster, 2)
        status = control.status(job, 0, cluster.socket_path(0))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatusCollector(lambda: status))
        found = samples(generate_latest(registry).decode())
    finally:
        cluster.stop()
    ec = status["ec"]
    assert value(found, "inmem_ft_ec_protected_step", job=job) == ec["protected_step"] == 2
    assert value(found, "inmem_ft_ec_parity_bytes", job=job) == ec["parity_bytes"] > 0
    assert value(found, "inmem_ft_ec_lag_seconds", job=job) == ec["ec_lag_s"] >= 0
    assert value(found, "inmem_ft_ec_rebuilds_total", job=job) == ec["rebuilds"] == 0
    assert value(found, "inmem_ft_ec_rebuild_running", job=job) == 0
    assert value(found, "inmem_ft_ec_degraded", job=job) == 0 and ec["degraded"] is None
    assert status["peers"] == [{"node": 1, "addr": status["peers"][0]["addr"], "state": "up"}]
    assert value(found, "inmem_ft_peer_up", job=job, peer="1") == 1
    check_against_status(found, status)


def test_counters_count_what_the_log_says(job, smp):
    from inmem_ft.smp import paths
    from inmem_ft.smp.client import SMPClient

    client = SMPClient(smp[0])
    client.call("begin", rank=0, step=1, manifest_len=100, data_len=100, reserve=True)
    client.close()  # the trainer is gone mid-write: its slot is torn
    deadline = time.monotonic() + 10
    while inmem_ft.status(job)["counters"]["torn"] != 1:
        assert time.monotonic() < deadline, inmem_ft.status(job)
        time.sleep(0.05)
    assert "event=torn rank=0 step=1" in open(paths.default_log(job, 0)).read()
    assert "0 commits, 0 snapshots skipped, 1 torn and 0 corrupt" in cli("smp", "status", "--job", job).stdout
