"""Issue 37: transformers.Trainer with DeepSpeed (2 ranks, CPU, gloo, a tiny GPT-2 from a config) protected by
`install(trainer)`: kill -9 one rank mid-epoch, restart, and every later step's loss, learning rate and grad norm,
and the Trainer's log_history (its logging counters span the restore), equal an uninterrupted run's; the
"inmem_ft" block without install() says so once; "auto" in the block is refused before accelerate sees it."""
import json
import os
import subprocess
import sys

import pytest

from conftest import wait_for_log
from inmem_ft.config import InmemFTBlock
from inmem_ft.errors import ConfigError
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.telemetry import Tail

pytest.importorskip("transformers")
ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cluster(job, runtime):
    with SimulatedCluster(1, 2, job, 256 << 20, str(runtime / "logs"), env=ENV) as c:  # one node, 2 ranks
        yield c


def steps(path) -> dict:
    return {r["step"]: (r["loss"], r["lr"], r["grad_norm"]) for r in Tail(str(path)).records()}


def history(path) -> list:
    timing = ("train_runtime", "train_samples_per_second", "train_steps_per_second")
    return [{k: v for k, v in entry.items() if k not in timing} for entry in json.load(open(f"{path}.history"))]


def run_example(cluster, example, out, *extra):
    return cluster.run(["-m", f"inmem_ft.examples.{example}", "--out", str(out), *map(str, extra)])


def resume_after_kill(cluster, runtime, example, die_at, first_expected, *extra, between=None, source="memory"):
    """A reference run without inmem_ft, a run whose rank 1 is killed after step `die_at`, and the restart:
    every step of the restart (from `first_expected` on) equal to the reference's. Returns both loss logs."""
    ref = runtime / "ref.jsonl"
    attempt = run_example(cluster, example, ref, "--no-inmem", *extra)
    assert attempt.ok, cluster.rank_log(attempt.number, 0)[-4000:]
    attempt = run_example(cluster, example, runtime / "killed.jsonl", "--die-at", die_at, "--die-rank", 1, *extra)
    assert not attempt.ok and attempt.returncodes[1] == -9, cluster.rank_log(attempt.number, 0)[-4000:]
    if between is not None:
        between()
    resumed = runtime / "resumed.jsonl"
    attempt = run_example(cluster, example, resumed, *extra)
    assert attempt.ok, cluster.rank_log(attempt.number, 0)[-4000:]
    assert f"step={first_expected - 1} source={source}" in cluster.rank_log(attempt.number, 1)
    got, want = steps(resumed), steps(ref)
    assert min(got) == first_expected, "resumed from an unexpected step"
    assert got == {s: v for s, v in want.items() if s >= first_expected}  # bit-identical
    return resumed, ref


def kill_and_resume(cluster, runtime, die_at, first_expected, *extra, between=None, source="memory"):
    """The Trainer's: its log_history (logging counters across the restore) equal too."""
    resumed, ref = resume_after_kill(cluster, runtime, "hf_trainer", die_at, first_expected, *extra,
                                     between=between, source=source)
    assert history(resumed) == history(ref)


def test_trainer_zero2_kill_one_rank_resumes_bit_identical(cluster, runtime):
    # interval 4, logged every 3 steps: the restored step 8 lies inside the logging window 7-9
    kill_and_resume(cluster, runtime, 10, 9, "--zero-stage", 2, "--steps", 12, "--interval", 4)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [("--zero-stage", 3), ("--hf-optimizer",), ("--accumulation", 2)],
                         ids=["zero3", "hf-optimizer", "accumulation2"])
def test_trainer_variants_resume_bit_identical(cluster, runtime, extra):
    kill_and_resume(cluster, runtime, 10, 9, "--steps", 12, "--interval", 4, *extra)


@pytest.mark.slow
def test_trainer_restore_past_the_first_epoch(cluster, runtime):
    # 16 steps an epoch (64 samples, 2 ranks x 2): step 20 is in epoch 2 of 3
    kill_and_resume(cluster, runtime, 22, 21, "--steps", 0, "--epochs", 3, "--interval", 4)


@pytest.mark.slow
def test_trainer_restore_from_the_disk_tier(job, runtime):
    """The SMP flushes every 8th step; after the kill its memory is wiped: step 8 comes back from disk."""
    smp_args = ["--persist-dir", runtime / "disk", "--persist-every-steps", 8, "--persist-keep", 2]
    with SimulatedCluster(1, 2, job, 256 << 20, str(runtime / "logs"), env=ENV, smp_args=smp_args) as cluster:
        def memory_gone():
            wait_for_log(cluster.smp_log(0), "event=flushed step=8 ")
            cluster.kill_smp(0)
            cluster.wipe_node(0)
            cluster.start_smp(0)

        kill_and_resume(cluster, runtime, 10, 9, "--steps", 12, "--interval", 4, between=memory_gone, source="disk")


def test_the_block_without_install_says_so_once_on_rank_0(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(
        "import inmem_ft, torch, deepspeed\n"
        "from inmem_ft.integrations.deepspeed import cpu_setup\n"
        "inmem_ft.log_to_stderr(); cpu_setup(); deepspeed.init_distributed(dist_backend='gloo')\n"
        "m = torch.nn.Linear(4, 4)\n"
        "cfg = {'train_micro_batch_size_per_gpu': 1, 'zero_optimization': {'stage': 2}, 'inmem_ft': {'interval': 2},\n"
        "       'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3, 'torch_adam': True}}}\n"
        "e, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)\n"
        "for _ in range(3):\n"
        "    e.backward(e(torch.ones(1, 4)).sum()); e.step()\n"
        "torch.distributed.destroy_process_group()\n")
    env = {**os.environ, **ENV, "PYTHONPATH": ROOT, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if "nothing installed it on this engine" in line]
    assert len(said) == 1 and "inmem_ft.integrations.huggingface.install(trainer)" in said[0]


def test_auto_in_the_block_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"\['interval'\] = \"auto\": nothing fills inmem_ft's values"):
        InmemFTBlock.from_dict({"interval": "auto"})
    assert InmemFTBlock.from_dict({"reshard": "auto"}).reshard == "auto"  # its own value


@pytest.mark.slow
def test_accelerate_loop_kill_one_rank_resumes_bit_identical(cluster, runtime):
    resume_after_kill(cluster, runtime, "hf_accelerate", 10, 9)
