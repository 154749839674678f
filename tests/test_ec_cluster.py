"""Issue 3's acceptance: SMPs of a 4-node EC group on loopback protect each other's slots with parity;
a replacement node rebuilds its slots and parity byte-identically; more than m lost is a clear error;
wrong secrets and corrupted parity are caught."""
import itertools
import os
import time

import numpy as np
import pytest

from conftest import wait_for_log, wait_protected

from inmem_ft.cluster import protection, transport
from inmem_ft.errors import SnapshotLost
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp import control
from inmem_ft.smp.client import SMPClient
from inmem_ft.smp.segments import names_with_prefix, path_of
from inmem_ft.snapshot import segment as seg
from inmem_ft.snapshot.checksum import checksum, to_hex

G, RANKS_PER_NODE = 4, 2
SECRET = "test-secret-" + "x" * 20


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("INMEM_FT_SECRET", SECRET)


def make_cluster(job, runtime, m):
    return SimulatedCluster(G, RANKS_PER_NODE, job, 64 << 20, str(runtime / "logs"), parity=m).start()


def write_step(cluster, step, seed=0, size=50_000, complete=None, on=None):
    """Commit `step` on every rank (of the nodes `on`, default all) with random tensor bytes of a per-rank size,
    then declare it complete on the nodes of `complete` (default every node)."""
    rng = np.random.default_rng(seed + step)
    for rank in range(cluster.world_size):
        n = size + 7919 * rank  # unequal nodes: exercises the padding
        data = rng.integers(0, 256, n, dtype=np.uint8)
        if on is not None and cluster.node_of(rank) not in on:
            continue
        manifest = {"format": seg.FORMAT, "rank": rank, "step": step, "world_size": cluster.world_size,
                    "leaves": [{"o": 0, "n": n, "h": to_hex(checksum(data)), "dt": "uint8", "sh": [n]}]}
        raw = seg.encode_manifest(manifest)
        client = SMPClient(cluster.socket_path(cluster.node_of(rank)))
        try:
            reply = client.call("begin", rank=rank, step=step, manifest_len=len(raw), data_len=n,
                                keep_step=step - 1 if step > 1 else None, reserve=step == 1)
            assert "skipped" not in reply, reply
            with open(path_of(reply["segment"]), "r+b") as f:
                f.seek(seg.HEADER_SIZE)
                f.write(raw)
                f.seek(reply["data_off"])
                f.write(data.tobytes())
            client.call("commit", rank=rank, step=step)
        finally:
            client.close()
    for node in range(cluster.nodes) if complete is None else complete:
        control.call(cluster.socket_path(node), "complete", step=step)


def node_bytes(cluster, node):
    """Every slot (used bytes) and parity segment of a node: name without generation -> bytes."""
    out = {}
    for rank in range(node * cluster.ranks_per_node, (node + 1) * cluster.ranks_per_node):
        for entry in control.call(cluster.socket_path(node), "list", rank=rank)["slots"]:
            with open(path_of(entry["segment"]), "rb") as f:
                header = seg.Header.read(f.read(seg.HEADER_SIZE))
                f.seek(0)
                out[f"rank{rank}.step{entry['step']}"] = f.read(header.data_off + header.data_len)
    for name in names_with_prefix(f"inmemft.{cluster.job}.n{node}.parity."):
        with open(path_of(name), "rb") as f:
            out[name] = f.read()
    return out


def protected_bytes(cluster, node):
    return {k: v for k, v in node_bytes(cluster, node).items() if "step1" not in k}


def replace(cluster, lost):
    for node in lost:
        cluster.lose_node(node)
    for node in lost:
        cluster.start_smp(node)


@pytest.mark.parametrize("m", [1, 2])
def test_every_loss_of_at_most_m_nodes_rebuilds_byte_identical(job, runtime, m):
    cluster = make_cluster(job, runtime, m)
    try:
        write_step(cluster, 1)
        write_step(cluster, 2)
        wait_protected(cluster, 2)
        # Step 1 lives only on survivors (a rebuild restores the protected step 2): compare step 2.
        original = {n: protected_bytes(cluster, n) for n in range(G)}
        assert all(any(".parity.s2" in k for k in original[n]) for n in range(G))
        for count in range(1, m + 1):
            for lost in itertools.combinations(range(G), count):
                replace(cluster, lost)
                for node in range(G):
                    assert protected_bytes(cluster, node) == original[node], f"lost {lost}: node {node} differs"
        log = open(runtime / "logs" / "smp-node0.log").read()
        assert "event=rebuilt step=2" in log and "rebuild node 0 step 2: 100%" in log
        status = control.call(cluster.socket_path(0), "status")
        assert status["ec"]["protected_step"] == 2 and status["ec"]["rebuild"] == "ok"
        assert status["ec"]["rebuilds"] == 1  # node 0's SMP now is the one that replaced it
    finally:
        cluster.stop()


@pytest.mark.slow
def test_a_member_that_answers_late_is_not_taken_for_lost(job, runtime):
    """Issue 40: a replacement that finds one more member silent than parity covers asks it again past the
    quiet period before counting it out; a member back by then (an SMP restarted with its memory) serves."""
    cluster = make_cluster(job, runtime, 1)
    try:
        write_step(cluster, 1)
        wait_protected(cluster, 1)
        original = protected_bytes(cluster, 1)
        cluster.kill_smp(3)  # its memory stays: slow, not lost
        replace(cluster, (1,))
        wait_for_log(cluster.smp_log(1), "event=rebuild_wait nodes=[3]", 30)
        cluster.start_smp(3)
        deadline = time.monotonic() + 60
        while (state := control.call(cluster.socket_path(1), "status")["ec"]["rebuild"]) == "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert state == "ok" and protected_bytes(cluster, 1) == original
    finally:
        cluster.stop()


def test_more_than_m_lost_names_the_nodes_and_restore_fails_clearly(job, runtime):
    cluster = make_cluster(job, runtime, 1)
    try:
        write_step(cluster, 1)
        wait_protected(cluster, 1)
        replace(cluster, (1, 3))
        with pytest.raises(SnapshotLost, match=r"nodes \[1, 3\] of EC group \[0, 1, 2, 3\] are lost.*next tier \(disk\)"):
            control.call(cluster.socket_path(1), "list", rank=2)
    finally:
        cluster.stop()


def test_wrong_secret_is_refused_and_logged(job, runtime):
    cluster = make_cluster(job, runtime, 1)
    try:
        host, port = transport.parse_peers(cluster.ec.peers)[0]
        for secret in (b"wrong-secret-" + b"y" * 20, None):
            client = transport.PeerClient(0, (host, port), secret or b"", job, 1, transport.TokenBucket(None))
            with pytest.raises(transport.AuthError, match="refused our credentials"):
                client.call({"op": "state"})
        right = transport.PeerClient(0, (host, port), SECRET.encode(), job, 1, transport.TokenBucket(None))
        assert right.call({"op": "state"})[0]["protected"] is None
        assert open(runtime / "logs" / "smp-node0.log").read().count("event=refused") == 2
    finally:
        cluster.stop()


def test_corrupted_parity_chunk_is_detected(job, runtime):
    cluster = make_cluster(job, runtime, 1)
    try:
        write_step(cluster, 1)
        wait_protected(cluster, 1)
        # Node 0 holds the parity of stripe 0; rebuilding node 1 reads it (stripe 0 takes data from 1, 2, 3).
        [name] = names_with_prefix(f"inmemft.{job}.n0.parity.")
        with open(path_of(name), "r+b") as f:
            f.seek(4096 + 100)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 1]))
        replace(cluster, (1,))
        with pytest.raises(SnapshotLost, match="parity chunk 0 of step 1 fails its checksum"):
            control.call(cluster.socket_path(1), "list", rank=2)
    finally:
        cluster.stop()


def test_secret_file_must_be_private(tmp_path):
    path = tmp_path / "secret"
    path.write_text("z" * 32)
    os.chmod(path, 0o644)
    with pytest.raises(transport.SecretError, match="chmod 600"):
        transport.load_secret(str(path))
    os.chmod(path, 0o600)
    assert transport.load_secret(str(path)) == b"z" * 32


def test_bandwidth_cap_paces_bulk_bytes():
    bucket = transport.TokenBucket(20 << 20)
    t0 = time.monotonic()
    for _ in range(30):
        bucket.take(1 << 20)  # 30 MiB at 20 MiB/s with a 1 s burst: about 0.5 s
    assert 0.35 < time.monotonic() - t0 < 2


def test_resuming_from_an_older_step_discards_newer_parity(job, runtime):
    cluster = make_cluster(job, runtime, 1)
    try:
        write_step(cluster, 1)
        write_step(cluster, 2)
        wait_protected(cluster, 2)
        for rank in range(cluster.world_size):  # the job resumed from step 1 (say step 2 was corrupt on a rank)
            control.call(cluster.socket_path(cluster.node_of(rank)), "restored", rank=rank, step=1)
        assert control.call(cluster.socket_path(0), "status")["ec"]["protected_step"] != 2
        wait_protected(cluster, 1)  # its parity was dropped once step 2 was protected: the step resumed from
        write_step(cluster, 2, seed=7)  # step 2 again, other bytes: it must be protected anew
        wait_protected(cluster, 2)
        original = protected_bytes(cluster, 3)
        replace(cluster, (3,))
        assert protected_bytes(cluster, 3) == original
    finally:
        cluster.stop()


def test_a_step_resumed_from_that_no_complete_named_is_protected(job, runtime):
    """Issue 23: every rank committed step 2, but a rank died before the job's agreement that it is complete, so no
    SMP was told; the restart resumes from step 2. It is protected then, and a node lost next is rebuilt at it."""
    cluster = make_cluster(job, runtime, 1)
    try:
        write_step(cluster, 1)
        wait_protected(cluster, 1)
        write_step(cluster, 2, complete=())
        for rank in range(cluster.world_size):
            control.call(cluster.socket_path(cluster.node_of(rank)), "restored", rank=rank, step=2)
        wait_protected(cluster, 2)
        assert "event=protect step=2 reason=the job resumed from step 2" in open(cluster.smp_log(0)).read()
        original = protected_bytes(cluster, 3)
        replace(cluster, (3,))
        assert protected_bytes(cluster, 3) == original and "rank6.step2" in original
    finally:
        cluster.stop()


def test_an_smp_restarted_with_its_complete_step_unprotected_protects_it(job, runtime):
    """Node 0 was told step 2 is complete and built its parity, then its SMP died before the rest of its group
    caught up: the SMP started again protects its complete step (reusing the parity it had built)."""
    cluster = make_cluster(job, runtime, 1)
    try:
        write_step(cluster, 1)
        wait_protected(cluster, 1)
        write_step(cluster, 2, complete=(0,))
        deadline = time.monotonic() + 60
        while control.call(cluster.socket_path(0), "status")["ec"]["parity_steps"].get("2") != "built":
            assert time.monotonic() < deadline, "node 0 did not build its parity of step 2"
            time.sleep(0.05)
        cluster.kill_smp(0)
        cluster.start_smp(0)
        for node in range(1, G):
            control.call(cluster.socket_path(node), "complete", step=2)
        wait_protected(cluster, 2)
        log = open(cluster.smp_log(0)).read()
        assert "event=protect step=2 reason=step 2 is complete but not protected when this SMP started" in log
        assert "event=reuse parity step=2 state=built" in log
    finally:
        cluster.stop()


def test_a_retry_of_protection_holds_off_no_snapshot_and_yields_to_a_newer_step_and_to_a_stop(job, runtime):
    """Node 3's SMP is gone while step 2 is protected: each other node retries it (event=protect_retry), and
    meanwhile takes the next snapshot; step 3 complete ends the wait for step 2's retry at once, and stopping an
    SMP whose retry of step 3 waits is not held up by it."""
    cluster = make_cluster(job, runtime, 1)
    try:
        write_step(cluster, 1)
        wait_protected(cluster, 1)
        write_step(cluster, 2, complete=())
        cluster.lose_node(3)
        alive = (0, 1, 2)
        for node in alive:
            control.call(cluster.socket_path(node), "complete", step=2)
        for node in alive:
            wait_for_log(cluster.smp_log(node), "event=protect_retry step=2 attempt=2 of 3 ", 30)
        write_step(cluster, 3, on=alive, complete=alive)  # not skipped: a retry does not pin the protected step
        t0 = time.monotonic()
        for node in alive:
            wait_for_log(cluster.smp_log(node), "(not retried: step 3 is wanted now)", protection.RETRY_DELAYS_S[0])
        assert time.monotonic() - t0 < protection.RETRY_DELAYS_S[0] - 1
        wait_for_log(cluster.smp_log(0), "event=protect_retry step=3 attempt=2 of 3 ", 30)
        t0 = time.monotonic()
        control.stop(cluster.socket_path(0), wipe=True)
        cluster.smps.pop(0).wait(timeout=30)
        assert time.monotonic() - t0 < protection.RETRY_DELAYS_S[0] - 1
        cluster.wipe_node(0)
    finally:
        cluster.stop()



SURVIVORS = (0, 1, 2)


def lose_node_3_after_the_others_built_step_2(cluster):
    """Steps 1 (protected) and 2, whose parity nodes 0-2 built while node 3 was never told it is complete: they
    wait to see node 3's built when it goes, as for a node that built and went before they asked it again. Returns
    node 3's slots of step 2 (name -> bytes) as they were."""
    write_step(cluster, 1)
    wait_protected(cluster, 1)
    write_step(cluster, 2, complete=SURVIVORS)
    deadline = time.monotonic() + 60
    while any(control.call(cluster.socket_path(n), "status")["ec"]["parity_steps"].get("2") != "built"
              for n in SURVIVORS):
        assert time.monotonic() < deadline, "the survivors did not build their parity of step 2"
        time.sleep(0.05)
    original = {k: v for k, v in node_bytes(cluster, 3).items() if k.endswith(".step2")}
    cluster.lose_node(3)
    for node in SURVIVORS:
        wait_for_log(cluster.smp_log(node), "event=protect_retry step=2 attempt=2 of 3 ", 30)
        assert "went unreachable before their parity of step 2 was seen built" in open(cluster.smp_log(node)).read()
    return original


def check_node_3_reads_from_parity(cluster, original):
    client = SMPClient(cluster.socket_path(0))
    try:
        lost = [e for e in client.catalog()["entries"] if e["node"] == 3 and e["step"] == 2]
        assert sorted(e["rank"] for e in lost) == [6, 7] and {e["source"] for e in lost} == {"parity"}
        for e in lost:
            got, source = client.read(3, e["rank"], 2, 0, e["data_off"] + e["data_len"])
            assert source == "parity" and got.tobytes() == original[f"rank{e['rank']}.step2"]
    finally:
        client.close()


def test_a_step_built_by_the_survivors_of_a_member_lost_before_they_saw_it_built_still_decodes(job, runtime):
    """Node 3 goes while the others have built their parity of step 2 and wait to see its own: they keep step 2
    built (a node's own parity never decodes that node), so its slots of step 2 are read from parity, not given up
    for step 1, and its replacement is rebuilt at step 2; the survivors' retry then finishes step 2."""
    cluster = make_cluster(job, runtime, 1)
    try:
        original = lose_node_3_after_the_others_built_step_2(cluster)
        for node in SURVIVORS:
            status = control.call(cluster.socket_path(node), "status")["ec"]
            assert status["parity_steps"] == {"1": "protected", "2": "built"} and status["protected_step"] == 1
        check_node_3_reads_from_parity(cluster, original)
        cluster.start_smp(3)
        deadline = time.monotonic() + 60
        while (state := control.call(cluster.socket_path(3), "status")["ec"]["rebuild"]) == "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert state == "ok" and "event=rebuilt step=2" in open(cluster.smp_log(3)).read()
        assert {k: v for k, v in node_bytes(cluster, 3).items() if k.endswith(".step2")} == original
        # The group is whole again: the retry finishes step 2 with the parity kept, and frees step 1's.
        wait_protected(cluster, 2, timeout=protection.RETRY_DELAYS_S[0] + 30)
        for node in SURVIVORS:
            assert "event=reuse parity step=2 state=built" in open(cluster.smp_log(node)).read()
            assert control.call(cluster.socket_path(node), "status")["ec"]["parity_steps"] == {"2": "protected"}
    finally:
        cluster.stop()


def test_the_survivors_resuming_from_a_step_kept_built_protect_it_and_snapshot_on(job, runtime):
    """The job goes on without node 3 from step 2, which the survivors kept built: resuming from it makes it their
    protected step (not encoded again, so node 3's data stays readable through it), and the next snapshot is
    taken, not skipped for two pinned steps."""
    cluster = make_cluster(job, runtime, 1)
    try:
        original = lose_node_3_after_the_others_built_step_2(cluster)
        for rank in range(cluster.world_size):
            if cluster.node_of(rank) in SURVIVORS:
                control.call(cluster.socket_path(cluster.node_of(rank)), "restored", rank=rank, step=2)
        for node in SURVIVORS:
            status = control.call(cluster.socket_path(node), "status")["ec"]
            assert status["parity_steps"] == {"2": "protected"} and status["protected_step"] == 2
            assert "event=protected_by_resume step=2 lost=[3]" in open(cluster.smp_log(node)).read()
        check_node_3_reads_from_parity(cluster, original)
        write_step(cluster, 3, on=SURVIVORS, complete=SURVIVORS)  # write_step asserts no begin was skipped
    finally:
        cluster.stop()
