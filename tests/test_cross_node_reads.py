"""Issue 8, items 4-5: a job-wide catalog of every fragment of every rank, reads of any slot from any node
(through the local SMP, which asks its peers), reads of a lost node through parity, pulls of a moved rank's
slots, and clear errors for holes and wrong secrets. Real SMP processes on loopback, real shared memory."""
import json
import math

import numpy as np
import pytest
import torch

from conftest import wait_protected
from inmem_ft import cli
from inmem_ft.cluster import transport
from inmem_ft.errors import CatalogHole, SnapshotCorrupt, SnapshotLost, StepIncomplete
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp import control
from inmem_ft.smp.client import SMPClient
from inmem_ft.smp.segments import Segment
from inmem_ft.snapshot import catalog, layout, pack, segment as seg
from inmem_ft.snapshot.shardspec import ShardSpec
from inmem_ft.snapshot.topology import Topology
from inmem_ft.snapshot.tree import Replicated, Sharded, flatten

SECRET = "reads-test-secret-0123456789"
TP, DP = 2, 2
WORLD = TP * DP
STEP = 5


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("INMEM_FT_SECRET", SECRET)


def model(step):
    """The job's global tensors at `step`."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(6, 10, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "exp_avg.w": torch.randn(6, 8, generator=g), "embed": torch.randn(3, 4, generator=g)}


def rank_state(rank, step):
    """Rank r is tp r%2, dp r//2: `w` is split by columns over tp and replicated over dp (each dp replica stores
    a share of it); `exp_avg.w` is ZeRO-partitioned over all ranks as flat ranges; `embed` is held
    whole by every rank (rank 0's copy is main); `count` has no shard spec."""
    m, tp = model(step), rank % TP
    w = m["w"][:, 5 * tp: 5 * tp + 5].contiguous()
    part = m["exp_avg.w"].reshape(-1)[12 * rank: 12 * rank + 12].clone()
    return {
        "replicated": Replicated({
            "w": Sharded(w, ShardSpec("w", (6, 10), (0, 5 * tp), (6, 5), replica=(0,))),
            "b": Sharded(m["b"].clone(), ShardSpec("b", (5,), main=tp == 0, replica=(tp,)))}),
        "exp_avg": Sharded(part, ShardSpec("exp_avg.w", (6, 8), flat=(12 * rank, 12 * rank + 12))),
        "embed": Sharded(m["embed"].clone(), ShardSpec("embed", (3, 4), replica=(tp, rank // TP), main=rank == 0)),
        "count": torch.tensor([step, rank]),
    }


def commit(socket_path, rank, step, state=None):
    """One rank's snapshot written as a trainer does: layout.plan, bytes into the slot, checksums, commit."""
    flat = flatten(rank_state(rank, step) if state is None else state)
    topo = Topology(world_size=WORLD, tp=TP, dp=DP, coords={"tp": rank % TP, "dp": rank // TP})
    plan = layout.plan(flat, step=step, rank=rank, world_size=WORLD, dp_rank=rank // TP, dp_size=DP, topology=topo)
    manifest_len = len(seg.encode_manifest(plan.manifest))
    client = SMPClient(socket_path)
    try:
        reply = client.call("begin", rank=rank, step=step, manifest_len=manifest_len, data_len=plan.data_len,
                            keep_step=None, reserve=True)
        segment = Segment(reply["segment"])
        data = torch.frombuffer(segment.buf, dtype=torch.uint8, count=plan.data_len, offset=reply["data_off"])
        pack.write(flat.values, plan.copies, plan.batches, data)
        seg.region_hashes(segment.buf[reply["data_off"]:], plan.manifest)
        raw = seg.encode_manifest(plan.manifest)
        segment.buf[seg.HEADER_SIZE: seg.HEADER_SIZE + len(raw)] = raw
        del data
        segment.close()
        client.call("commit", rank=rank, step=step)
    finally:
        client.close()


def write_step(cluster, step, placement=None):
    """Every rank commits `step` on its node (`placement`: rank -> node, default the cluster's), then complete."""
    placement = placement or {r: cluster.node_of(r) for r in range(WORLD)}
    for rank, node in placement.items():
        commit(cluster.socket_path(node), rank, step)
    for node in set(placement.values()):
        control.call(cluster.socket_path(node), "complete", step=step)


def expected_bytes(row):
    """What the catalog row must hold, from the global tensors (no slot involved)."""
    key = row["key"]
    if key.startswith("_rank"):
        rank = int(key[5:].split(".")[0])
        full = rank_state(rank, STEP)["count"]
    else:
        full = model(STEP)[key]
    box = full[tuple(slice(o, o + s) for o, s in zip(row["offset"], row["shape"]))]
    elems = box.contiguous().reshape(-1)[row["flat_lo"]: row["flat_hi"]]
    raw = elems.view(torch.uint8).numpy().tobytes()
    return raw[row["frag_byte_lo"]: row["frag_byte_lo"] + row["nbytes"]]


def assemble(client, table, step):
    """Every global tensor rebuilt from the main rows, read through `client` (any node's bytes)."""
    out = {}
    for row in table.to_pylist():
        if not row["main"]:
            continue
        numel, isz = math.prod(row["global_shape"]), row["itemsize"]
        buf = out.setdefault(row["key"], np.zeros(numel * isz, dtype=np.uint8))
        got, _ = client.read(row["node"], row["rank"], step, row["slot_offset"], row["nbytes"])
        idx = np.arange(numel).reshape(row["global_shape"])
        box = idx[tuple(slice(o, o + s) for o, s in zip(row["offset"], row["shape"]))].reshape(-1)
        pos = np.arange(row["frag_byte_lo"], row["frag_byte_lo"] + row["nbytes"])  # bytes of the fragment
        buf[box[row["flat_lo"]:][pos // isz] * isz + pos % isz] = got
    return out


def check_catalog(client, sources):
    listing = client.catalog()
    assert listing["unreachable"] == []
    step = catalog.complete_step(listing["entries"])
    assert step == STEP
    table = catalog.fragments(listing["entries"], step)
    info = {c["key"]: c for c in catalog.check(table)}
    assert set(info) == {"w", "b", "exp_avg.w", "embed"} | {f"_rank{r}.leaf4" for r in range(WORLD)}
    rows = table.to_pylist()
    assert {(r["rank"], r["source"]) for r in rows} == {(r, sources[r]) for r in range(WORLD)}
    assert sum(r["key"] == "exp_avg.w" for r in rows) == WORLD  # every rank's partition
    assert sum(r["key"] == "embed" for r in rows) == WORLD and sum(r["key"] == "embed" and r["main"] for r in rows) == 1
    assert any(r["key"] == "w" and r["frag_byte_lo"] for r in rows)  # split over two dp replicas' shares
    for row in rows:
        got, source = client.read(row["node"], row["rank"], step, row["slot_offset"], row["nbytes"])
        assert got.tobytes() == expected_bytes(row), row
        assert source == sources[row["rank"]]
    m = model(STEP)
    built = assemble(client, table, step)
    for key in ("w", "b", "exp_avg.w", "embed"):
        assert built[key].tobytes() == m[key].contiguous().view(-1).view(torch.uint8).numpy().tobytes(), key
    return table


def test_catalog_lists_every_fragment_and_any_node_reads_exact_bytes(job, runtime, capsys):
    with SimulatedCluster(2, 2, job, 64 << 20, str(runtime / "logs")) as cluster:
        write_step(cluster, STEP)
        for node in range(2):
            client = SMPClient(cluster.socket_path(node))
            table = check_catalog(client, {r: "memory" for r in range(WORLD)})
            client.close()
        assert cli.main(["inspect", "--job", job, "--node", "1"]) == 0
        out = capsys.readouterr().out
        assert "step 5 (held for every rank)" in out and "tp=2 pp=1 dp=2" in out
        assert "exp_avg.w" in out and len(out.splitlines()) > table.num_rows
        assert cli.main(["inspect", "--job", job, "--step", "5", "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["fragments"] == table.to_pylist() and shown["topology"]["coords"] == {"tp": 0, "dp": 0}
        assert cli.main(["inspect", "--job", job, "--step", "6"]) == 1
        assert capsys.readouterr().err.strip().startswith("inmem-ft: error: step 6 is not held for every rank")
        # A node that cannot be reached, without parity: named, and the step is incomplete.
        cluster.kill_smp(1)
        client = SMPClient(cluster.socket_path(0))
        listing = client.catalog()
        [lost] = listing["unreachable"]
        assert lost["node"] == 1 and "runs without parity" in lost["error"]
        with pytest.raises(StepIncomplete, match=r"ranks \[2, 3\] of 4"):
            catalog.complete_step(listing["entries"], STEP)
        client.close()
        assert cli.main(["inspect", "--job", job]) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "unreachable: node 1:" in err


def test_pull_installs_a_moved_rank_and_the_old_node_releases_it(job, runtime):
    with SimulatedCluster(2, 2, job, 64 << 20, str(runtime / "logs")) as cluster:
        write_step(cluster, STEP)
        # The job restarts with rank 3 on node 0: its SMP pulls rank 3's slot from node 1. A corrupted byte
        # there fails the pull, naming the slot; once it is right again, the pull goes through.
        client = SMPClient(cluster.socket_path(0))
        flip_byte(cluster, 1, 3)
        with pytest.raises(SnapshotCorrupt, match=r"node 1 rank 3 step 5: slot bytes \[\d+, \d+\) fail their checksum"):
            client.pull(3)
        assert client.call("list", rank=3)["slots"] == []
        flip_byte(cluster, 1, 3)
        [pulled] = client.pull(3)
        assert pulled["step"] == STEP and pulled["from_node"] == 1 and pulled["source"] == "peer_memory"
        assert client.call("list", rank=3)["slots"][0]["segment"] == pulled["segment"]
        original = node_slot(cluster, 1, 3)
        assert node_slot(cluster, 0, 3) == original
        assert client.pull(3) == []  # already held here
        assert "event=pulled rank=3 step=5 from_node=1" in open(runtime / "logs" / "smp-node0.log").read()
        # The next complete step has rank 3 on node 0: node 1 lets its old slots go.
        write_step(cluster, STEP + 5, {0: 0, 1: 0, 2: 1, 3: 0})
        assert control.call(cluster.socket_path(1), "list", rank=3)["slots"] == []
        assert "event=released rank=3 steps=[5]" in open(runtime / "logs" / "smp-node1.log").read()
        client.close()


def flip_byte(cluster, node, rank):
    entry = control.call(cluster.socket_path(node), "list", rank=rank)["slots"][0]
    segment = Segment(entry["segment"])
    header = seg.Header.read(segment.buf)
    segment.buf[header.data_off + 3] ^= 0x10
    segment.close()


def node_slot(cluster, node, rank):
    entry = control.call(cluster.socket_path(node), "list", rank=rank)["slots"][0]
    segment = Segment(entry["segment"])
    try:
        header = seg.Header.read(segment.buf)
        return bytes(segment.buf[: header.data_off + header.data_len])
    finally:
        segment.close()


def test_lost_node_is_read_and_pulled_through_parity(job, runtime):
    cluster = SimulatedCluster(4, 1, job, 64 << 20, str(runtime / "logs"), parity=1).start()
    try:
        write_step(cluster, STEP)
        wait_protected(cluster, STEP)
        original = node_slot(cluster, 2, 2)
        cluster.kill_smp(2)
        cluster.wipe_node(2)
        client = SMPClient(cluster.socket_path(0))
        check_catalog(client, {0: "memory", 1: "memory", 2: "parity", 3: "memory"})
        [pulled] = client.pull(2)
        assert pulled["source"] == "peer_reconstruction" and pulled["from_node"] == 2
        assert node_slot(cluster, 0, 2) == original
        # A second node lost (m=1): the error leads with both nodes and what to do, then why each failed.
        cluster.kill_smp(3)
        with pytest.raises(SnapshotLost, match=r"^nodes \[2, 3\] of EC group \[0, 1, 2, 3\] are unreachable, more "
                                               r"than its parity m=1 tolerates; restore the job from the next tier "
                                               r"\(disk\) \(node 2: .*; node 3: [^\n]*\)$"):
            client.read(2, 2, STEP, 0, 64)
        client.close()
    finally:
        cluster.stop()


def test_a_slot_larger_than_one_request_streams_in_pieces_from_memory_and_parity(job, runtime):
    big = torch.randn(5 << 20, generator=torch.Generator().manual_seed(1))  # 20 MiB: three read requests
    cluster = SimulatedCluster(2, 1, job, 128 << 20, str(runtime / "logs"), parity=1).start()
    try:
        commit(cluster.socket_path(0), 0, STEP, {"x": torch.zeros(3)})
        commit(cluster.socket_path(1), 1, STEP, {"big": big})
        for node in range(2):
            control.call(cluster.socket_path(node), "complete", step=STEP)
        wait_protected(cluster, STEP)
        original = node_slot(cluster, 1, 1)
        client = SMPClient(cluster.socket_path(0))
        got, source = client.read(1, 1, STEP, 0, len(original))
        assert source == "memory" and got.tobytes() == original
        cluster.kill_smp(1)
        cluster.wipe_node(1)
        into = np.empty(len(original) - 100, dtype=np.uint8)
        got, source = client.read(1, 1, STEP, 100, len(original) - 100, into=into)
        assert source == "parity" and got is into and got.tobytes() == original[100:]
        client.close()
    finally:
        cluster.stop()


def test_wrong_secret_is_refused_without_parity(job, runtime):
    with SimulatedCluster(2, 1, job, 64 << 20, str(runtime / "logs")) as cluster:
        addr = transport.parse_peers(cluster.peers)[1]
        wrong = transport.PeerClient(1, addr, b"wrong-secret-" + b"y" * 20, job, 0, transport.TokenBucket(None))
        with pytest.raises(transport.AuthError, match="refused our credentials"):
            wrong.call({"op": "slots"})
        right = transport.PeerClient(1, addr, SECRET.encode(), job, 0, transport.TokenBucket(None))
        assert right.call({"op": "slots"})[0]["entries"] == []
        right.close()
        assert "event=refused" in open(runtime / "logs" / "smp-node1.log").read()


def entries_of(states):
    """Listing entries as SMPs give them, from manifests alone (no SMP): for the catalog's own checks."""
    out = []
    for rank, state in states.items():
        flat = flatten(state)
        topo = Topology(world_size=WORLD, tp=TP, dp=DP, coords={"tp": rank % TP, "dp": rank // TP})
        plan = layout.plan(flat, step=STEP, rank=rank, world_size=WORLD, dp_rank=rank // TP, dp_size=DP,
                           topology=topo)
        out.append({"node": rank // 2, "rank": rank, "step": STEP, "segment": f"s{rank}", "data_off": 8192,
                    "data_len": plan.data_len, "source": "memory", "manifest": plan.manifest})
    return out


def test_a_hole_or_an_overlap_is_named_with_its_region():
    states = {r: rank_state(r, STEP) for r in range(WORLD)}
    catalog.check(catalog.fragments(entries_of(states), STEP))
    part = states[1]["exp_avg"].tensor
    states[1]["exp_avg"] = Sharded(part, ShardSpec("exp_avg.w", (6, 8), flat=(12, 24), main=False))
    with pytest.raises(CatalogHole, match=r"'exp_avg.w': elements \[12, 24\) of shape \(6, 8\) \(index \(1, 4\) "
                                          r"to \(2, 7\)\) are missing"):
        catalog.check(catalog.fragments(entries_of(states), STEP))
    states[1]["exp_avg"] = Sharded(part, ShardSpec("exp_avg.w", (6, 8), flat=(10, 22)))
    with pytest.raises(CatalogHole, match=r"elements \[10, 12\) .* held by two main fragments \(ranks 0 and 1\)"):
        catalog.check(catalog.fragments(entries_of(states), STEP))
    with pytest.raises(StepIncomplete, match=r"step 5 lacks ranks \[3\]"):
        catalog.complete_step(entries_of({r: states[r] for r in range(3)}))
