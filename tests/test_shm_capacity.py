"""Shared memory that cannot hold the budget, on a small tmpfs of the test's own (INMEM_FT_SHM_DIR): `smp start`
refuses a budget it can never hold in one line that says how to give the container more, and a tmpfs that
something else fills later refuses a snapshot (posix_fallocate's ENOSPC) where a write would die of SIGBUS;
the trainer goes on."""
import os
import subprocess
import sys

import pytest

from test_cli import cli

TRAINER = """
import os, sys, torch
from inmem_ft import SnapshotConfig, Snapshotter
job, other = sys.argv[1], sys.argv[2:]
snap = Snapshotter(SnapshotConfig(job=job))
steps = (1, 2, 3) if other else (1, 2)
for step in steps:
    if step == 3:
        os.remove(other[0])  # the other tenant frees its memory
    snap.save(step, {"w": torch.full((1 << 18,), float(step)), "step": step})  # 1 MiB per slot
    snap.wait()
snap.close()
print("trainer went on", flush=True)
"""


@pytest.fixture
def shm(tmp_path, runtime, monkeypatch):
    """An 8 MiB tmpfs where the SMPs of the test keep their segments; unmounted however the test ends."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = tmp_path / "shm"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    monkeypatch.setenv("INMEM_FT_SHM_DIR", str(path))
    try:
        yield path
    finally:
        # Lazily when busy: a process the test could not stop must not keep the mount past the test.
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


def fill(path, mib: int):
    """Another tenant of the tmpfs (a DataLoader's workers, another job) takes `mib` MiB of it."""
    with open(path, "wb") as f:
        f.write(b"x" * (mib << 20))


def trainer(job, *args):
    return subprocess.run([sys.executable, "-c", TRAINER, job, *args], capture_output=True, text=True, timeout=120)


def test_a_budget_the_tmpfs_cannot_hold_is_refused_in_one_line(job, runtime, shm):
    out = cli("smp", "start", "--job", job, "--memory-budget", "16MiB")
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"inmem-ft: error: memory budget 16.0 MiB exceeds the 8.0 MiB {shm} can hold at all")
    assert "`docker run --shm-size=16m`" in out.stderr and "{medium: Memory, sizeLimit: 16Mi}" in out.stderr
    fill(shm / "other", 4)
    out = cli("smp", "start", "--job", job, "--memory-budget", "6MiB")
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"inmem-ft: error: memory budget 6.0 MiB exceeds the 4.0 MiB free in {shm}")
    assert "`inmem-ft smp clean` removes them" in out.stderr
    assert not (runtime / "run" / job).exists()  # refused at the command: no daemon, no log


def test_a_tmpfs_filled_by_another_refuses_the_snapshot_and_the_trainer_goes_on(job, runtime, shm):
    assert cli("smp", "start", "--job", job, "--memory-budget", "6MiB").returncode == 0
    try:
        fill(shm / "other", 7)
        out = trainer(job, str(shm / "other"))
        # No signal death (a negative return code): each snapshot is refused with the reason, and the next one,
        # once the other tenant is gone, is held.
        assert out.returncode == 0 and "trainer went on" in out.stdout, out.stderr
        assert out.stderr.count(f"{shm} has no room for a 1.0 MiB snapshot slot") == 2, out.stderr
        assert "`docker run --shm-size=" in out.stderr
        status = cli("smp", "status", "--job", job)
        assert status.returncode == 0 and "newest step held by every rank of this node: 3" in status.stdout
    finally:
        assert cli("smp", "stop", "--job", job, "--wipe").returncode == 0


def test_a_restarted_smp_counts_the_snapshots_it_keeps_as_room(job, runtime, shm):
    assert cli("smp", "start", "--job", job, "--memory-budget", "5MiB").returncode == 0
    try:
        out = trainer(job)
        assert out.returncode == 0 and "trainer went on" in out.stdout and not out.stderr, out.stderr
    finally:
        assert cli("smp", "stop", "--job", job).returncode == 0  # keeps its two 1 MiB slots
    fill(shm / "other", 2)  # 4 MiB free, 6 MiB with what the SMP adopts
    restarted = cli("smp", "start", "--job", job, "--memory-budget", "5MiB")
    try:
        assert restarted.returncode == 0, restarted.stderr
        assert "newest step held by every rank of this node: 2" in cli("smp", "status", "--job", job).stdout
    finally:
        assert cli("smp", "stop", "--job", job, "--wipe").returncode == 0
