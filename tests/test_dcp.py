"""Issue 38: torch.distributed.checkpoint over inmem_ft (inmem_ft.dcp) with real FSDP2 ranks on gloo, real
SMPs and DCP's own planners: kill -9 and resume from memory bit-identically."""
import json
import os

import pytest

from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.telemetry import read_losses

STEPS, INTERVAL = 12, 4
EXAMPLE = ["-m", "inmem_ft.examples.fsdp2_dcp", "--steps", str(STEPS), "--interval", str(INTERVAL)]


def run_ok(cluster, argv):
    attempt = cluster.run(argv)
    assert attempt.ok, cluster.rank_log(attempt.number, 0)
    return attempt


@pytest.fixture
def cluster(job, runtime):
    with SimulatedCluster(1, 2, job, 64 << 20, str(runtime / "logs")) as c:
        yield c


def reference_losses(tmp, extra=()):
    """The uninterrupted run's losses, from a job of its own."""
    own = os.environ.get("INMEM_FT_RUNTIME_DIR")
    os.environ["INMEM_FT_RUNTIME_DIR"] = str(tmp / "run")
    try:
        with SimulatedCluster(1, 2, f"dcpref{os.getpid()}", 64 << 20, str(tmp / "logs")) as c:
            run_ok(c, EXAMPLE + ["--loss-log", str(tmp / "ref.jsonl"), *extra])
    finally:
        if own is None:
            del os.environ["INMEM_FT_RUNTIME_DIR"]
        else:
            os.environ["INMEM_FT_RUNTIME_DIR"] = own
    return read_losses(tmp / "ref.jsonl")


@pytest.mark.parametrize("extra", [("--async-save",)], ids=["async"])
def test_fsdp2_kill9_resumes_bit_identically(cluster, runtime, tmp_path_factory, extra):
    reference = reference_losses(tmp_path_factory.mktemp("dcpref"), extra)
    assert sorted(reference) == list(range(1, STEPS + 1))
    before = runtime / "before.jsonl"
    attempt = cluster.run(EXAMPLE + ["--loss-log", str(before), "--die-at", "6", "--die-rank", "1", *extra])
    assert not attempt.ok and attempt.returncodes[1] == -9
    resumed = runtime / "resumed.jsonl"
    attempt = run_ok(cluster, EXAMPLE + ["--loss-log", str(resumed), *extra])
    losses = read_losses(resumed)
    assert min(losses) == INTERVAL + 1, "resumed from an unexpected snapshot"
    assert losses == {s: reference[s] for s in range(INTERVAL + 1, STEPS + 1)}  # bit-identical
    log = cluster.rank_log(attempt.number, 0)
    assert f"step={INTERVAL} source=dcp-memory" in log, log


@pytest.mark.slow
def test_load_onto_1_and_4_ranks_equals_stock_dcp(job, runtime):
    """FSDP2 over 2 ranks saved; loaded with DCP's planner on 1 and on 4 ranks, params and Adam moments equal
    to a stock dcp.save/dcp.load round trip of the same step."""
    stock = runtime / "stock"
    with SimulatedCluster(2, 2, job, 64 << 20, str(runtime / "logs")) as c:
        c.reshape(1, 2)
        run_ok(c, ["-m", "inmem_ft.examples.fsdp2_dcp", "--steps", "8", "--interval", "4", "--stock-dir", str(stock)])
        for nodes, per_node in ((1, 1), (2, 2)):
            c.reshape(nodes, per_node)
            out = runtime / f"compare{nodes * per_node}.json"
            run_ok(c, ["tests/dcp_compare.py", "--stock", str(stock), "--result", str(out)])
            result = json.loads(out.read_text())
            assert result["step"] == 8 and result["world"] == nodes * per_node and result["source"] == "dcp-memory"
            assert len(result["keys"]) == 6 * 4 and not result["mismatched"], result


@pytest.mark.slow
def test_lost_node_rebuilt_from_parity_resumes_bit_identically(job, runtime, tmp_path_factory, monkeypatch):
    """2 simulated nodes, m=1: node 1 is lost (trainer and SMP killed, memory wiped) and replaced by an empty
    SMP, which rebuilds node 1's slots from parity; the restarted job's DCP load resumes bit-identically."""
    from test_ec_resume import settled_step

    monkeypatch.setenv("INMEM_FT_SECRET", "dcp-test-secret-0123456789abcdef")
    reference = reference_losses(tmp_path_factory.mktemp("dcpref"))
    with SimulatedCluster(2, 1, job, 64 << 20, str(runtime / "logs"), parity=1) as c:
        attempt = c.run(EXAMPLE + ["--loss-log", str(runtime / "before.jsonl"), "--die-at", "10", "--die-rank", "1"])
        assert not attempt.ok and attempt.returncodes[1] == -9
        step = settled_step(c)
        c.lose_node(1)
        c.start_smp(1)
        attempt = run_ok(c, EXAMPLE + ["--loss-log", str(runtime / "resumed.jsonl")])
        log = c.rank_log(attempt.number, 1)
        assert f"event=rebuilt step={step}" in open(c.smp_log(1)).read()
    losses = read_losses(runtime / "resumed.jsonl")
    assert min(losses) == step + 1, f"did not resume from the protected step {step}"
    assert losses == {s: reference[s] for s in range(step + 1, STEPS + 1)}
    assert f"step={step} source=dcp-" in log, log


@pytest.mark.slow
def test_disk_tier_exports_as_stock_dcp(job, runtime):
    """A DCP snapshot flushed to the disk tier, exported with `inmem-ft export --from DIR --format torch-dcp`
    after the SMPs are gone, loads with stock FileSystemReader in a process without inmem_ft, equal to a stock
    dcp.save of the same step."""
    import subprocess
    import sys

    from inmem_ft.smp import control

    disk, stock, out, result = (runtime / n for n in ("disk", "stock", "exported", "result.json"))
    with SimulatedCluster(1, 2, job, 64 << 20, str(runtime / "logs"), smp_args=["--persist-dir", disk]) as c:
        run_ok(c, ["-m", "inmem_ft.examples.fsdp2_dcp", "--steps", "8", "--interval", "4", "--stock-dir", str(stock)])
        assert control.flush(job, 0, c.socket_path(0), timeout_s=120)["step"] == 8
    subprocess.run([sys.executable, "-m", "inmem_ft", "export", "--from", str(disk), "--format", "torch-dcp",
                    "--out", str(out), "--quiet"], check=True)
    subprocess.run([sys.executable, "tests/dcp_load.py", "--dir", str(out), "--truth-dcp", str(stock),
                    "--result", str(result)], check=True)
    got = json.loads(result.read_text())
    assert len(got["truth_keys"]) == 24 and not got["mismatched"] and got["step"] == 8, got
    assert not got["imported_inmem_ft"]


@pytest.mark.slow
def test_no_snapshot_is_one_clear_line_and_a_torn_one_is_never_loaded(job, smp):
    """One process, no process group (DCP's no_dist path): a job with no snapshot gets NoSnapshot in one line;
    a snapshot torn by a kill mid-write is never offered, and dcp.load reads the older complete one."""
    import subprocess
    import sys

    import torch
    import torch.distributed.checkpoint as dcp

    from inmem_ft import SnapshotConfig
    from inmem_ft.dcp import InmemStorageReader, InmemStorageWriter, NoSnapshot, close
    from test_failures import TORN_WRITER

    config = SnapshotConfig(job=job)
    with pytest.raises(NoSnapshot) as e:
        InmemStorageReader(config=config).read_metadata()
    assert "no snapshot on any reachable node" in str(e.value) and "\n" not in str(e.value)
    saved = {"w": torch.arange(10.0), "step": 1, "nested": {"b": torch.ones(3, dtype=torch.bfloat16)}}
    dcp.save(saved, storage_writer=InmemStorageWriter(config=config, step=1))
    close()
    writer = subprocess.Popen([sys.executable, "-c", TORN_WRITER, smp[0], "trainer"], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    writer.wait()
    loaded = {"w": torch.zeros(10), "step": -1, "nested": {"b": torch.zeros(3, dtype=torch.bfloat16)}}
    reader = InmemStorageReader(config=config)
    dcp.load(loaded, storage_reader=reader)
    close()
    assert reader.info.step == 1 and loaded["step"] == 1
    assert torch.equal(loaded["w"], saved["w"]) and torch.equal(loaded["nested"]["b"], saved["nested"]["b"])


@pytest.mark.slow
def test_hsdp_2x2_loads_as_fsdp_over_4(job, runtime):
    """HSDP over a 2 x 2 mesh saved (each replica group stores its chunks); loaded as plain FSDP over 4 ranks,
    equal to a stock dcp.save/dcp.load of the same step."""
    stock = runtime / "stock"
    with SimulatedCluster(2, 2, job, 64 << 20, str(runtime / "logs")) as c:
        run_ok(c, ["-m", "inmem_ft.examples.fsdp2_dcp", "--steps", "8", "--interval", "4", "--hsdp", "2",
                   "--stock-dir", str(stock)])
        out = runtime / "compare.json"
        run_ok(c, ["tests/dcp_compare.py", "--stock", str(stock), "--result", str(out)])
    result = json.loads(out.read_text())
    assert result["step"] == 8 and result["world"] == 4 and result["source"] == "dcp-memory"
    assert len(result["keys"]) == 6 * 4 and not result["mismatched"], result
