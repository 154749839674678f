"""Issue 5, items 1-2: torchrun_inmem.sh run for real on loopback, as two "nodes" (two invocations
with NODE_RANK 0 and 1) of the plain PyTorch example; both scripts checked by bash -n and shellcheck
(tests/test_slurm.py runs the sbatch script on a real SLURM)."""
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid

import pytest

from conftest import ROOT
from inmem_ft.launcher.ports import free_port
from inmem_ft.telemetry import read_losses
from inmem_ft.smp import control, paths
from inmem_ft.smp.segments import names_with_prefix, unlink

SCRIPT = os.path.join(ROOT, "launch", "torchrun_inmem.sh")
SBATCH = os.path.join(ROOT, "launch", "slurm_inmem.sbatch")
BIN = os.path.dirname(sys.executable)  # the venv's python and torchrun
STEPS, INTERVAL, DIE_AT = 12, 3, 7  # the restarted attempt resumes from the snapshot of step 6
EXAMPLE = ["-m", "inmem_ft.examples.plain_pytorch", "--steps", str(STEPS), "--interval", str(INTERVAL)]


def script_env(runtime_dir, job, nnodes=2, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INMEM_FT_", "TORCHELASTIC_"))}
    env.update({"PATH": BIN + os.pathsep + env.get("PATH", ""), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1",
                "INMEM_FT_RUNTIME_DIR": str(runtime_dir), "INMEM_FT_JOB": job, "INMEM_FT_MEMORY_BUDGET": "64MiB",
                "NNODES": str(nnodes), "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port())})
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Nodes:
    """Runs the script once per node; whatever happens, leaves no launcher, SMP or segment behind."""

    def __init__(self, runtime_dir, job):
        self.runtime_dir, self.job, self.procs = runtime_dir, job, []

    def run(self, argv, nnodes=2, timeout_s=240, **env) -> list[tuple[int, str]]:
        base = script_env(self.runtime_dir, self.job, nnodes, **env)
        logs = [os.path.join(self.runtime_dir, f"launch-{len(self.procs) + n}.out") for n in range(nnodes)]
        os.makedirs(self.runtime_dir, exist_ok=True)
        procs = []
        for node, log in enumerate(logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen(["bash", SCRIPT, *argv], env={**base, "NODE_RANK": str(node)},
                                              stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True, cwd=self.runtime_dir))
        self.procs += procs
        try:
            rcs = [p.wait(timeout=timeout_s) for p in procs]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("launchers timed out:\n" + "\n".join(open(log).read()[-3000:] for log in logs))
        return [(rc, open(log).read()) for rc, log in zip(rcs, logs)]

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def cleanup(self):
        self.kill()
        os.environ["INMEM_FT_RUNTIME_DIR"], saved = str(self.runtime_dir), os.environ.get("INMEM_FT_RUNTIME_DIR")
        try:
            for node in range(2):
                sock = paths.default_socket(self.job, node)
                if os.path.exists(sock) and control.ping(sock):
                    control.stop(sock, wipe=True)
        finally:
            if saved is None:
                del os.environ["INMEM_FT_RUNTIME_DIR"]
            else:
                os.environ["INMEM_FT_RUNTIME_DIR"] = saved
        for seg in names_with_prefix(f"inmemft.{self.job}."):
            unlink(seg)


def smp_alive(runtime_dir, job, node) -> bool:
    sock = os.path.join(runtime_dir, job, f"node{node}.sock")
    return os.path.exists(sock) and control.ping(sock) is not None


@pytest.fixture
def nodes(runtime, job):
    n = Nodes(runtime / "run", job)
    yield n
    n.cleanup()


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """One uninterrupted two-node run: its launcher results and its losses (the reference)."""
    tmp = tmp_path_factory.mktemp("clean")
    n = Nodes(tmp / "run", f"t{uuid.uuid4().hex[:10]}")
    try:
        results = n.run(EXAMPLE + ["--loss-log", str(tmp / "loss.jsonl")])
        alive = [smp_alive(n.runtime_dir, n.job, node) for node in range(2)]
        kept = names_with_prefix(f"inmemft.{n.job}.")
        yield results, read_losses(tmp / "loss.jsonl"), alive, kept
    finally:
        n.cleanup()


def test_clean_two_node_run_exits_0_and_stops_both_smps(clean_run):
    results, losses, alive, kept = clean_run
    for node, (rc, out) in enumerate(results):
        assert rc == 0, out
        assert f"[inmem_ft] launch node={node} event=smp_started" in out
        assert f"[inmem_ft] launch node={node} event=torchrun_exit rc=0" in out
        assert f"[inmem_ft] launch node={node} event=smp_stopped wiped=1 reason=finished" in out
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert alive == [False, False]
    # A job that finished has nothing to resume: its snapshots are released (INMEM_FT_WIPE_ON_EXIT unset).
    assert kept == []


def test_rank_killed_torchrun_restarts_all_and_resumes_bit_identical(nodes, clean_run, runtime):
    reference = clean_run[1]
    log = runtime / "loss.jsonl"
    results = nodes.run(EXAMPLE + ["--loss-log", str(log), "--die-at", str(DIE_AT), "--die-rank", "1"],
                        INMEM_FT_WIPE_ON_EXIT=1)
    for rc, out in results:
        assert rc == 0, out
    assert any("failed (exitcode: -9)" in out for _, out in results)  # torchrun saw the SIGKILLed rank
    steps = [json.loads(line)["step"] for line in open(log)]
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[:restart] == list(range(1, DIE_AT + 1))
    # The restarted ranks restored step 6 from the SMPs rather than starting over.
    assert steps[restart:] == list(range(DIE_AT // INTERVAL * INTERVAL + 1, STEPS + 1))
    assert read_losses(log) == reference  # the last value per step: exactly the uninterrupted run's
    for node, (_, out) in enumerate(results):
        assert "event=smp_stopped wiped=1" in out
        assert not smp_alive(nodes.runtime_dir, nodes.job, node)
    assert names_with_prefix(f"inmemft.{nodes.job}.") == []
    for node, (_, out) in enumerate(results):  # each node's agent (inmem-ft run) reported what it cost there
        assert f"[inmem_ft] agent node={node} event=time_lost failure=" in out, out


def test_hung_rank_is_dumped_killed_and_every_rank_restarts_bit_identical(nodes, clean_run, runtime):
    """Rank 1 (node 1) stops itself (SIGSTOP) after step 7; its peer on node 0 then waits in a collective.
    Both agents see their rank's heartbeat go stale, print its stacks, kill it, and the job resumes."""
    log = runtime / "loss.jsonl"
    results = nodes.run(EXAMPLE + ["--loss-log", str(log), "--hang-at", str(DIE_AT), "--die-rank", "1"],
                        INMEM_FT_WIPE_ON_EXIT=1, INMEM_FT_HANG_TIMEOUT=3)
    for rc, out in results:
        assert rc == 0, out
    # c10d numbers the nodes itself (both are 127.0.0.1 here): rank 1 runs under either launcher.
    out1 = next((out for _, out in results if "event=hang ranks=1 " in out), "\n".join(o for _, o in results))
    assert f"event=hang ranks=1 timeout_s=3: rank 1 at step {DIE_AT}" in out1, out1
    assert "plain_pytorch.py" in out1.split("event=hang_stack rank=1 ")[1], out1  # where it stopped
    assert read_losses(log) == clean_run[1]
    assert "time_lost failure=\"no heartbeat for over 3 s from rank(s) [1]" in out1


def test_signalled_with_wipe_on_exit_spills_first_then_wipes(runtime, job):
    """Preempted with INMEM_FT_WIPE_ON_EXIT=1: shared memory is freed, and a later job still finds the spill."""
    spill, out = runtime / "spill", runtime / "launch.out"
    env = script_env(runtime / "run", job, nnodes=1, NODE_RANK=0, INMEM_FT_PERSIST_DIR=spill, INMEM_FT_WIPE_ON_EXIT=1)
    sock = os.path.join(runtime / "run", job, "node0.sock")
    with open(out, "w") as f:
        proc = subprocess.Popen(["bash", SCRIPT, "-m", "inmem_ft.examples.plain_pytorch", "--steps", "100000",
                                 "--interval", str(INTERVAL)], env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=runtime)
    try:
        deadline = time.monotonic() + 120
        while not (smp_alive(runtime / "run", job, 0) and control.call(sock, "status")["complete_step"]):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    assert re.search(r"event=smp_stopped wiped=1 by=SIGTERM pid=\d+", text), text
    assert names_with_prefix(f"inmemft.{job}.") == []
    spilled = os.listdir(spill / job / "node0")
    assert spilled and all(re.fullmatch(r"r0\.step\d+\.slot|step\d+\.done", name) for name in spilled), spilled


def test_a_failed_job_keeps_its_snapshots_for_a_requeue(nodes, runtime):
    """torchrun gives up (no restarts left): the snapshots stay for the re-queued job, and `smp status`, with no
    SMP running, lists them as left by a stopped SMP."""
    [(rc, out)] = nodes.run(EXAMPLE + ["--die-at", str(DIE_AT), "--die-rank", "0"], nnodes=1,
                            INMEM_FT_MAX_RESTARTS=0)
    assert rc != 0 and "event=smp_stopped wiped=0" in out, out
    assert [paths.parse_segment_name(s)[0] for s in names_with_prefix(f"inmemft.{nodes.job}.")
            if paths.parse_segment_name(s)] == [0, 0]
    status = subprocess.run([sys.executable, "-m", "inmem_ft", "smp", "status", "--job", nodes.job],
                            env=script_env(nodes.runtime_dir, nodes.job), capture_output=True, text=True, timeout=60)
    assert status.returncode == 1 and "no SMP is listening" in status.stderr
    row = next(line.split() for line in status.stdout.splitlines() if line.startswith(nodes.job))
    # two slots and the record (the losses live in the snapshots' manifests; no trust record while no step is bad)
    assert row[1:3] == ["0", "3"] and row[-1] == str(DIE_AT // INTERVAL * INTERVAL)


TRAINER = r"""
import json, os, sys
from inmem_ft.smp import control
pid = control.call(os.environ["INMEM_FT_SMP_SOCKET"], "status")["pid"]
env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
json.dump({"trainer_env": sorted(k for k in os.environ if "SECRET" in k),
           "smp_secret": env.get("INMEM_FT_SECRET"), "smp_cmdline": open(f"/proc/{pid}/cmdline").read(),
           "node": os.environ["INMEM_FT_NODE"], "job": os.environ["INMEM_FT_JOB"]}, open(sys.argv[1], "w"))
"""


def test_secret_reaches_the_smp_only_and_smp_args_pass_through(nodes, runtime):
    secret = "s3cret-" + uuid.uuid4().hex
    sfile = runtime / "secret"
    sfile.write_text(secret + "\n")
    sfile.chmod(0o600)
    (runtime / "trainer.py").write_text(TRAINER)
    smp_log = runtime / "custom-smp.log"
    [(rc, out)] = nodes.run([str(runtime / "trainer.py"), str(runtime / "seen.json")], nnodes=1,
                            INMEM_FT_SECRET_FILE=sfile, INMEM_FT_SMP_ARGS=f"--log {smp_log}")
    assert rc == 0, out
    seen = json.loads((runtime / "seen.json").read_text())
    assert seen["trainer_env"] == []
    assert seen["smp_secret"] == secret
    assert secret not in seen["smp_cmdline"] and secret not in out
    assert (seen["node"], seen["job"]) == ("0", nodes.job)
    assert "event=ready" in smp_log.read_text()  # --log came from INMEM_FT_SMP_ARGS


@pytest.mark.parametrize("env, message", [
    ({"INMEM_FT_MEMORY_BUDGET": ""}, "INMEM_FT_MEMORY_BUDGET is not set"),
    ({"INMEM_FT_SECRET_FILE": "{secret_0644}"}, "is readable by group/others (mode 644): chmod 600"),
    ({"INMEM_FT_SECRET_FILE": "{secret_0600}", "INMEM_FT_SECRET": "x" * 20}, "both INMEM_FT_SECRET and"),
    ({"INMEM_FT_SECRET_FILE": "{missing}"}, "does not exist or is not readable"),
    ({"INMEM_FT_JOB": "a/b"}, "INMEM_FT_JOB='a/b' must be 1-64 characters"),
    ({"NODE_RANK": "2"}, "NODE_RANK=2 must be below NNODES=2"),
    ({"INMEM_FT_MIN_NODES": "3"}, "INMEM_FT_MIN_NODES=3 must be from 1 to NNODES=2"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
    ({"NPROC_PER_NODE": "two"}, "NPROC_PER_NODE='two' must be a non-negative integer"),
    ({"INMEM_FT_MEMORY_BUDGET": "lots"}, "the SMP did not start"),
])
def test_bad_input_is_refused_with_a_clear_message(runtime, job, env, message):
    files = {"secret_0644": runtime / "s644", "secret_0600": runtime / "s600", "missing": runtime / "nope"}
    for name, mode in (("secret_0644", 0o644), ("secret_0600", 0o600)):
        files[name].write_text("x" * 32)
        files[name].chmod(mode)
    env = {k: v.format(**files) for k, v in env.items()}
    full = script_env(runtime / "run", job, **{"NODE_RANK": 0, **env})
    full = {k: v for k, v in full.items() if v != ""}
    proc = subprocess.run(["bash", SCRIPT, "train.py"], env=full, capture_output=True, text=True, timeout=60)
    assert proc.returncode in (2, 3), proc.stderr
    assert message in proc.stderr
    assert f"[inmem_ft] launch node={full['NODE_RANK']} event=error rc={proc.returncode}" in proc.stderr
    assert not smp_alive(runtime / "run", job, 0)


def test_sbatch_refuses_a_step_wait_that_is_not_seconds():
    proc = subprocess.run(["bash", SBATCH, "train.py"], env=dict(os.environ, INMEM_FT_STEP_WAIT="5m"),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "INMEM_FT_STEP_WAIT='5m' must be a positive number of seconds" in proc.stderr


def test_usage_without_a_training_script():
    proc = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "Usage" in proc.stderr


@pytest.mark.parametrize("script", [SCRIPT, SBATCH])
def test_scripts_parse_and_pass_shellcheck(script):
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    assert os.stat(script).st_mode & stat.S_IXUSR
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    proc = subprocess.run(["shellcheck", "-x", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def _records(log) -> list[dict]:
    return [json.loads(line) for line in open(log)] if os.path.exists(log) else []


def test_smp_killed_under_the_script_is_restarted_protects_again_and_a_rank_kill_then_resumes_from_memory(
        nodes, runtime):
    """Issue 39: the agent, not the script, owns the node's SMP. Two nodes with erasure coding (parity 1), under
    umask 022 and a fresh job id (issue 37: its directory must come out 0700): node 0's SMP gets SIGKILL, the agent
    starts a new one that adopts the slots left in shared memory, the ranks restart and the next step is committed
    and EC-protected again; then rank 0 gets SIGKILL and the ranks resume from memory; a step run again has the
    very loss it had before. The run is open-ended and stopped with SIGTERM, so no kill can come after its end."""
    log = runtime / "loss.jsonl"
    ports = [free_port(), free_port()]
    peers = ",".join(f"{n}=127.0.0.1:{port}" for n, port in enumerate(ports))
    env = script_env(nodes.runtime_dir, nodes.job, INMEM_FT_SECRET=uuid.uuid4().hex, INMEM_FT_MAX_RESTARTS=3,
                     INMEM_FT_SMP_ARGS=f"--parity 1 --nodes 2 --peers {peers} --peer-wait 60")
    outs = [runtime / f"node{n}.out" for n in range(2)]
    procs = []
    for node, out in enumerate(outs):
        with open(out, "w") as f:
            procs.append(subprocess.Popen(["bash", SCRIPT, *EXAMPLE[:3], "100000", "--interval", str(INTERVAL),
                                           "--loss-log", str(log)], env={**env, "NODE_RANK": str(node)},
                                          stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, cwd=runtime, preexec_fn=lambda: os.umask(0o022)))
    nodes.procs += procs
    sock = os.path.join(nodes.runtime_dir, nodes.job, "node0.sock")

    def status():
        try:
            return control.call(sock, "status") if os.path.exists(sock) else None
        except (OSError, control.SMPUnavailable):
            return None

    def wait(what, cond, timeout_s=180):
        deadline = time.monotonic() + timeout_s
        while not (found := cond()):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, (
                f"waiting for {what}:\n" + "\n".join(o.read_text()[-3000:] for o in outs))
            time.sleep(0.1)
        return found

    def last():
        return (_records(log) or [{"pid": None, "step": 0}])[-1]

    first = wait("a protected step", lambda: (s := status()) and (s["ec"] or {}).get("protected_step") and s)
    before = last()["pid"]
    os.kill(first["pid"], signal.SIGKILL)
    wait("a new SMP protecting a later step, under restarted ranks", lambda: (s := status()) and s["pid"] != first["pid"]
         and ((s["ec"] or {}).get("protected_step") or 0) > first["complete_step"] and last()["pid"] != before)
    victim = last()
    os.kill(victim["pid"], signal.SIGKILL)
    wait("training back past the rank kill", lambda: last()["pid"] not in (before, victim["pid"])
         and last()["step"] > victim["step"] + INTERVAL)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        assert p.wait(timeout=120) == 128 + signal.SIGTERM, "\n".join(o.read_text()[-3000:] for o in outs)
    text = outs[0].read_text() + outs[1].read_text()
    assert (os.stat(os.path.dirname(sock)).st_mode & 0o777) == 0o700
    assert f"[inmem_ft] agent node=0 event=smp_lost pid={first['pid']}: starting a new one" in text, text
    assert text.count("[inmem_ft] launch node=0 event=smp_started") == 2, text
    # The dead SMP is a failure detected at once, the ranks stopped while the new one imports (issue 42)
    node0 = outs[0].read_text()
    lost = node0.index("event=smp_lost")
    assert node0.index("event=failure_detected", lost) < node0.index("event=smp_started", lost), node0
    assert len(re.findall(r"restore rank=\d+ step=\d+ source=memory", text)) >= 4, text  # after each of the kills
    seen = {}
    for rec in _records(log):
        assert seen.setdefault(rec["step"], rec["loss"]) == rec["loss"], rec
    assert sorted(seen) == list(range(1, max(seen) + 1))
