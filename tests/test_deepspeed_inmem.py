"""Issue 4's acceptance: real DeepSpeed engines (CPU, gloo) on 2 simulated nodes x 2 ranks protected by
inmem_ft through `install(engine)`: kill -9 a rank, restart, resume from memory bit-identically; the SMPs' disk
tier when memory is gone, bit-identically; an explicit save_checkpoint loads in plain DeepSpeed exactly; bad config."""
import json
import os

import pytest

from conftest import flip_in_largest_region, wait_for_log
from inmem_ft.capture.verdict import SMALL
from inmem_ft.examples.corrupt import CORRUPT_AT
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp import control
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
            with SimulatedCluster(2, 2, f"ref{stage}{dtype}{os.getpid()}", 256 << 20, str(tmp / "logs"), env=ENV) as c:
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


# ZeRO-3 bf16's kill/resume is the first half of the flipped-byte test below (which resumes one step older),
# ZeRO-2 fp32's part of the disk-tier test; this and the rest are marked slow.
@pytest.mark.slow
@pytest.mark.compat
@pytest.mark.parametrize("stage,dtype", [(3, "bf16")])
def test_kill_rank_resumes_from_memory_bit_identical(cluster, runtime, tmp_path_factory, stage, dtype):
    ref = reference(stage, dtype, tmp_path_factory)
    attempt = crash_and_resume(cluster, runtime, ref, stage, dtype, die_at=7, die_rank=3, first_expected=7)
    assert "step=6 source=memory" in cluster.rank_log(attempt.number, 2)


def test_a_byte_flipped_in_the_restored_step_stops_every_rank_before_its_step_and_a_restart_resumes_older(
        cluster, runtime, tmp_path_factory):
    """A rank is killed after step 7 (steps 4 and 6 complete), then a byte of rank 2's slot of step 6 goes bad.
    The restore hands DeepSpeed views of step 6 and checks its large regions behind the load and the first
    forward/backward: every rank stops at the first step's fence with the same error (no step, no loss, no
    snapshot of that state), the SMP discards that slot, and the next restart resumes from step 4
    bit-identically."""
    stage, dtype = 3, "bf16"
    ref = reference(stage, dtype, tmp_path_factory)
    before = runtime / "before.jsonl"
    attempt = cluster.run([str(a) for a in example(stage, dtype, STEPS, "--loss-log", before, "--die-at", 7,
                                                   "--die-rank", 3)])
    assert not attempt.ok and attempt.returncodes[3] == -9
    assert read_losses(before) == {s: ref[s] for s in range(1, 8)}
    newest = control.call(cluster.socket_path(1), "list", rank=2)["slots"][0]
    assert newest["step"] == 6
    assert flip_in_largest_region(newest["segment"]) >= SMALL

    failed = runtime / "failed.jsonl"
    attempt = cluster.run([str(a) for a in example(stage, dtype, STEPS, "--loss-log", failed)])
    assert not attempt.ok
    assert read_losses(failed) == {}, "a step ran on the unverified state"
    for rank in range(cluster.world_size):
        log = cluster.rank_log(attempt.number, rank)
        assert "step=6 source=memory" in log and "event=committed" not in log
        if attempt.returncodes[rank] != -9:  # the first rank to exit brings down the others (as torchrun does)
            assert "RestoreCorrupt: step 6, restored from memory, failed" in log and "Nothing was lost" in log
    assert "restore rank=2 step=6 event=corrupt" in cluster.rank_log(attempt.number, 2)
    assert "event=corrupt rank=2 step=6 " in open(cluster.smp_log(1)).read()

    resumed = runtime / "resumed.jsonl"
    attempt = run_ok(cluster, example(stage, dtype, STEPS, "--loss-log", resumed))
    assert "step=4 source=memory" in cluster.rank_log(attempt.number, 2)
    assert "event=verified" in cluster.rank_log(attempt.number, 2)
    assert read_losses(resumed) == {s: ref[s] for s in range(5, STEPS + 1)}  # bit-identical


def test_a_restored_state_that_goes_nan_rolls_back_by_itself_to_the_older_snapshot_bit_identical(job, runtime):
    """Issue 40: 2 ranks on 2 nodes, ZeRO-2. Right before the snapshot of step 6 the example makes one Adam second
    moment negative, so the snapshot's checksums cover the bad bytes; a rank is killed after step 6. The restart
    restores step 6, trains step 7 (its update is NaN), and the sentinel trips on step 8's loss: every rank stops
    with one line and step 6 is marked bad on both SMPs. The next restart, without a person, restores step 4 (6 is
    never listed again) and matches the uninterrupted run from there bit-identically."""
    steps, bad = 8, 6
    argv = example(2, "fp32", steps)
    with SimulatedCluster(2, 1, job, 256 << 20, str(runtime / "logs"), env=ENV) as cluster:
        ref = runtime / "ref.jsonl"
        run_ok(cluster, argv + ["--no-inmem", "--loss-log", ref])
        ref = read_losses(ref)
        before = runtime / "before.jsonl"
        attempt = cluster.run(argv + ["--loss-log", str(before), "--die-at", str(bad), "--die-rank", "1"],
                              extra_env={CORRUPT_AT: str(bad)})
        assert not attempt.ok and attempt.returncodes[1] == -9
        assert read_losses(before) == {s: ref[s] for s in range(1, bad + 1)}

        tripped = runtime / "tripped.jsonl"
        attempt = cluster.run(argv + ["--loss-log", str(tripped)])
        assert not attempt.ok
        assert read_losses(tripped) == {bad + 1: ref[bad + 1]}  # the restored state's first step is still good
        said = [line for r in range(2) for line in cluster.rank_log(attempt.number, r).splitlines()
                if line.startswith("RestoredStateBad: ")]
        assert said and all(f"after the restore from step {bad}:" in line for line in said), said
        assert any(f"step {bad + 2} after the restore from step {bad}: loss nan" in line for line in said), said
        for node in range(cluster.nodes):
            assert control.call(cluster.socket_path(node), "status")["bad_steps"] == [bad]
            assert [s["step"] for s in control.call(cluster.socket_path(node), "list", rank=node)["slots"]] == [4]

        resumed = runtime / "resumed.jsonl"
        attempt = run_ok(cluster, argv + ["--loss-log", resumed])
        assert f"step={bad - INTERVAL} source=memory" in cluster.rank_log(attempt.number, 0)
        assert read_losses(resumed) == {s: ref[s] for s in range(bad - INTERVAL + 1, steps + 1)}  # bit-identical


@pytest.mark.compat
def test_smp_flushes_the_disk_tier_and_memory_gone_resumes_from_it_bit_identical(job, runtime, tmp_path_factory):
    """The SMPs flush every 4th step (persist_every_steps 4, twice the interval), keeping 2; the trainers write nothing. A rank
    is killed right after step 8 completed (its flush is the SMPs' business); then every node's memory is wiped:
    the resume comes from disk at step 8, bit-identical. An explicit save_checkpoint(dir) at the end writes a
    stock checkpoint that plain DeepSpeed loads to exactly the state inmem_ft restores."""
    stage, dtype = 2, "fp32"
    ref = reference(stage, dtype, tmp_path_factory)
    disk = runtime / "disk"
    smp_args = ["--persist-dir", disk, "--persist-every-steps", 2 * INTERVAL, "--persist-keep", 2]
    with SimulatedCluster(2, 2, job, 256 << 20, str(runtime / "logs"), env=ENV, smp_args=smp_args) as cluster:
        before = runtime / "before.jsonl"
        attempt = cluster.run(example(stage, dtype, STEPS, "--loss-log", before, "--die-at", 9, "--die-rank", 1))
        assert not attempt.ok and attempt.returncodes[1] == -9
        for node in range(cluster.nodes):  # what the trainers did not wait for, their SMPs finish
            wait_for_log(cluster.smp_log(node), "event=flushed step=8 ")
            cluster.kill_smp(node)
            cluster.wipe_node(node)
        assert not list(disk.rglob("*.tmp")), "a finished flush leaves no temporary files"
        for node in range(cluster.nodes):
            cluster.start_smp(node)
        resumed, stock = runtime / "resumed.jsonl", runtime / "stock"
        attempt = run_ok(cluster, example(stage, dtype, STEPS, "--loss-log", resumed, "--save-dir", stock))
        assert "step=8 source=disk" in cluster.rank_log(attempt.number, 0)
        assert read_losses(resumed) == {s: ref[s] for s in range(9, STEPS + 1)}  # bit-identical
        for node in range(cluster.nodes):
            wait_for_log(cluster.smp_log(node), "event=flushed step=12 ")
            log = open(cluster.smp_log(node)).read()
            assert "event=flushed step=4 " in log and "event=flushed step=6 " not in log
            # Steps 4, 8 and 12 were flushed; 8 and 12 are kept (persist_keep 2), each of this node's two ranks.
            slots = [f"r{r}.step{s}.slot" for r in (2 * node, 2 * node + 1) for s in (8, 12)]
            assert sorted(os.listdir(disk / job / f"node{node}")) == sorted(slots + ["step8.done", "step12.done"])
        assert json.loads((disk / job / "latest").read_text()) == {"step": 12}
        for r in range(cluster.world_size):  # the disk tier is the SMPs' job: no trainer says a word of it
            # (inmem_ft's lines only: DeepSpeed 0.16 prints its config, whose nebula block has persistent_* keys)
            said = [line for line in cluster.rank_log(attempt.number, r).splitlines() if "[inmem_ft]" in line]
            assert said and not [line for line in said if "persist" in line]

        # The explicit save: stock DeepSpeed's layout and `latest`, loadable without inmem_ft, to the same state.
        assert (stock / "latest").read_text() == "global_step12"
        assert "mp_rank_00_model_states.pt" in os.listdir(stock / "global_step12")
        # (A fresh ZeRO-2 engine links its optimizer state only at its first step: the states are compared as
        # digests right after each load, the saved one as inmem_ft restores step 12 from memory.)
        run_ok(cluster, example(stage, dtype, STEPS, "--dump-state", runtime / "inmem"))
        run_ok(cluster, example(stage, dtype, STEPS, "--no-inmem", "--load-dir", stock, "--dump-state",
                                runtime / "plain"))
        inmem, plain = digests(runtime / "inmem"), digests(runtime / "plain")
        assert [d["step"] for d in plain] == [12] * 4
        assert inmem == plain


def test_bad_config_is_a_clear_error():
    from inmem_ft.config import InmemFTBlock
    from inmem_ft.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['intervall'\]; known keys are"):
        InmemFTBlock.from_framework_config({"inmem_ft": {"intervall": 5}})
    for block, key in [({"interval": 0}, "interval"), ({"persist_every_steps": 3}, "persist_every_steps"),
                       ({"persist_dir": "/x", "persist_keep": 0}, "persist_keep"),
                       ({"memory_budget": "lots"}, "memory_budget"), ({"parity": 2}, "parity"),
                       ({"group_size": 0}, "group_size"), ({"on_error": "ignore"}, "on_error"),
                       ({"enabled": "yes"}, "enabled")]:
        with pytest.raises(ConfigError, match=f"'{key}'"):
            InmemFTBlock.from_framework_config({"inmem_ft": block})
    assert InmemFTBlock.from_framework_config({"zero_optimization": {}}) is None
    cfg = InmemFTBlock.from_dict({"interval": 7, "persist_dir": "/x", "persist_every_steps": 14})
    assert cfg.persist and cfg.snapshot_config().interval == 7


@pytest.mark.slow
@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16"),
                                         (1, "bf16"), (2, "bf16")])
def test_resume_matrix(cluster, runtime, tmp_path_factory, stage, dtype):
    ref = reference(stage, dtype, tmp_path_factory)
    crash_and_resume(cluster, runtime, ref, stage, dtype, die_at=9, die_rank=0, first_expected=9)
