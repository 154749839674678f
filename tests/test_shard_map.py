"""Issue 8 end to end: every global tensor assembles exactly from the catalog's main fragments, for DeepSpeed
ZeRO-0..3 and the plain API, read through the SMPs of two simulated nodes; a restart whose global ranks land
on other nodes pulls their snapshots and resumes bit-identically. Real trainers, SMPs, sockets, memory."""
import pytest
import torch

from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp.client import SMPClient
from inmem_ft.snapshot import catalog
from inmem_ft.telemetry import read_losses
from inmem_ft.universal.assemble import keys, read_global

DS_ENV = {"DS_ACCELERATOR": "cpu"}


def ok(cluster, argv, **kw):
    attempt = cluster.run([str(a) for a in argv], **kw)
    assert attempt.ok, cluster.rank_log(attempt.number, attempt.first_failure or 0)[-4000:]
    return attempt


def assert_assembles(cluster, truth_path, step):
    """Every global tensor the trainers hold equals the one assembled from the catalog's main fragments."""
    client = SMPClient(cluster.socket_path(1))  # any node answers for the whole job
    try:
        listing = client.catalog()
        assert listing["unreachable"] == []
        assert catalog.complete_step(listing["entries"]) == step
        table = catalog.fragments(listing["entries"], step)
        catalog.check(table)
        truth = torch.load(truth_path, weights_only=True)
        assert {k for k in keys(table) if not k.startswith("_")} == set(truth)
        for key, want in truth.items():
            got = read_global(table, key, client.read)
            assert got.dtype == want.dtype and torch.equal(got, want), key
    finally:
        client.close()


@pytest.mark.parametrize("stage,dtype", [(2, "fp32"), (3, "bf16"),
                                         pytest.param(1, "bf16", marks=pytest.mark.slow),
                                         pytest.param(0, "fp32", marks=pytest.mark.slow),
                                         pytest.param(0, "bf16", marks=pytest.mark.slow)])
def test_deepspeed_global_tensors_assemble_from_the_catalog(job, runtime, stage, dtype):
    truth = runtime / "full.pt"
    with SimulatedCluster(2, 2, job, 256 << 20, str(runtime / "logs"), env=DS_ENV) as cluster:
        ok(cluster, ["-m", "inmem_ft.examples.deepspeed_gpt", "--zero-stage", stage, "--dtype", dtype,
                     "--steps", 4, "--interval", 2, "--dump-full", truth])
        assert_assembles(cluster, truth, step=4)


def test_plain_api_global_tensors_assemble_from_the_catalog(job, runtime):
    truth = runtime / "full.pt"
    with SimulatedCluster(2, 2, job, 64 << 20, str(runtime / "logs")) as cluster:
        ok(cluster, ["-m", "inmem_ft.examples.plain_pytorch", "--dp-split", "--steps", 4, "--interval", 2,
                     "--dump-full", truth])
        assert_assembles(cluster, truth, step=4)


def test_ranks_landing_on_other_nodes_pull_their_snapshots_and_resume_bit_identically(job, runtime):
    example = ["-m", "inmem_ft.examples.plain_pytorch", "--dp-split", "--steps", 10, "--interval", 2]
    swapped = {0: 1, 1: 1, 2: 0, 3: 0}  # torchrun's c10d rendezvous may order the nodes the other way round
    with SimulatedCluster(2, 2, job, 64 << 20, str(runtime / "logs")) as cluster:
        ok(cluster, example + ["--loss-log", runtime / "ref.jsonl"])
        reference = read_losses(runtime / "ref.jsonl")
        for node in range(2):  # a fresh job under the same id: nothing from the reference run
            cluster.kill_smp(node)
            cluster.wipe_node(node)
            cluster.start_smp(node)
        attempt = cluster.run([str(a) for a in example + ["--loss-log", runtime / "a.jsonl", "--die-at", 7,
                                                          "--die-rank", 3]])
        assert not attempt.ok and attempt.returncodes[3] == -9
        attempt = ok(cluster, example + ["--loss-log", runtime / "b.jsonl"], placement=swapped)
        log = cluster.rank_log(attempt.number, 0)
        assert "event=pulled" in log and "step=6 source=peer_memory" in log
        resumed = read_losses(runtime / "b.jsonl")
        assert resumed == {s: reference[s] for s in range(7, 11)}
