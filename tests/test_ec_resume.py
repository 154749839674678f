"""Issue 3's acceptance, end to end: a 4-node EC group trains the plain-PyTorch example; whole nodes are
lost (trainers and SMP killed, memory wiped) and replaced by empty SMPs, which rebuild from the group;
the restarted job resumes from memory and its loss trajectory is bit-identical to the uninterrupted one."""
import itertools
import os
import time

import pytest

from conftest import wait_protected
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.telemetry import read_losses

NODES, STEPS, INTERVAL, DIE_AT = 4, 20, 5, 19
EXAMPLE = ["-m", "inmem_ft.examples.plain_pytorch", "--steps", str(STEPS), "--interval", str(INTERVAL)]


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("INMEM_FT_SECRET", "resume-test-secret-0123456789")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's losses (no EC: parity does not touch training)."""
    tmp = tmp_path_factory.mktemp("reference")
    os.environ["INMEM_FT_RUNTIME_DIR"] = str(tmp / "run")
    try:
        with SimulatedCluster(NODES, 1, f"ref{os.getpid()}", 64 << 20, str(tmp / "logs")) as c:
            attempt = c.run(EXAMPLE + ["--loss-log", str(tmp / "loss.jsonl")])
            assert attempt.ok, c.rank_log(attempt.number, 0)
    finally:
        del os.environ["INMEM_FT_RUNTIME_DIR"]
    return read_losses(tmp / "loss.jsonl")


def settled_step(cluster, timeout=120) -> int:
    """The newest step complete on every SMP once its protection has caught up with it. Usually DIE_AT's last
    snapshot step; on a loaded machine a snapshot is skipped while the previous one's protection still runs
    (said in the log: event=skipped), and then it is the one before."""
    from inmem_ft.smp import control

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = [control.call(cluster.socket_path(n), "status") for n in range(cluster.nodes)]
        steps = {s["complete_step"] for s in status} | {s["ec"]["protected_step"] for s in status}
        if len(steps) == 1 and None not in steps:
            return steps.pop()
        time.sleep(0.1)
    raise AssertionError(f"protection did not catch up with the complete step within {timeout} s: {status}")


def lose_nodes_and_resume(job, runtime, m, lost):
    """Train until step DIE_AT, lose `lost`, replace them, resume; returns (resumed-from step, before, resumed)."""
    cluster = SimulatedCluster(NODES, 1, job, 64 << 20, str(runtime / "logs"), parity=m).start()
    try:
        attempt = cluster.run(EXAMPLE + ["--loss-log", str(runtime / "before.jsonl"), "--die-at", str(DIE_AT),
                                         "--die-rank", str(lost[0])])
        assert not attempt.ok and attempt.returncodes[lost[0]] == -9
        step = settled_step(cluster)
        assert step >= DIE_AT // INTERVAL * INTERVAL - INTERVAL, step
        if step != DIE_AT // INTERVAL * INTERVAL:
            assert any("event=skipped" in cluster.rank_log(attempt.number, r) for r in range(NODES)), \
                "a snapshot went missing unsaid"
        for node in lost:
            cluster.lose_node(node)
        for node in lost:
            cluster.start_smp(node)
        attempt = cluster.run(EXAMPLE + ["--loss-log", str(runtime / "resumed.jsonl")])
        assert attempt.ok, cluster.rank_log(attempt.number, lost[0])
        for node in lost:
            assert f"event=rebuilt step={step}" in open(runtime / "logs" / f"smp-node{node}.log").read()
            assert f"step={step} source=peer_reconstruction" in cluster.rank_log(attempt.number, node)
    finally:
        cluster.stop()
    before, resumed = read_losses(runtime / "before.jsonl"), read_losses(runtime / "resumed.jsonl")
    assert min(resumed) == step + 1, f"did not resume from the protected step {step}"
    return step, before, resumed


@pytest.mark.parametrize("m,lost", [(1, (2,)), (2, (0, 3))])
def test_lost_nodes_rebuilt_and_training_resumes_bit_identical(job, runtime, m, lost):
    step, before, resumed = lose_nodes_and_resume(job, runtime, m, lost)
    # The crashed run was uninterrupted up to DIE_AT: the resumed steps must repeat it bit for bit.
    again = range(step + 1, DIE_AT + 1)
    assert {s: resumed[s] for s in again} == {s: before[s] for s in again}


@pytest.mark.slow
def test_more_than_m_lost_fails_the_restore_with_a_clear_error(job, runtime):
    cluster = SimulatedCluster(NODES, 1, job, 64 << 20, str(runtime / "logs"), parity=1).start()
    try:
        attempt = cluster.run(EXAMPLE + ["--die-at", "12", "--die-rank", "1"])
        assert not attempt.ok
        wait_protected(cluster, 10)
        for node in (1, 2):
            cluster.lose_node(node)
        for node in (1, 2):
            cluster.start_smp(node)
        attempt = cluster.run(EXAMPLE, timeout_s=120)
        assert not attempt.ok and attempt.seconds < 120
        # Every rank that ended on its own says the same one line, the survivors too (they waited for the
        # replaced nodes' ranks in the restore's agreement), and none shows a traceback.
        said = {}
        for rank, code in attempt.returncodes.items():
            if code == -9:  # stopped by the launcher once the first rank failed
                continue
            log = cluster.rank_log(attempt.number, rank)
            assert "Traceback" not in log, log
            [said[rank]] = [line for line in log.splitlines() if line.startswith("SnapshotLost: ")]
        assert attempt.first_failure in said and len(set(said.values())) == 1, said
        assert "restore the job from the next tier (disk)" in said[attempt.first_failure]
    finally:
        cluster.stop()


@pytest.mark.slow
@pytest.mark.parametrize("m,lost", [(m, lost) for m in (1, 2) for n in range(1, m + 1)
                                    for lost in itertools.combinations(range(NODES), n)])
def test_every_loss_resumes_like_the_uninterrupted_run(job, runtime, reference, m, lost):
    step, _, resumed = lose_nodes_and_resume(job, runtime, m, lost)
    assert resumed == {s: reference[s] for s in range(step + 1, STEPS + 1)}
