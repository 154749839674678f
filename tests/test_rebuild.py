"""Issue 11, item 4: a replacement SMP rebuilds its node in bounded pieces straight into its segments, an SMP
killed mid-rebuild resumes it (or starts it over when the group moved on), and a survivor serving corrupt
bytes is left out while another block of the stripe is used. Real SMPs on loopback, compared byte for byte
with what the lost node held."""
import dataclasses
import json
import re
import time

import pytest

from test_ec_cluster import G, make_cluster, protected_bytes, secret, write_step  # noqa: F401 (autouse fixture)
from conftest import wait_protected

from inmem_ft.cluster import nodedata
from inmem_ft.ec.stripes import StripeLayout
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp import control, paths
from inmem_ft.smp.segments import names_with_prefix, path_of, read_record, write_record
from inmem_ft.snapshot import segment as seg

LOST = 1


def cluster_with(job, runtime, m, piece):
    cluster = SimulatedCluster(G, 2, job, 64 << 20, str(runtime / "logs"), parity=m)
    cluster.ec = dataclasses.replace(cluster.ec, rebuild_piece=piece)
    return cluster.start()


def two_protected_steps(cluster):
    write_step(cluster, 1)
    write_step(cluster, 2)
    wait_protected(cluster, 2)
    return protected_bytes(cluster, LOST)


def rebuilt(cluster, node=LOST):
    """The node's bytes once its rebuild is done (a `list` waits for it)."""
    control.call(cluster.socket_path(node), "list", rank=2 * node)
    return protected_bytes(cluster, node)


def smp_log(runtime, node=LOST):
    return open(runtime / "logs" / f"smp-node{node}.log").read()


def test_a_rebuild_in_tiny_pieces_is_byte_identical(job, runtime):
    cluster = cluster_with(job, runtime, 1, 1024)  # a chunk is ~45 KiB: dozens of pieces per chunk
    try:
        original = two_protected_steps(cluster)
        cluster.lose_node(LOST)
        cluster.start_smp(LOST)
        assert rebuilt(cluster) == original
        log = smp_log(runtime)
        assert "piece=1024" in log and "event=rebuilt step=2 ranks=[2, 3]" in log
        assert control.call(cluster.socket_path(LOST), "status")["ec"]["rebuild"] == "ok"
    finally:
        cluster.stop()


@pytest.mark.parametrize("then", ["resume", pytest.param("restart", marks=pytest.mark.slow)])
def test_an_smp_killed_mid_rebuild_resumes_or_restarts_and_completes(job, runtime, then):
    cluster = cluster_with(job, runtime, 1, 64)  # 64-byte pieces: thousands of round trips, seconds to kill in
    try:
        original = two_protected_steps(cluster)
        cluster.lose_node(LOST)
        cluster.start_smp(LOST)
        prefix, record = f"inmemft.{job}.n{LOST}.", paths.rebuild_record_name(job, LOST)
        deadline = time.monotonic() + 60
        while json.loads(read_record(record) or "{}").get("done", 0) == 0:  # well under way
            assert time.monotonic() < deadline, "the rebuild never recorded any progress"
            time.sleep(0.01)
        cluster.kill_smp(LOST)  # SIGKILL, memory kept
        assert read_record(record), "the rebuild finished before it was killed"
        for name in names_with_prefix(prefix):  # nothing half-written looks like a snapshot
            if paths.parse_segment_name(name):
                with open(path_of(name), "rb") as f:
                    assert seg.is_blank(f.read(seg.HEADER_SIZE)), name
        if then == "restart":  # a record that does not match what the group holds now
            write_record(record, json.dumps({**json.loads(read_record(record)), "step": 1}))
        cluster.ec = dataclasses.replace(cluster.ec, rebuild_piece=None)
        cluster.start_smp(LOST)
        assert rebuilt(cluster) == original
        log = smp_log(runtime)
        if then == "resume":
            assert re.search(r"event=rebuild_resume step=2 .* from=(\d+)", log)[1] != "0"
        else:
            assert "event=rebuild_restart step=1" in log and log.count("event=rebuild_start step=2") == 2
        assert log.count("event=rebuilt step=2") == 1 and read_record(record) is None
    finally:
        cluster.stop()


def _flip(name, offset):
    with open(path_of(name), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def _node_data(cluster, node, step):
    """(NodeData of `node` at `step`, rank -> its slot's segment name)."""
    names, views = {}, {}
    for rank in (2 * node, 2 * node + 1):
        [entry] = [e for e in control.call(cluster.socket_path(node), "list", rank=rank)["slots"] if e["step"] == step]
        with open(path_of(entry["segment"]), "rb") as f:
            header = seg.Header.read(f.read(seg.HEADER_SIZE))
            f.seek(0)
            views[rank], names[rank] = memoryview(f.read(header.data_off + header.data_len)), entry["segment"]
    return nodedata.NodeData(step, views), names


@pytest.mark.parametrize("corrupt", ["parity", "slot"])
def test_a_survivor_serving_corrupt_bytes_is_left_out(job, runtime, corrupt):
    """G=4, m=2, node 1 lost: every stripe has one block to spare. Node 1's chunk 0 is data block 0 of stripe 3,
    decoded from node 2's chunk 1 (data first) and node 3's parity of stripe 3 (node 3's chunk 0)."""
    cluster = cluster_with(job, runtime, 2, 4096)
    try:
        original = two_protected_steps(cluster)
        if corrupt == "parity":  # refused by node 3 itself: its checksum fails
            [name] = names_with_prefix(f"inmemft.{job}.n3.parity.")
            _flip(name, 4096 + 100)
        else:  # flipped bits in node 2's slot memory, which its node reads serve unchecked
            data = {n: _node_data(cluster, n, 2) for n in range(G)}
            cs = StripeLayout(G, 2).chunk_size(StripeLayout(G, 2).padded_size(max(d.length for d, _ in data.values())))
            node2, names = data[2]
            target = cs + cs // 2  # middle of node 2's chunk 1 -> middle of node 1's chunk 0
            [(off, rank)] = [(off, rank) for (off, view), rank in zip(node2.parts[1:], sorted(names))
                             if off <= target < off + len(view)]
            _flip(names[rank], target - off)
        cluster.lose_node(LOST)
        cluster.start_smp(LOST)
        assert rebuilt(cluster) == original
        log = smp_log(runtime)
        if corrupt == "parity":
            assert "event=skip_source source=3 step=2" in log and "fails its checksum" in log
        else:
            assert "event=rebuild_retry" in log and "event=rebuild_corrupt source=2 step=2" in log
        assert "event=rebuilt step=2" in log
    finally:
        cluster.stop()


@pytest.mark.slow
def test_a_node_whose_chunks_exceed_the_peer_read_cap_rebuilds(job, runtime):
    """A node above 4 GiB does not fit four times on the shared 2-core CI box (with its other jobs), so the cap
    is lowered instead: with --max-peer-read 64 MiB a 1 GiB node (chunks of 341 MiB) is what a 13 GiB node is
    to the 4 GiB transport cap; reading a chunk whole would be refused, pieces pass."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from rebuild import commit  # benchmarks/rebuild.py: a slot of random bytes written in place

    from inmem_ft.smp.segments import Segment
    from inmem_ft.snapshot.checksum import checksum

    node_bytes, cap = 1 << 30, 64 << 20
    cluster = SimulatedCluster(G, 1, job, 2 * node_bytes + (64 << 20), str(runtime / "logs"), parity=1)
    cluster.ec = dataclasses.replace(cluster.ec, max_peer_read=cap)
    cluster.start()

    def digests():
        names = [e["segment"] for e in control.call(cluster.socket_path(LOST), "list", rank=LOST)["slots"]]
        names += names_with_prefix(f"inmemft.{job}.n{LOST}.parity.")
        out = []
        for name in names:
            segment = Segment(name)
            out.append(checksum(segment.buf))
            segment.close()
        return out
    try:
        for node in range(G):
            commit(cluster.socket_path(node), node, node_bytes, seed=node)
        for node in range(G):
            control.call(cluster.socket_path(node), "complete", step=1)
        wait_protected(cluster, 1, timeout=600)
        layout = StripeLayout(G, 1)
        assert layout.chunk_size(layout.padded_size(node_bytes)) > cap
        before = digests()
        cluster.lose_node(LOST)
        cluster.start_smp(LOST)
        assert digests() == before
        assert "event=rebuilt step=1" in smp_log(runtime)
    finally:
        cluster.stop()
