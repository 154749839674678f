"""Issue 4's acceptance: real DeepSpeed engines (CPU, gloo) on 2 simulated nodes x 2 ranks protected by
inmem_ft through `install(engine)`: kill -9 a rank, restart, resume from memory bit-identically; the disk
tier loads in plain DeepSpeed exactly; memory gone -> disk; memory newer than disk -> memory; bad config."""
import json
import os

import pytest

from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.telemetry import read_losses

STEPS, INTERVAL = 12, 2
ENV = {"DS_ACCELERATOR": "cpu"}


def example(stage, dtype, steps=STEPS, *extra):
    return ["-m", "inmem_ft.examples.deepspeed_gpt", "--zero-stage", str(stage), "--dtype", dtype,
            "--steps", str(steps), "--interval", str(INTERVAL), *map(str, extra)]


_REFERENCES = {}


def reference(stage, dtype, tmp_path_factory):
    """The uninterrupted run's losses (no SMP snapshots matter for them), one job per (stage, dtype)."""
    if (stage, dtype) not in _REFERENCES:
        tmp = tmp_path_factory.mktemp(f"ref{stage}{dtype}")
        old = os.environ.get("INMEM_FT_RUNTIME_DIR")
        os.environ["INMEM_FT_RUNTIME_DIR"] = str(tmp / "run")
        try:
            with SimulatedCluster(2, 2, f"ref{stage}{dtype}", 256 << 20, str(tmp / "logs"), env=ENV) as c:
                attempt = c.run(example(stage, dtype) + ["--loss-log", str(tmp / "loss.jsonl")])
                assert attempt.ok, c.rank_log(attempt.number, attempt.first_failure or 0)[-4000:]
        finally:
            if old is None:
                del os.environ["INMEM_FT_RUNTIME_DIR"]
            else:
                os.environ["INMEM_FT_RUNTIME_DIR"] = old
        losses = read_losses(tmp / "loss.jsonl")
        assert sorted(losses) == list(range(1, STEPS + 1))
        _REFERENCES[stage, dtype] = losses
    return _REFERENCES[stage, dtype]


@pytest.fixture
def cluster(job, runtime):
    c = SimulatedCluster(2, 2, job, 256 << 20, str(runtime / "logs"), env=ENV)
    c.start()
    yield c
    c.stop()


def run_ok(cluster, argv):
    attempt = cluster.run([str(a) for a in argv])
    assert attempt.ok, cluster.rank_log(attempt.number, attempt.first_failure or 0)[-4000:]
    return attempt


def crash_and_resume(cluster, runtime, ref, stage, dtype, die_at, die_rank, first_expected, extra=()):
    before = runtime / "before.jsonl"
    attempt = cluster.run([str(a) for a in example(stage, dtype, STEPS, *extra) + [
        "--loss-log", before, "--die-at", die_at, "--die-rank", die_rank]])
    assert not attempt.ok and attempt.returncodes[die_rank] == -9
    assert all(loss == ref[s] for s, loss in read_losses(before).items())
    log = runtime / "resumed.jsonl"
    attempt = run_ok(cluster, example(stage, dtype, STEPS, *extra) + ["--loss-log", log])
    resumed = read_losses(log)
    assert min(resumed) == first_expected, "resumed from an unexpected step"
    assert resumed == {s: ref[s] for s in range(first_expected, STEPS + 1)}  # bit-identical
    return attempt


def digests(prefix, world=4):
    return [json.loads(open(f"{prefix}.rank{r}").read()) for r in range(world)]


# ZeRO-2 fp32's kill/resume from memory is part of the disk-tier test below; the rest is marked slow.
@pytest.mark.parametrize("stage,dtype", [(3, "bf16")])
def test_kill_rank_resumes_from_memory_bit_identical(cluster, runtime, tmp_path_factory, stage, dtype):
    ref = reference(stage, dtype, tmp_path_factory)
    attempt = crash_and_resume(cluster, runtime, ref, stage, dtype, die_at=7, die_rank=3, first_expected=7)
    assert "step=6 source=memory" in cluster.rank_log(attempt.number, 2)


def test_disk_tier_memory_wins_then_disk_then_plain_deepspeed(cluster, runtime, tmp_path_factory):
    """persist_every=2 with interval 2: disk holds steps 4, 8, 12; memory every even step."""
    stage, dtype = 2, "fp32"
    ref = reference(stage, dtype, tmp_path_factory)
    disk = runtime / "ckpt"
    persist = ["--persist-dir", disk, "--persist-every", 2]
    # Killed after step 7: memory holds 6, disk 4 -> memory wins.
    attempt = crash_and_resume(cluster, runtime, ref, stage, dtype, die_at=7, die_rank=1, first_expected=7,
                               extra=persist)
    assert "step=6 source=memory" in cluster.rank_log(attempt.number, 0)
    assert (disk / "latest").read_text() == "global_step12"
    assert not list(disk.rglob("*.tmp")), "a finished flush leaves no temporary files"
    assert sorted(p.name for p in (disk / "global_step12").iterdir()) == [
        "inmem_ft_rank0.state", "inmem_ft_rank1.state", "inmem_ft_rank2.state", "inmem_ft_rank3.state",
        "mp_rank_00_model_states.pt", *[f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)]]

    # Memory gone on every node: the restart comes from disk (step 12 of 12, so it only loads).
    for node in range(cluster.nodes):
        cluster.kill_smp(node)
        cluster.wipe_node(node)
        cluster.start_smp(node)
    attempt = run_ok(cluster, example(stage, dtype, STEPS, *persist, "--dump-state", runtime / "disk"))
    assert "step=12 source=disk" in cluster.rank_log(attempt.number, 0)
    # Plain DeepSpeed (no inmem_ft block, no install) loads the same directory to the same state, exactly.
    run_ok(cluster, example(stage, dtype, STEPS, "--no-inmem", "--load-dir", disk, "--dump-state",
                            runtime / "plain"))
    inmem, plain = digests(runtime / "disk"), digests(runtime / "plain")
    assert [d["step"] for d in plain] == [12] * 4
    assert inmem == plain


def test_bad_config_is_a_clear_error():
    from inmem_ft.config import InmemFTBlock
    from inmem_ft.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['intervall'\]; known keys are"):
        InmemFTBlock.from_framework_config({"inmem_ft": {"intervall": 5}})
    for block, key in [({"interval": 0}, "interval"), ({"persist_every": 3}, "persist_every"),
                       ({"memory_budget": "lots"}, "memory_budget"), ({"parity": 2}, "parity"),
                       ({"group_size": 0}, "group_size"), ({"on_error": "ignore"}, "on_error"),
                       ({"enabled": "yes"}, "enabled")]:
        with pytest.raises(ConfigError, match=f"'{key}'"):
            InmemFTBlock.from_framework_config({"inmem_ft": block})
    assert InmemFTBlock.from_framework_config({"zero_optimization": {}}) is None
    cfg = InmemFTBlock.from_dict({"interval": 7, "persist_dir": "/x", "persist_every": 2})
    assert cfg.persist and cfg.snapshot_config().interval == 7


@pytest.mark.slow
@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16"),
                                         (1, "bf16"), (2, "bf16")])
def test_resume_matrix(cluster, runtime, tmp_path_factory, stage, dtype):
    ref = reference(stage, dtype, tmp_path_factory)
    crash_and_resume(cluster, runtime, ref, stage, dtype, die_at=9, die_rank=0, first_expected=9)
