"""Issue 10, item 3: `inmem-ft export --format megatron-dist` writes a Megatron snapshot held in memory as the
torch_dist checkpoint Megatron's `--load` reads, and stock Megatron-Core (`pretrain()` in a fresh
process that never imports inmem_ft, tests/megatron_dist_load.py) loads it on another TP layout: the same
iteration and consumed samples, every model and Adam ShardedTensor bit-identical to the snapshot's global
tensors, and training goes on. `--from DIR` exports the same step from the SMP's disk spill, with no SMP
running, verified; a torn or incomplete spill is an error naming what is wrong.
"""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from conftest import ROOT
from inmem_ft.errors import InmemFTError, SnapshotCorrupt, StepIncomplete
from inmem_ft.examples.megatron_gpt import CPU, CPU_DEFAULTS, DEFAULTS
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp import control
from inmem_ft.smp.segments import names_with_prefix, unlink
from inmem_ft.universal.source import MemorySource
from inmem_ft.universal.diskslots import DiskSlots
from test_export import stock

if importlib.util.find_spec("megatron") is None:  # not importorskip: importing it needs the shim first
    pytest.skip("megatron-core is not installed (scripts/bootstrap.sh installs it)", allow_module_level=True)

# Snapshots at 3 and 6; rank 0 dies in 7 (the job stops as a failure leaves it); step 6 is exported and
# loaded into a run of the same --train-iters (Megatron's scheduler refuses another), going on to 8.
STEP, ITERS, INTERVAL = 6, 8, 3
TP2 = ["--tensor-model-parallel-size", "2"]
CLI = "import sys; from inmem_ft.cli import main; sys.exit(main(sys.argv[1:]))"
# Where no CUDA (and so no triton) is, Megatron's modules import only behind the test shim.
SHIM = f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'tests')!r}); import megatron_cpu_shim; " \
       f"megatron_cpu_shim.install(); "


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A TP2 job (1 node, 2 ranks) whose step-6 snapshot stays in its SMP while the module runs; its global
    tensors, read from memory, are the ground truth."""
    tmp = tmp_path_factory.mktemp("mexport")
    job = f"t{uuid.uuid4().hex[:10]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INMEM_FT_RUNTIME_DIR", str(tmp / "run"))
        mp.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            with SimulatedCluster(1, 2, job, 256 << 20, str(tmp / "logs")) as cluster:
                attempt = cluster.run(["-m", "inmem_ft.examples.megatron_gpt", "--train-iters", str(ITERS), *TP2,
                                       "--inmem-ft", "--inmem-ft-interval", str(INTERVAL), "--die-at", str(STEP + 1)])
                assert attempt.returncodes[0] == -9, cluster.rank_log(attempt.number, 0)[-4000:]
                with MemorySource(cluster.socket_path(0)) as src:
                    assert src.step == STEP
                    torch.save({k: src.tensor(k) for k in src.keys()}, tmp / "truth.pt")
                yield {"tmp": tmp, "job": job, "socket": cluster.socket_path(0), "cluster": cluster}
        finally:
            for seg in names_with_prefix(f"inmemft.{job}."):
                unlink(seg)


def cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", (SHIM if CPU else "") + CLI, *map(str, argv)], capture_output=True,
                          text=True, timeout=300)


def stock_megatron_loads(source, out, name: str, layout: list[str], world: int) -> dict:
    argv = [*DEFAULTS, *(CPU_DEFAULTS if CPU else []), *layout, "--load", out, "--exit-on-missing-checkpoint",
            "--train-iters", ITERS, "--truth", source["tmp"] / "truth.pt"]
    got = stock("megatron_dist_load.py", argv, world, source["tmp"] / f"{name}.json")
    truth = torch.load(source["tmp"] / "truth.pt", weights_only=True)
    assert got["imported_inmem_ft"] is False
    assert got["iteration"] == STEP and got["consumed"] == STEP * 4  # global batch 4
    assert got["mismatched_total"] == 0, got["mismatched"]
    model_keys = [k for k in truth if not k.startswith("optimizer.")]
    assert got["model_checked"] >= len(model_keys) and got["optimizer_checked"] >= 2 * len(model_keys)
    assert got["trained"] == list(range(STEP + 1, ITERS + 1))  # and training went on from there
    print(json.dumps({k: v for k, v in got.items() if k != "mismatched"}))
    return got


@pytest.mark.compat
def test_megatron_dist_export_loads_in_stock_megatron_on_another_tp_layout(source):
    out = source["tmp"] / "mdist"
    proc = cli("export", "--job", source["job"], "--socket", source["socket"], "--format", "megatron-dist",
               "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported step {STEP}" in proc.stdout
    assert (out / "latest_checkpointed_iteration.txt").read_text() == str(STEP)
    assert sorted(os.listdir(out / f"iter_{STEP:07d}"))[:2] == [".metadata", "__0_0.distcp"]
    stock_megatron_loads(source, out, "tp1", [], 1)


def test_a_megatron_snapshot_as_deepspeed_universal_is_a_clear_error(source, tmp_path, capsys):
    from inmem_ft.cli import main

    assert main(["export", "--job", source["job"], "--socket", source["socket"], "--format", "deepspeed-universal",
                 "--out", str(tmp_path / "u"), "--quiet"]) == 1
    assert (f"--format deepspeed-universal needs a DeepSpeed snapshot; step {STEP} was taken by 'megatron': export "
            f"it with --format megatron-dist") in capsys.readouterr().err


@pytest.mark.slow
def test_megatron_dist_export_loads_in_stock_megatron_on_pp2(source):
    out = source["tmp"] / "mdist_pp2"
    proc = cli("export", "--job", source["job"], "--socket", source["socket"], "--format", "megatron-dist",
               "--out", out, "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock_megatron_loads(source, out, "pp2", ["--pipeline-model-parallel-size", "2"], 2)


def test_export_from_the_spill_with_no_smp_running_is_verified_and_whole(source):
    """Last in the module: it stops the SMP."""
    tmp = source["tmp"]
    cluster = source["cluster"]
    cluster.kill_smp(0)  # its slots stay in shared memory; one with a spill directory takes them over
    smp = control.start(cluster.job, 0, cluster.memory_budget, cluster.socket_path(0), cluster.smp_log(0),
                        extra_args=["--peers", cluster.peers, "--persist-dir", str(tmp / "spill")], env=cluster.env)
    smp.send_signal(signal.SIGTERM)  # spills steps 3 and 6, then no SMP runs
    assert smp.wait(timeout=60) == 0
    out = tmp / "from_spill"
    proc = cli("export", "--from", tmp / "spill", "--format", "megatron-dist", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported step {STEP} of the disk tier in {tmp / 'spill'}" in proc.stdout
    assert (out / "latest_checkpointed_iteration.txt").read_text() == str(STEP)
    # What stock Megatron loads (the test above): every global tensor, bit-identical to the snapshot's.
    it_dir = str(out / f"iter_{STEP:07d}")
    meta = FileSystemReader(it_dir).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
               if isinstance(m, TensorStorageMetadata)}
    dcp.load(tensors, checkpoint_id=it_dir, no_dist=True)
    truth = torch.load(tmp / "truth.pt", weights_only=True)
    assert sorted(tensors) == sorted(truth) and all(torch.equal(tensors[k], truth[k]) for k in truth)
    assert "common_state/shard_0_1" in meta and any(k.startswith("rng_state") for k in meta)

    # A torn file (cut short) and a missing rank are errors that say so, before anything is written.
    torn = tmp / "torn"
    shutil.copytree(tmp / "spill", torn)
    node = torn / source["job"] / "node0"
    victim = node / f"r1.step{STEP}.slot"
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(SnapshotCorrupt, match=f"r1.step{STEP}.slot.*torn or damaged"):
        DiskSlots(str(torn))
    victim.unlink()
    with pytest.raises(StepIncomplete, match=r"ranks \[1\] of 2 have no slot"):
        MemorySource(DiskSlots(str(torn)), STEP)
    with pytest.raises(InmemFTError, match="no flushed slots"):
        DiskSlots(str(tmp / "logs"))
