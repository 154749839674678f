"""One meaning and one name per word, and the old spellings still working for one release, each saying so in one
line: G = group_size = k + m in the config, the CLI and `survival`; persist_every_steps (training steps) in the
config and --persist-every-steps on the command line; the disk tier named persist_dir / --persist-dir /
$INMEM_FT_PERSIST_DIR; restore sources written as the log lines write them. Driven as a user would: the CLI
in a subprocess, the config block as a trainer reads it."""
import json
import logging
import subprocess
import sys

import pytest

from inmem_ft import ConfigError, status
from inmem_ft.config import InmemFTBlock
from inmem_ft.deprecation import STILL_WORKS, Tier
from inmem_ft.smp import control, paths



def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "inmem_ft", *args], capture_output=True, text=True, timeout=60,
                          env=env)


def deprecations(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("deprecated: ")]


@pytest.fixture
def stop(job):
    yield
    if control.ping(paths.default_socket(job, 0)):
        control.stop(paths.default_socket(job, 0), wipe=True)


def test_group_size_is_the_nodes_of_a_group_everywhere():
    with pytest.raises(ConfigError, match=r"'group_size' = 1: must be an integer >= 2 and > parity \(1\): the "
                                          r"nodes per erasure-code group, G = k \+ m"):
        InmemFTBlock.from_dict({"group_size": 1, "parity": 1})
    assert InmemFTBlock.from_dict({"group_size": 4, "parity": 1}).group_size == 4
    survival = cli("survival", "-N", "8", "-G", "4", "-m", "1", "--mtbf-hours", "1000", "--interval-s", "60")
    assert survival.returncode == 0 and "EC RS(k=3,m=1), 2 group(s) of 4" in survival.stdout
    for command in (["survival"], ["smp", "start"], ["launch"]):
        assert "G = k + m" in " ".join(cli(*command, "--help").stdout.split())


def test_persist_every_steps_counts_training_steps_and_the_old_key_still_works(caplog):
    block = InmemFTBlock.from_dict({"interval": 5, "persist_dir": "/x", "persist_every_steps": 20})
    assert block.persist_every_steps == 20 and block.persist
    with pytest.raises(ConfigError, match=r"'persist_every_steps' = 12: must be a multiple of 'interval' \(5\)"):
        InmemFTBlock.from_dict({"interval": 5, "persist_dir": "/x", "persist_every_steps": 12})
    with pytest.raises(ConfigError, match=r"give 'persist_every_steps' only"):
        InmemFTBlock.from_dict({"persist_dir": "/x", "persist_every": 1, "persist_every_steps": 100})
    with caplog.at_level(logging.WARNING, logger="inmem_ft"):
        old = InmemFTBlock.from_dict({"interval": 5, "persist_dir": "/x", "persist_every": 4}, where="ds.json")
    assert old.persist_every_steps == 20
    assert [r.getMessage() for r in caplog.records] == [
        f"deprecated: 'persist_every' (4 snapshots) in ds.json is now 'persist_every_steps' (20, counted in "
        f"training steps); {STILL_WORKS}"]


def test_smp_start_takes_the_old_config_key_and_says_so(job, runtime, stop):
    config = runtime / "ds.json"
    config.write_text(json.dumps({"inmem_ft": {"interval": 5, "memory_budget": "64MiB", "persist_dir": "d",
                                               "persist_every": 4}}))
    out = cli("smp", "start", "--job", job, "--config", str(config))
    assert out.returncode == 0, out.stderr
    assert deprecations(out.stderr) == [
        f"deprecated: 'persist_every' (4 snapshots) in inmem_ft is now 'persist_every_steps' (20, counted in "
        f"training steps); {STILL_WORKS}"]
    assert status(job)["disk"]["every"] == 20


def test_smp_start_takes_the_old_disk_options_and_says_so(job, runtime, stop):
    out = cli("smp", "start", "--job", job, "--memory-budget", "64MiB", "--spill-dir", str(runtime / "old"),
              "--persist-every", "3")
    assert out.returncode == 0, out.stderr
    assert deprecations(out.stderr) == [f"deprecated: --spill-dir is now --persist-dir; {STILL_WORKS}",
                                        f"deprecated: --persist-every is now --persist-every-steps (the same count "
                                        f"of training steps); {STILL_WORKS}"]
    disk = status(job)["disk"]
    assert disk["dir"] == str(runtime / "old" / job / "node0") and disk["every"] == 3


@pytest.mark.parametrize("variable, deprecated", [("INMEM_FT_PERSIST_DIR", False), ("INMEM_FT_SPILL_DIR", True)])
def test_the_disk_tier_from_the_environment(job, runtime, stop, monkeypatch, variable, deprecated):
    monkeypatch.delenv("INMEM_FT_PERSIST_DIR", raising=False)
    monkeypatch.delenv("INMEM_FT_SPILL_DIR", raising=False)
    monkeypatch.setenv(variable, str(runtime / "env"))
    out = cli("smp", "start", "--job", job, "--memory-budget", "64MiB", "--persist-every-steps", "2")
    assert out.returncode == 0, out.stderr
    assert deprecations(out.stderr) == ([f"deprecated: $INMEM_FT_SPILL_DIR is now $INMEM_FT_PERSIST_DIR; "
                                         f"{STILL_WORKS}"] if deprecated else [])
    assert status(job)["disk"]["dir"] == str(runtime / "env" / job / "node0")


def test_restore_sources_are_the_log_words_and_the_old_spelling_still_compares_equal(caplog):
    tier = Tier("peer_reconstruction")
    assert tier == "peer_reconstruction" and tier != "memory" and "memory" != tier
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="inmem_ft"):
        assert tier == "peer reconstruction" and "peer reconstruction" == tier
        assert tier in ("memory", "peer reconstruction")
    assert [r.getMessage() for r in caplog.records] == [
        f"deprecated: the tier 'peer reconstruction' is now 'peer_reconstruction'; {STILL_WORKS}"]
    assert json.dumps({"tier": tier}) == '{"tier": "peer_reconstruction"}'
