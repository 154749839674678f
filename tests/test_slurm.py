"""Issue 14: launch/slurm_inmem.sbatch submitted to a real SLURM (tests/slurm_cluster.py: one controller and
two slurmd "nodes" n0/n1 on this host) exactly as the README shows, with the DeepSpeed GPT example on
2 nodes x 2 ranks, one SMP per node started by the script: a clean run, a rank killed, a lost and
replaced node, a requeue, a preemption."""
import json
import os
import re
import time

import pytest

from conftest import ROOT
from slurm_cluster import SlurmCluster, unavailable
from test_deepspeed_inmem import ENV, INTERVAL, STEPS, example, reference
from test_launch_scripts import Nodes, script_env
from inmem_ft.telemetry import read_losses

STAGE, DTYPE = 2, "fp32"
# The README's command, with the resources of this CPU-only test cluster in place of the #SBATCH defaults.
SBATCH = ["sbatch", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1"]
TIME_LIMIT = "--time=8"  # minutes: a hung job fails the test instead of holding the cluster
SCRIPT = "launch/slurm_inmem.sbatch"


@pytest.fixture(scope="module")
def slurm():
    why = unavailable()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class Job:
    """One test's submissions (all under the test's INMEM_FT_JOB); leaves no SMP or segment behind."""

    def __init__(self, slurm, runtime, job, **env):
        self.slurm, self.runtime, self.job = slurm, runtime, job
        self.env = {**script_env(runtime / "run", job, NPROC_PER_NODE=2, INMEM_FT_MEMORY_BUDGET="256MiB",
                                 **ENV, **env), "SLURM_CONF": slurm.conf}
        self.loss_log = runtime / "loss.jsonl"

    def submit(self, *train_args, wait=False, timeout_s=600) -> str:
        argv = [*SBATCH, TIME_LIMIT, "--parsable", f"--output={self.runtime}/slurm-%j.out", *(["--wait"] if wait else []),
                SCRIPT, *example(STAGE, DTYPE), "--loss-log", str(self.loss_log), *map(str, train_args)]
        proc = self.slurm.run(*argv, env=self.env, cwd=ROOT, timeout_s=timeout_s)
        job_id = proc.stdout.strip().split(";")[0]
        if not job_id.isdigit() or (wait and proc.returncode != 0):
            out = self.output(job_id) if job_id.isdigit() else ""
            raise AssertionError(f"sbatch rc={proc.returncode}: {proc.stderr}\n{out[-6000:]}")
        return job_id

    def output(self, job_id: str) -> str:
        path = self.runtime / f"slurm-{job_id}.out"
        return path.read_text() if path.exists() else ""

    def wait_state(self, job_id: str, states, timeout_s=300) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.slurm.job_field(job_id, "JobState")
            if state in states:
                return state
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not in {states} within {timeout_s} s (it is "
                             f"{self.slurm.job_field(job_id, 'JobState')}):\n{self.output(job_id)[-6000:]}")

    def wait_for(self, job_id: str, pattern: str, timeout_s=300) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = re.search(pattern, self.output(job_id))
            if m:
                return m
            time.sleep(0.5)
        raise AssertionError(f"job {job_id}: no {pattern!r} within {timeout_s} s:\n{self.output(job_id)[-6000:]}")

    def cleanup(self):
        Nodes(self.runtime / "run", self.job).cleanup()


@pytest.fixture
def submit(slurm, runtime, job):
    jobs = []

    def make(**env):
        jobs.append(Job(slurm, runtime, job, **env))
        return jobs[-1]
    yield make
    for j in jobs:
        j.cleanup()


def steps_run(loss_log) -> list[int]:
    return [json.loads(line)["step"] for line in open(loss_log)]


def test_clean_run_ends_with_the_uninterrupted_losses(slurm, submit, tmp_path_factory):
    ref = reference(STAGE, DTYPE, tmp_path_factory)
    j = submit()
    job_id = j.submit(wait=True)
    out = j.output(job_id)
    assert f"[inmem_ft] sbatch job={j.job} slurm_job={job_id} nodes=2 nodelist=n[0-1] master=127.0.0.1:" in out
    for node in (0, 1):
        assert f"[inmem_ft] launch node={node} event=smp_started" in out
        assert f"[inmem_ft] launch node={node} event=torchrun_exit rc=0" in out
        assert f"[inmem_ft] launch node={node} event=smp_stopped wiped=0" in out
    assert "source=none: starting from scratch" in out
    assert read_losses(j.loss_log) == ref
    assert steps_run(j.loss_log) == list(range(1, STEPS + 1))


def test_rank_killed_recovers_from_memory_with_the_same_losses(slurm, submit, tmp_path_factory):
    ref = reference(STAGE, DTYPE, tmp_path_factory)
    j = submit()
    job_id = j.submit("--die-at", 7, "--die-rank", 3, wait=True)
    out = j.output(job_id)
    assert "exitcode: -9" in out  # torchrun saw the SIGKILLed rank
    for rank in range(4):
        assert f"restore rank={rank} step=6 source=memory" in out
    steps = steps_run(j.loss_log)
    assert steps == list(range(1, 8)) + list(range(7, STEPS + 1))
    assert read_losses(j.loss_log) == ref
