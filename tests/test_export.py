"""Issue 10, item 3: `inmem-ft export` writes a step held in memory as a checkpoint stock tools load, and
stock DeepSpeed ("load_universal": true, other ZeRO stage and DP size) and torch.distributed.checkpoint load
it in fresh processes that never import inmem_ft, every parameter and Adam moment bit-identical to the
source's (`--dump-full` of the example: the trainers' own global tensors, gathered by DeepSpeed)."""
import contextlib
import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from inmem_ft.launcher.ports import free_port
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp.segments import names_with_prefix, unlink

from conftest import ROOT

STEP = 4
DS_ENV = {"DS_ACCELERATOR": "cpu"}


@contextlib.contextmanager
def deepspeed_job(tmp, *example_args):
    """A 2-node x 2-rank DeepSpeed job whose step-4 snapshot stays in its SMPs while the context is open."""
    job = f"t{uuid.uuid4().hex[:10]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INMEM_FT_RUNTIME_DIR", str(tmp / "run"))
        mp.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            with SimulatedCluster(2, 2, job, 256 << 20, str(tmp / "logs"), env=DS_ENV) as cluster:
                attempt = cluster.run([str(a) for a in ["-m", "inmem_ft.examples.deepspeed_gpt", *example_args,
                                                        "--steps", STEP, "--interval", 2, "--dump-full",
                                                        tmp / "full.pt"]])
                assert attempt.ok, cluster.rank_log(attempt.number, attempt.first_failure or 0)[-4000:]
                yield {"tmp": tmp, "job": job, "socket": cluster.socket_path(1), "truth": tmp / "full.pt"}
        finally:
            for seg in names_with_prefix(f"inmemft.{job}."):
                unlink(seg)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """ZeRO-2 fp32, shared by the tests of this module."""
    with deepspeed_job(tmp_path_factory.mktemp("export"), "--zero-stage", 2) as src:
        yield src


def export(source, fmt: str, out) -> str:
    """The CLI, as a user runs it (node 1's SMP answers for the whole job)."""
    proc = subprocess.run([sys.executable, "-m", "inmem_ft.cli", "export", "--job", source["job"], "--socket",
                           source["socket"], "--format", fmt, "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def stock(script: str, args: list, world: int, result) -> dict:
    """Run a tests/ loader in `world` fresh processes, outside the repository, with only torch and deepspeed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "INMEM_FT_RUNTIME_DIR")}
    env.update(DS_ENV, OMP_NUM_THREADS="1", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", script), *map(str, args),
                               "--result", str(result)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              cwd=result.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    with open(result) as f:
        return json.load(f)


def assert_stock_loads_universal(source, stage: int, world: int) -> None:
    out = source["tmp"] / f"universal_z{stage}"
    line = export(source, "deepspeed-universal", out)
    assert f"exported step {STEP}" in line
    assert (out / "latest_universal").read_text() == f"global_step{STEP}"
    got = stock("ds_universal_load.py", ["--load-dir", out, "--zero-stage", stage, "--truth", source["truth"]],
                world, source["tmp"] / f"z{stage}.json")
    truth = torch.load(source["truth"], weights_only=True)
    assert got["imported_inmem_ft"] is False
    assert got["mismatched"] == []
    assert got["checked"] == sum(1 for k in truth if k.startswith("optimizer.state.")) + (
        0 if stage == 3 else sum(1 for k in truth if not k.startswith("optimizer.")))
    assert got["global_steps"] == STEP and got["optimizer_steps"] == [float(STEP)]
    assert got["scheduler"]["last_batch_iteration"] == STEP - 1


# Before DeepSpeed 0.19 its ZeRO-3 universal loader reads bare tensors, not the {'param': ...} files its own
# ds_to_universal writes from ZeRO-1/2 (docs/compatibility.md): the matrix loads at ZeRO-2, on another DP size.
@pytest.mark.parametrize("stage,world", [(3, 1), pytest.param(1, 2, marks=pytest.mark.slow),
                                         pytest.param(2, 1, marks=[pytest.mark.slow, pytest.mark.compat])])
def test_deepspeed_universal_export_loads_in_stock_deepspeed_on_another_layout(source, stage, world):
    assert_stock_loads_universal(source, stage, world)


@pytest.mark.slow
def test_zero3_bf16_snapshot_exports_for_stock_zero1_on_two_ranks(tmp_path):
    with deepspeed_job(tmp_path, "--zero-stage", 3, "--dtype", "bf16") as src:
        assert_stock_loads_universal(src, 1, 2)


def test_torch_dcp_export_loads_in_a_fresh_process(source):
    out = source["tmp"] / "dcp"
    export(source, "torch-dcp", out)
    got = stock("dcp_load.py", ["--dir", out, "--truth", source["truth"]], 1, source["tmp"] / "dcp.json")
    truth = torch.load(source["truth"], weights_only=True)
    assert got["imported_inmem_ft"] is False
    assert got["keys"] == sorted(truth) and got["mismatched"] == []
    assert got["step"] == STEP and got["topology"]["zero_stage"] == 2 and got["topology"]["dp"] == 4


def test_a_deepspeed_snapshot_as_megatron_dist_is_a_clear_error(source, tmp_path, capsys):
    from inmem_ft.cli import main

    assert main(["export", "--job", source["job"], "--socket", source["socket"], "--format", "megatron-dist",
                 "--out", str(tmp_path / "m"), "--quiet"]) == 1
    assert "--format megatron-dist needs a Megatron snapshot; step 4 was taken by 'deepspeed'" in capsys.readouterr().err
    assert not (tmp_path / "m" / "latest_checkpointed_iteration.txt").exists()
