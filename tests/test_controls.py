"""The controls an operator uses before planned maintenance, as they use them: `inmem-ft smp flush` (a
subprocess) against real SMPs of two nodes linked over TCP with a shared disk tier, `Snapshotter.flush()` from a
trainer, and each way a flush cannot happen, said in one line with exit code 1."""
import json
import subprocess
import sys

import pytest
import torch

from test_hardening import _write_rank as write_rank
from inmem_ft import SnapshotConfig, Snapshotter, status
from inmem_ft.launcher.ports import free_port
from inmem_ft.smp import control, paths
from inmem_ft.smp.client import SMPClient

SECRET = "0123456789abcdef0123456789abcdef"


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "inmem_ft", *args], capture_output=True, text=True,
                          timeout=timeout)


def complete(job, nodes, step):
    """Rank r runs on node r; each commits `step`; every SMP hears it is complete (as the trainers say it)."""
    for node in range(nodes):
        write_rank(paths.default_socket(job, node), node, step, None if step == 2 else step - 2)
    for node in range(nodes):
        client = SMPClient(paths.default_socket(job, node))
        try:
            client.call("complete", step=step)
        finally:
            client.close()


@pytest.fixture
def two_nodes(job, runtime, monkeypatch):
    """start(disk=True): the SMPs of nodes 0 and 1, linked, each flushing only when asked or on SIGTERM
    (no --persist-every-steps) into one shared disk tier -> its directory. All stopped (wiped) at the end."""
    monkeypatch.setenv("INMEM_FT_SECRET", SECRET)
    peers = ",".join(f"{n}=127.0.0.1:{free_port()}" for n in range(2))
    disk = runtime / "disk"

    def start(with_disk=True):
        for node in range(2):
            control.start(job, node, 64 << 20, extra_args=["--peers", peers] +
                          (["--persist-dir", str(disk)] if with_disk else []))
        return disk
    yield start
    for node in range(2):
        if control.ping(paths.default_socket(job, node)):
            control.stop(paths.default_socket(job, node), wipe=True)


def test_smp_flush_puts_the_newest_complete_step_on_every_nodes_disk(job, two_nodes):
    disk = two_nodes()
    assert cli("smp", "flush", "--job", job).stderr.endswith("knows of no complete step yet: nothing to flush\n")
    complete(job, 2, 2)
    complete(job, 2, 4)
    out = cli("smp", "flush", "--job", job)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (f"inmem-ft: step 4, the newest complete step of job {job}, is on disk on every node "
                          f"(node 0: step 4, node 1: step 4)\n")
    for node in range(2):
        assert sorted(p.name for p in (disk / job / f"node{node}").iterdir()) == [f"r{node}.step4.slot",
                                                                                   "step4.done"]
        assert status(job, node)["disk"]["flushed_step"] == 4
    assert json.loads((disk / job / "latest").read_text()) == {"step": 4}
    # Asked again with nothing newer: nothing more is written, and it says the same.
    again = cli("smp", "flush", "--job", job, "--node", "1")
    assert again.returncode == 0 and "step 4" in again.stdout, again.stderr


def test_smp_flush_says_why_not_in_one_line(job, runtime, two_nodes):
    def fails(*args):
        out = cli("smp", "flush", "--job", job, *args)
        assert out.returncode == 1 and out.stderr.count("\n") == 1 and out.stdout == "", out
        return out.stderr

    assert "no SMP is listening" in fails()
    two_nodes(with_disk=False)
    complete(job, 2, 2)
    assert fails() == ("inmem-ft: error: step 2 is not on disk on node 0: node 0 has no disk tier: its SMP was "
                       "started without --persist-dir\n")
    assert "argument --timeout: 'soon' is not a duration" in cli("smp", "flush", "--timeout", "soon").stderr


def test_smp_flush_names_a_node_that_cannot_be_reached(job, two_nodes):
    two_nodes()
    complete(job, 2, 2)
    control.stop(paths.default_socket(job, 1))  # node 1 is gone (kept its memory: a maintenance window)
    out = cli("smp", "flush", "--job", job)
    assert out.returncode == 1 and out.stderr.startswith("inmem-ft: error: step 2 is not on disk on node 1: "), out
    assert out.stderr.count("\n") == 1


def test_a_trainer_flushes_its_newest_snapshot_from_python(job, runtime):
    disk = runtime / "disk"
    control.start(job, 0, 64 << 20, extra_args=["--persist-dir", str(disk)])
    try:
        with Snapshotter(SnapshotConfig(job=job)) as snap:
            for step in (1, 2, 3):
                snap.save(step, {"w": torch.full((1000,), float(step)), "step": step})
            assert snap.flush() == {"step": 3, "nodes": {"0": 3}}
        assert (disk / job / "node0" / "step3.done").exists()
        assert status(job)["disk"]["flushed_step"] == 3
    finally:
        control.stop(paths.default_socket(job, 0), wipe=True)


def test_a_flush_that_fails_on_a_node_says_why(job, runtime):
    (runtime / "file").write_text("not a directory")
    control.start(job, 0, 64 << 20, extra_args=["--persist-dir", str(runtime / "file" / "disk")])
    try:
        complete(job, 1, 2)
        out = cli("smp", "flush", "--job", job)
        assert out.returncode == 1 and out.stderr.count("\n") == 1, out
        assert out.stderr.startswith("inmem-ft: error: step 2 is not on disk on node 0: its flush failed: "
                                     "NotADirectoryError: "), out.stderr
        assert status(job)["disk"]["flush_failures"] == 1
    finally:
        control.stop(paths.default_socket(job, 0), wipe=True)
