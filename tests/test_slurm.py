"""Issue 14: launch/slurm_inmem.sbatch submitted to a real SLURM (tests/slurm_cluster.py: one controller and
two slurmd "nodes" n0/n1 on this host) exactly as docs/launch.md shows, with the DeepSpeed GPT example on
2 nodes x 2 ranks, one SMP per node started by the script: a clean run, a rank killed, a lost and
replaced node, a requeue, a preemption."""
import json
import os
import re
import signal
import sys
import time
import warnings

import pytest

from conftest import ROOT
from slurm_cluster import NODES, SlurmCluster, unavailable
from test_deepspeed_inmem import ENV, INTERVAL, STEPS, example, reference
from inmem_ft.launcher.ports import free_port
from test_launch_scripts import Nodes, script_env
from inmem_ft.errors import SMPUnavailable
from inmem_ft.smp import control
from inmem_ft.smp.segments import names_with_prefix, unlink
from inmem_ft.telemetry import read_losses

STAGE, DTYPE = 2, "fp32"
# The README's command, with the resources of this CPU-only test cluster in place of the #SBATCH defaults.
SBATCH = ["sbatch", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1"]
TIME_LIMIT = "--time=8"  # minutes: a hung job fails the test instead of holding the cluster
SCRIPT = "launch/slurm_inmem.sbatch"


@pytest.fixture(scope="module")
def slurm(request, tmp_path_factory):
    why = unavailable()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster()
    failed = request.session.testsfailed
    try:
        cluster.start()
        yield cluster
    finally:
        # A failure's story is in the daemons' logs: they outlive the cluster in pytest's tmp dirs.
        logs = tmp_path_factory.mktemp("slurm-logs")
        cluster.stop(keep_logs=str(logs))
        if sys.exc_info()[0] is not None or request.session.testsfailed > failed:
            warnings.warn(f"the SLURM daemons' logs are kept in {logs}")


class Job:
    """One test's submissions (all under the test's INMEM_FT_JOB); leaves no SMP or segment behind."""

    def __init__(self, slurm, runtime, job, **env):
        self.slurm, self.runtime, self.job = slurm, runtime, job
        self.env = {**script_env(runtime / "run", job, NPROC_PER_NODE=2, INMEM_FT_MEMORY_BUDGET="256MiB",
                                 **ENV, **env), "SLURM_CONF": slurm.conf}
        self.loss_log = runtime / "loss.jsonl"

    def submit(self, *train_args, wait=False, steps=STEPS, loss_log=None, timeout_s=600) -> str:
        argv = [*SBATCH, TIME_LIMIT, "--parsable", f"--output={self.runtime}/slurm-%j.out",
                *(["--wait"] if wait else []), SCRIPT, *example(STAGE, DTYPE, steps),
                "--loss-log", str(loss_log or self.loss_log), *map(str, train_args)]
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
        assert f"[inmem_ft] launch node={node} event=smp_stopped wiped=1 reason=finished" in out
    assert "source=none: starting from scratch" in out
    assert read_losses(j.loss_log) == ref
    assert steps_run(j.loss_log) == list(range(1, STEPS + 1))


def test_rank_killed_recovers_from_memory_with_the_same_losses(slurm, submit, tmp_path_factory):
    ref = reference(STAGE, DTYPE, tmp_path_factory)
    j = submit()
    job_id = j.submit("--die-at", 7, "--die-rank", 3, wait=True)
    out = j.output(job_id)
    assert "exitcode: -9" in out  # torch's agent saw the SIGKILLed rank
    for rank in range(4):
        assert f"restore rank={rank} step=6 source=memory" in out
    # Each node's agent (inmem-ft run) reported what the failure cost it, every part measured.
    for node in (0, 1):
        lost = re.search(rf"\[inmem_ft\] agent node={node} event=time_lost failure=\"([^\"]*)\" ([\d.]+) s lost: (.*)",
                         out)
        assert lost and "not measured" not in lost.group(3), out
    steps = steps_run(j.loss_log)
    assert steps == list(range(1, 8)) + list(range(7, STEPS + 1))
    assert read_losses(j.loss_log) == ref


LONG = 60  # steps of the jobs stopped from outside: long enough that the stop comes mid-training
LONG_EC = 300  # with time for the EC group to protect a step, and for SLURM to notice a lost node
# slurmctld retries a refused connection once a second, min(MessageTimeout, 10) = 10 times (its default
# MessageTimeout), so an RPC to a dead node's address can land up to ~10 s after it was sent; 2 s of margin.
STALE_KILL_S = 12


def wait_step(loss_log, step, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(loss_log) and max(read_losses(loss_log), default=0) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"{loss_log}: step {step} not reached within {timeout_s} s")


def logged(loss_log) -> list[tuple[int, float]]:
    """(step, loss) in the order the loss log got them, across restarts."""
    return [(rec["step"], rec["loss"]) for rec in map(json.loads, open(loss_log))]


def assert_resumed_exactly(first: dict, second: dict, step: int, last: int = LONG) -> None:
    """The second allocation ran step+1..last, and every step both ran has the very same loss."""
    assert step >= 8 and step % INTERVAL == 0
    assert sorted(second) == list(range(step + 1, last + 1))
    assert {s: second[s] for s in first if s > step} == {s: first[s] for s in first if s > step}


def spilled(spill_dir, job) -> dict[int, set[tuple[int, int]]]:
    """node -> (rank, step) of each of that node's spill files."""
    base = spill_dir / job
    return {int(d.name[4:]): {(int(r), int(s)) for f in d.iterdir()
                              for r, s in re.findall(r"^r(\d+)\.step(\d+)\.slot$", f.name)}
            for d in sorted(base.glob("node*"))}


def smp_log(runtime, job, node) -> str:
    return (runtime / "run" / job / f"node{node}.log").read_text()


def assert_batch_outlived_its_step(slurm, job_id, nodes=NODES):
    """The first attempt's batch script ended only after its step's tasks (it waits for srun, which waits for
    them): nothing of that attempt was left to signal step 0 of the next one."""
    batch = slurm.task_exits(slurm.job_field(job_id, "BatchHost"), job_id, "batch")[0]
    assert all(slurm.task_exits(node, job_id, "0")[0] <= batch for node in nodes), (job_id, batch)


def wipe_memory(job):
    """What a reboot or another job's cleanup does to the nodes' shared memory."""
    for seg in names_with_prefix(f"inmemft.{job}."):
        unlink(seg)


@pytest.mark.slow
def test_preemption_spills_the_newest_complete_step_and_a_new_job_resumes_from_it(slurm, submit, runtime):
    spill = runtime / "spill"
    j = submit(INMEM_FT_PERSIST_DIR=spill)
    first = j.submit(steps=LONG)
    wait_step(j.loss_log, 8)
    assert slurm.run("scancel", first).returncode == 0  # SIGTERM now, SIGKILL after the grace time
    j.wait_state(first, {"CANCELLED"})
    out = j.wait_for(first, r"(?s)(event=smp_stopped.*){2}").string  # the state changes first
    for node in (0, 1):
        assert f"[inmem_ft] launch node={node} event=signal sig=TERM" in out
        assert re.search(f"launch node={node} event=smp_stopped wiped=0 by=SIGTERM", out), out[-4000:]
    held = spilled(spill, j.job)
    logs = {node: smp_log(runtime, j.job, node) for node in (0, 1)}
    for node in (0, 1):
        # What each SMP says it spilled is what lies on disk, and only what its ranks committed.
        [(steps, files)] = re.findall(r"event=spill steps=([\d,]+) files=(\d+)", logs[node])
        assert {s for _, s in held[node]} == set(map(int, steps.split(","))) and int(files) == len(held[node])
        assert {r for r, _ in held[node]} == {2 * node, 2 * node + 1}
        assert held[node] <= {(int(r), int(s)) for r, s in re.findall(r"event=commit rank=(\d+) step=(\d+)",
                                                                        logs[node])}
    by_rank = {rank: {s for n in (0, 1) for r, s in held[n] if r == rank} for rank in range(4)}
    step = max(set.intersection(*by_rank.values()))  # the newest step spilled for every rank: the one to resume
    # No older than the newest step the trainers saw complete before the SIGTERM.
    complete = {int(s) for s in re.findall(r"step=(\d+) event=committed complete=True", out)}
    assert step >= max(complete)
    # SIGTERM may land while a step is being committed: then a newer step, never complete, is spilled for
    # some ranks only.
    partial = {(rank, s) for rank, steps in by_rank.items() for s in steps if s > step}
    assert not {s for _, s in partial} & complete
    before = read_losses(j.loss_log)

    wipe_memory(j.job)  # the nodes go to the preempting job: nothing of ours stays in memory
    resumed_log = runtime / "resumed.jsonl"
    second = j.submit(steps=LONG, loss_log=resumed_log, wait=True)
    out = j.output(second)
    for rank in range(4):
        assert f"restore rank={rank} step={step} source=disk" in out
    for node in (0, 1):
        log = smp_log(runtime, j.job, node)[len(logs[node]):]
        # Every spilled slot is taken back; one of a step newer than the resumed one is then given up.
        assert {(int(r), int(s)) for r, s in re.findall(r"event=adopt rank=(\d+) slot=\d+ step=(\d+) from=disk",
                                                          log)} == held[node]
        for rank, s in partial:
            if rank // 2 == node:
                assert f"event=discard rank={rank} step={s} reason=job resumed from step {step}" in log
    assert_resumed_exactly(before, read_losses(resumed_log), step)
    assert_batch_outlived_its_step(slurm, first)


@pytest.mark.slow
@pytest.mark.parametrize("memory", ["kept", "wiped"])
def test_requeue_restores_from_the_smps_that_outlived_the_allocation_or_from_disk(slurm, submit, runtime, memory):
    j = submit(INMEM_FT_PERSIST_DIR=runtime / "spill")
    job_id = j.submit(steps=LONG)
    wait_step(j.loss_log, 8)
    # Wiped: held while the first allocation's memory is lost, then let go.
    assert slurm.run("scontrol", "requeue" if memory == "kept" else "requeuehold", job_id).returncode == 0
    j.wait_state(job_id, {"PENDING"})
    j.wait_for(job_id, r"(?s)(event=smp_stopped.*){2}")
    before = len(logged(j.loss_log))  # the first allocation's trainers are gone
    if memory == "wiped":
        wipe_memory(j.job)
    # SLURM holds a re-queued job back for two minutes (its BeginTime); an operator in a hurry does this too.
    assert slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now").returncode == 0
    if memory == "wiped":
        assert slurm.run("scontrol", "release", job_id).returncode == 0
    j.wait_state(job_id, {"COMPLETED"})
    out = j.output(job_id)
    assert "restart=0" in out and "restart=1" in out
    restores = set(re.findall(r"restore rank=(\d) step=(\d+) source=(\w+)", out))
    step = int(next(iter(restores))[1])
    source = {"kept": "memory", "wiped": "disk"}[memory]
    assert restores == {(str(rank), str(step), source) for rank in range(4)}
    lines = logged(j.loss_log)
    assert_resumed_exactly(dict(lines[:before]), dict(lines[before:]), step)
    assert_batch_outlived_its_step(slurm, job_id)


def protected_step(runtime, job, node):
    sock = runtime / "run" / job / f"node{node}.sock"
    try:
        return control.call(str(sock), "status")["ec"]["protected_step"]
    except (OSError, SMPUnavailable):
        return None


@pytest.mark.slow
def test_lost_node_replaced_is_rebuilt_by_its_ec_group_and_resumes_bit_identical(slurm, submit, runtime, job):
    j = submit(INMEM_FT_PARITY=1, INMEM_FT_PEER_PORT=free_port(2))
    job_id = j.submit(steps=LONG_EC)
    wait_step(j.loss_log, 8)
    assert slurm.wait_until(lambda: all((protected_step(runtime, job, n) or 0) >= 8 for n in (0, 1)), 120)
    assert slurm.job_field(job_id, "JobState") == "RUNNING"
    # n1 dies: its slurmd, every process of its job step (its SMP too), its shared memory.
    smp1 = control.call(str(runtime / "run" / job / "node1.sock"), "status")["pid"]
    slurm.kill_node("n1")
    assert slurm.wait_until(lambda: not os.path.exists(f"/proc/{smp1}"), 30)
    for seg in names_with_prefix(f"inmemft.{job}.n1."):
        unlink(seg)
    # SLURM notices (SlurmdTimeout), marks n1 down and re-queues the job; a replacement n1 comes up.
    assert slurm.wait_until(lambda: slurm.node_states().get("n1", "").startswith("down"), 120), slurm.node_states()
    down_at = time.monotonic()
    j.wait_state(job_id, {"PENDING"})
    j.wait_for(job_id, r"launch node=0 event=smp_stopped")
    before = len(logged(j.loss_log))  # the first allocation's trainers are gone
    # The replacement comes up once slurmctld has stopped sending the lost allocation's terminate RPC to n1's
    # address: a replacement that answered it ("already complete") after the job had started again would
    # take n1 out of the new allocation (same job id), and its step would wait for a second node forever.
    time.sleep(max(0.0, down_at + STALE_KILL_S - time.monotonic()))
    slurm.start_node("n1")
    slurm.wait_idle(["n1"], 120)
    assert slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now").returncode == 0
    j.wait_state(job_id, {"COMPLETED"})
    out = j.output(job_id)
    assert "restart=1" in out
    restores = set(re.findall(r"restore rank=(\d) step=(\d+) source=(\w+)", out))
    step = int(next(iter(restores))[1])
    assert restores == {("0", str(step), "memory"), ("1", str(step), "memory"),
                        ("2", str(step), "peer_reconstruction"), ("3", str(step), "peer_reconstruction")}
    assert "event=rebuild_start" in (runtime / "run" / job / "node1.log").read_text()
    lines = logged(j.loss_log)
    assert_resumed_exactly(dict(lines[:before]), dict(lines[before:]), step, LONG_EC)
    assert_batch_outlived_its_step(slurm, job_id, ["n0"])  # n1's tasks died with it


@pytest.mark.slow
def test_smp_killed_under_the_sbatch_script_is_restarted_protects_again_and_a_rank_kill_resumes(slurm, submit,
                                                                                                  runtime, job):
    """Issue 39 under the real SLURM: node 0's SMP gets SIGKILL; its agent (inmem-ft run, which the script execs)
    starts a new one that adopts the slots and protects a later step (parity 1); then a rank gets SIGKILL and the
    ranks resume from memory; every step run twice has the very loss it had the first time."""
    j = submit(INMEM_FT_PARITY=1, INMEM_FT_PEER_PORT=free_port())
    job_id = j.submit(steps=LONG_EC)
    sock = str(runtime / "run" / job / "node0.sock")

    def status():
        try:
            return control.call(sock, "status") if os.path.exists(sock) else None
        except (OSError, SMPUnavailable):
            return None

    def wait(what, cond, timeout_s=300):
        deadline = time.monotonic() + timeout_s
        while not (found := cond()):
            assert time.monotonic() < deadline, f"{what}:\n{j.output(job_id)[-6000:]}"
            time.sleep(0.2)
        return found

    first = wait("a protected step", lambda: (s := status()) and (s["ec"] or {}).get("protected_step") and s)
    before = logged_pids(j.loss_log)[-1]
    os.kill(first["pid"], signal.SIGKILL)
    wait("a new SMP protecting a later step, under restarted ranks", lambda: (s := status())
         and s["pid"] != first["pid"] and ((s["ec"] or {}).get("protected_step") or 0) > first["complete_step"]
         and logged_pids(j.loss_log)[-1] != before)
    os.kill(logged_pids(j.loss_log)[-1], signal.SIGKILL)
    assert j.wait_state(job_id, ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), timeout_s=480) == "COMPLETED", \
        j.output(job_id)[-6000:]
    out = j.output(job_id)
    assert f"[inmem_ft] agent node=0 event=smp_lost pid={first['pid']}: starting a new one" in out, out[-6000:]
    assert len(re.findall(r"restore rank=\d step=\d+ source=memory", out)) >= 8, out[-6000:]  # 4 ranks, twice
    seen = {}
    for step, loss in logged(j.loss_log):
        assert seen.setdefault(step, loss) == loss, step
    assert sorted(seen) == list(range(1, LONG_EC + 1))


def logged_pids(loss_log) -> list[int]:
    return [rec["pid"] for rec in map(json.loads, open(loss_log))]
