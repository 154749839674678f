"""The `inmem-ft` command as an operator uses it: start an SMP from the DeepSpeed config, read its status,
stop it; and the errors when the config cannot serve."""
import json
import subprocess
import sys


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
        assert "64.0 MiB budget" in status.stdout and "complete on every rank: None" in status.stdout
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
