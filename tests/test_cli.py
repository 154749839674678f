"""The `inmem-ft` command as an operator uses it: start an SMP from the DeepSpeed config, read its status,
stop it; and the errors when the config cannot serve."""
import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from inmem_ft import SnapshotConfig, Snapshotter
from inmem_ft.cli import build_parser
from inmem_ft.smp.segments import names_with_prefix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "0123456789abcdef0123456789abcdef"


def cli(*args):
    return subprocess.run([sys.executable, "-m", "inmem_ft", *args], capture_output=True, text=True, timeout=60)


def test_smp_from_the_deepspeed_config_block(job, runtime):
    config = runtime / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2},
                                  "inmem_ft": {"enabled": True, "interval": 5, "memory_budget": "64MiB"}}))
    started = cli("smp", "start", "--job", job, "--config", str(config))
    assert started.returncode == 0, started.stderr
    try:
        status = cli("smp", "status", "--job", job)
        assert "64.0 MiB budget" in status.stdout and "held by every rank of this node: none yet" in status.stdout
        assert json.loads(cli("smp", "status", "--job", job, "--json").stdout)["budget"] == 64 << 20
    finally:
        assert cli("smp", "stop", "--job", job, "--wipe").returncode == 0
    assert "no SMP is listening" in cli("smp", "status", "--job", job).stderr


def test_smp_start_without_a_budget_says_where_to_give_one(job, runtime):
    config = runtime / "ds.json"
    config.write_text(json.dumps({"inmem_ft": {"interval": 5}}))
    out = cli("smp", "start", "--job", job, "--config", str(config))
    assert out.returncode == 1 and "give --memory-budget, or --config with a memory_budget" in out.stderr
    config.write_text(json.dumps({"train_batch_size": 8}))
    out = cli("smp", "start", "--job", job, "--config", str(config))
    assert out.returncode == 1 and "has no \"inmem_ft\" block" in out.stderr


def test_the_shipped_deepspeed_config_starts_an_smp_as_the_readme_says(job, runtime, monkeypatch):
    config = os.path.join(ROOT, "configs", "deepspeed_zero2.json")
    alone = cli("smp", "start", "--job", job, "--config", config)
    assert alone.returncode == 1 and alone.stderr.count("\n") == 1 and alone.stderr.startswith(
        f"inmem-ft: error: {config} (\"parity\": 1, \"group_size\": 2) asks for erasure coding across nodes: "
        f"add --nodes N and --peers")
    assert "--parity 0 for a single node" in alone.stderr
    monkeypatch.setenv("INMEM_FT_SECRET", SECRET)
    peers = "0=127.0.0.1:0,1=127.0.0.1:0"  # port 0: node 0 listens where the kernel puts it
    started = cli("smp", "start", "--job", job, "--config", config, "--nodes", "2", "--peers", peers)
    assert started.returncode == 0, started.stderr
    try:
        assert "erasure coding with m=1 across 2 nodes" in started.stdout
        status = json.loads(cli("smp", "status", "--job", job, "--json").stdout)
        assert status["budget"] == 2 << 30 and status["ec"]["m"] == 1
    finally:
        assert cli("smp", "stop", "--job", job, "--wipe").returncode == 0
    single = cli("smp", "start", "--job", job, "--config", config, "--parity", "0")
    assert single.returncode == 0, single.stderr
    assert cli("smp", "stop", "--job", job, "--wipe").returncode == 0


EC = ["--memory-budget", "1GiB", "--parity", "1", "--nodes", "2"]
PEERS = ["--peers", "0=127.0.0.1:7100,1=127.0.0.1:7101"]


@pytest.mark.parametrize("args, secret, error", [
    (EC + PEERS, None, "SMP-to-SMP traffic needs a per-job secret of at least 16 bytes: set INMEM_FT_SECRET"),
    (EC + PEERS, "short", "SMP-to-SMP traffic needs a per-job secret of at least 16 bytes"),
    (EC + PEERS + ["--secret-file", "/nonexistent/secret"], None, "--secret-file: No such file or directory"),
    (EC + ["--peers", "0=127.0.0.1:7100,1=nohostport"], SECRET,
     "--peers: peer entry '1=nohostport' is not NODE=HOST:PORT"),
    (EC + ["--peers", "0=127.0.0.1:7100"], SECRET, "--peers lacks the address of node(s) [1]"),
    (["--memory-budget", "1GiB", "--parity", "2", "--nodes", "2"] + PEERS, SECRET,
     "--parity 2 --nodes 2: 2 nodes cannot form erasure-coding groups tolerating m=2 lost nodes"),
    (["--memory-budget", "1GiB", "--parity", "1"], SECRET, "--parity asks for erasure coding across nodes: add --nodes"),
    (["--config", "no/such/config.json"], None, "--config no/such/config.json: No such file or directory"),
    (["--memory-budget", "4096TiB"], None, "memory budget 4096.0 TiB exceeds the"),
])
def test_setup_errors_are_one_line_before_any_daemon_starts(job, runtime, monkeypatch, args, secret, error):
    monkeypatch.delenv("INMEM_FT_SECRET", raising=False)
    if secret:
        monkeypatch.setenv("INMEM_FT_SECRET", secret)
    out = cli("smp", "start", "--job", job, *args)
    assert out.returncode == 1 and out.stderr.startswith(f"inmem-ft: error: {error}"), out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert not (runtime / "run" / job).exists()  # refused at the command: no daemon, no log


@pytest.mark.parametrize("args, error", [
    (["--peers", "0=h0"], "--peers: peer entry '0=h0' is not NODE=HOST:PORT"),
    (["--peers", "1=127.0.0.1:7101"], "--node 0 is not in --peers (nodes [1])"),
    (["--node", "2"] + PEERS, "--node 2 is not in --peers (nodes [0, 1])"),
    (PEERS + ["--secret-file", "/nonexistent/secret"], "--secret-file: No such file or directory"),
])
def test_peers_without_parity_are_checked_as_with_it(job, runtime, monkeypatch, args, error):
    monkeypatch.setenv("INMEM_FT_SECRET", SECRET)
    out = cli("smp", "start", "--job", job, "--memory-budget", "64MiB", *args)
    assert out.returncode == 1 and out.stderr.startswith(f"inmem-ft: error: {error}"), out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert not (runtime / "run" / job).exists()


def test_peers_without_parity_reach_the_daemon(job, runtime, monkeypatch):
    """Cross-node reads need the links even with erasure coding off: the SMP asks node 1 (nobody listens
    there) for its snapshots, and says so, where an SMP without links would know of no node 1."""
    monkeypatch.delenv("INMEM_FT_SECRET", raising=False)
    no_secret = cli("smp", "start", "--job", job, "--memory-budget", "64MiB", "--peers", "0=127.0.0.1:0")
    assert no_secret.returncode == 1 and "needs a per-job secret" in no_secret.stderr, no_secret.stderr
    monkeypatch.setenv("INMEM_FT_SECRET", SECRET)
    started = cli("smp", "start", "--job", job, "--memory-budget", "64MiB", "--peers", "0=127.0.0.1:0,1=127.0.0.1:1")
    assert started.returncode == 0, started.stderr
    try:
        out = cli("inspect", "--job", job)
        assert out.returncode == 1 and "unreachable: node 1: " in out.stderr, out.stderr
    finally:
        assert cli("smp", "stop", "--job", job, "--wipe").returncode == 0


@pytest.mark.parametrize("args, error", [
    (["smp", "start", "--memory-budget", "64MiB", "--job", "bad job"], "argument --job: job id 'bad job' must be "
                                                                       "1-64 characters of letters, digits"),
    (["smp", "start", "--memory-budget", "64MiB", "--job", "../x"], "argument --job: job id '../x'"),
    (["smp", "start", "--memory-budget", "64MiB", "--node", "-1"], "argument --node: node id '-1' must be an "
                                                                    "integer >= 0"),
    (["smp", "start", "--memory-budget", "64MiB", "--node", "one"], "argument --node: node id 'one'"),
    (["smp", "stop", "--job", "a/b"], "argument --job: job id 'a/b'"),
    (["smp", "status", "--node", "-3"], "argument --node: node id '-3'"),
    (["smp", "clean", "--job", "bad job"], "argument --job: job id 'bad job'"),
    (["smp", "flush", "--job", "bad job"], "argument --job: job id 'bad job'"),
    (["smp", "flush", "--node", "-1"], "argument --node: node id '-1'"),
    (["smp", "flush", "--timeout", "soon"], "argument --timeout: 'soon' is not a duration"),
    (["smp", "clean", "--all", "--node", "-1"], "argument --node: node id '-1'"),
    (["inspect", "--job", "bad job"], "argument --job: job id 'bad job'"),
    (["export", "--job", "bad job", "--format", "torch-dcp", "--out", "x"], "argument --job: job id 'bad job'"),
    (["launch", "--job", "bad job"], "argument --job: job id 'bad job'"),
])
def test_a_bad_job_or_node_is_one_argparse_line(runtime, args, error):
    out = cli(*args)
    command = " ".join(["inmem-ft", *args[:2]] if args[0] == "smp" else ["inmem-ft", args[0]])
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"{command}: error: {error}"), out.stderr
    assert not (runtime / "run").exists()


def test_a_bad_job_in_the_environment_is_the_same_line(runtime, monkeypatch):
    monkeypatch.setenv("INMEM_FT_JOB", "bad job")
    out = cli("smp", "status")
    assert out.returncode == 2 and out.stderr.startswith("inmem-ft smp status: error: argument --job: job id 'bad job'")


@pytest.mark.parametrize("value", ["0", "-5GiB", "lots"])
def test_a_bad_memory_budget_is_an_argparse_error_naming_the_option(job, runtime, value):
    out = cli("smp", "start", "--job", job, "--memory-budget", value)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("inmem-ft smp start: error: argument --memory-budget: ")
    assert ("must be positive" if value != "lots" else "is not a size") in out.stderr


def test_stop_status_and_wipe_tell_the_truth_across_an_smp_restart(job, runtime):
    started = cli("smp", "start", "--job", job, "--memory-budget", "64MiB")
    assert started.returncode == 0 and "inmem-ft: warning: a memory budget of 64.0 MiB" in started.stderr
    snap = Snapshotter(SnapshotConfig(job=job))
    for step in (1, 2):
        snap.save(step, {"w": torch.full((1000,), float(step)), "step": step})
    snap.close()
    assert cli("smp", "stop", "--job", job).returncode == 0  # keeps the snapshots
    stopped = cli("smp", "stop", "--job", job)
    assert stopped.returncode == 0 and "no SMP is running" in stopped.stdout and "nothing to stop" in stopped.stdout
    # Restarted, before any trainer connects: it knows what it holds.
    assert cli("smp", "start", "--job", job, "--memory-budget", "64MiB").returncode == 0
    status = cli("smp", "status", "--job", job)
    assert "newest step held by every rank of this node: 2" in status.stdout
    # ... and the newest step the job completed, remembered beside the slots across the restart.
    assert "reported complete on every rank of the job: 2" in status.stdout
    assert json.loads(cli("smp", "status", "--job", job, "--json").stdout)["held_step"] == 2
    assert cli("smp", "stop", "--job", job).returncode == 0
    assert len(names_with_prefix(f"inmemft.{job}.")) == 3  # two slots and the record of the complete step
    wiped = cli("smp", "stop", "--job", job, "--wipe")  # no SMP: the segments are freed all the same
    assert wiped.returncode == 0 and f"wiped 3 segment(s) of job {job} node 0" in wiped.stdout
    assert names_with_prefix(f"inmemft.{job}.") == []


def test_every_option_says_what_it_does_and_its_default():
    def parsers(p):
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    for p in parsers(build_parser()):
        for action in p._actions:
            if action.option_strings and action.dest not in ("help", "version"):
                assert action.help, f"{p.prog} {action.option_strings}"
                assert "default" in action.help or "required" in action.help, f"{p.prog} {action.option_strings}"
    out = cli("launch", "--help")
    assert out.returncode == 0 and "(default: inmem_ft_launch)" in out.stdout


def test_survival_replication_row_has_numbers_or_says_why():
    out = cli("survival", "-N", "64", "-G", "4", "-m", "1", "--mtbf-hours", "5000", "--interval-s", "600")
    row = next(line for line in out.stdout.splitlines() if line.startswith("replication"))
    assert "100%" in row and "e-" in row and "years" in row
    assert "one full copy needs 100% extra memory, more than the 33% EC uses here" in out.stdout
    bad = cli("survival", "-N", "10", "-G", "4", "-m", "2", "--mtbf-hours", "5000", "--interval-s", "600")
    assert bad.returncode == 1 and bad.stderr.startswith("inmem-ft: error: ") and "multiple of G" in bad.stderr


def test_version_is_the_package_version():
    import inmem_ft

    out = cli("--version")
    assert out.returncode == 0 and out.stdout == f"inmem-ft {inmem_ft.__version__}\n"
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        assert f"## [{inmem_ft.__version__}]" in f.read()


@pytest.mark.parametrize("command, name, first_line", [
    ("launch-script", "torchrun", "#!/usr/bin/env bash"),
    ("launch-script", "slurm", "#!/usr/bin/env bash"),
    ("example-config", "deepspeed", "{"),
    ("example-config", "megatron", "{"),
])
def test_shipped_files_are_printed_and_found(command, name, first_line):
    out = cli(command, name)
    assert out.returncode == 0 and out.stdout.splitlines()[0] == first_line
    path = cli(command, name, "--path").stdout.strip()
    assert os.path.isfile(path) and open(path).read() == out.stdout
    if command == "example-config":
        assert "inmem_ft" in json.loads(out.stdout)
