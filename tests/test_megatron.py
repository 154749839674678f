"""Megatron-Core with --inmem-ft, for real: megatron-core's own pretrain() loop on CPU (gloo, through
tests/megatron_cpu_shim.py), several processes, a real SMP. A rank is killed with SIGKILL mid-run; the
restarted job resumes from memory and every iteration's loss and grad norm equal the uninterrupted run's.

Each scenario costs three Megatron launches (about 25 s each on a quiet 2-core box, mostly imports): the
uninterrupted reference runs beside the first attempt. The 4-rank, PP and distributed-optimizer cases are
`slow` (.ci/run runs them).
"""
import importlib.util
import json
import re
import subprocess
import sys
from importlib.metadata import version

import pytest

from conftest import wait_protected
from inmem_ft.examples.corrupt import CORRUPT_AT
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp import paths
from inmem_ft.smp.segments import Segment, names_with_prefix
from inmem_ft.snapshot import ShardSpec
from inmem_ft.snapshot.segment import read_committed

if importlib.util.find_spec("megatron") is None:  # not importorskip: importing it needs the shim first
    pytest.skip("megatron-core is not installed (scripts/bootstrap.sh installs it)", allow_module_level=True)

ITERS, INTERVAL, DIE_AT = 8, 3, 5  # snapshots at 3 and 6; the kill after 5 resumes from 3
EXAMPLE = ["-m", "inmem_ft.examples.megatron_gpt", "--train-iters", str(ITERS)]
INMEM = ["--inmem-ft", "--inmem-ft-interval", str(INTERVAL)]
BUDGET = 256 << 20


def metrics(path) -> dict[int, tuple[float, float]]:
    """(loss, grad norm) of each iteration; an iteration run again after a restart keeps its last value."""
    out = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["step"]] = (rec["loss"], rec["grad_norm"])
    return out


def manifests(cluster, step: int) -> list[dict]:
    """Every rank's committed manifest of `step`, read from the SMPs' shared memory."""
    out = []
    for node in range(cluster.nodes):
        for name in names_with_prefix(paths.segment_prefix(cluster.job, node)):
            segment = Segment(name)
            try:
                _, manifest = read_committed(segment.buf, name)
            except Exception:
                continue  # the slot being reused, or never committed
            finally:
                segment.close()
            if manifest["step"] == step:
                out.append(manifest)
    return out


def assert_specs_tile_the_model(manifests: list[dict], world_size: int, sizes: dict) -> None:
    """What the resharding loader relies on: across all ranks, the `main` shards of every key cover each
    element of its global tensor exactly once (boxes and flat ranges), and the topology is Megatron's."""
    assert sorted(m["rank"] for m in manifests) == list(range(world_size))
    covered: dict[str, list] = {}
    for m in manifests:
        topo = m["topology"]
        assert topo["framework"] == "megatron" and topo["framework_version"] == version("megatron-core")
        assert {k: topo[k] for k in sizes} == sizes and topo["position"]["iteration"] == m["step"]
        assert sum(len(g["keys"]) for g in topo["optimizer"]["param_groups"]) > 0
        for leaf in m["leaves"]:
            for spec in map(ShardSpec.from_json, leaf.get("shards", ())):
                if spec.main:
                    covered.setdefault(spec.key, []).append(spec)
    assert any(k.startswith("decoder.layers.") for k in covered)
    for key, specs in covered.items():
        total = 1
        for d in specs[0].global_shape:
            total *= d
        pieces = {(s.offset, s.flat) for s in specs}
        assert len(pieces) == len(specs) and sum(s.numel for s in specs) == total, key


def kill_and_resume(runtime, job, layout: list[str], *, nodes=1, ranks_per_node=2, parity=None, lose_node=None):
    """The reference run, then the same run with rank `world-1` killed after DIE_AT, then the resumed run
    (after losing node `lose_node`, if given). Returns (reference, first attempt, resumed) metrics."""
    logs = runtime / "logs"
    ref = SimulatedCluster(nodes, ranks_per_node, f"{job}r", BUDGET, str(logs / "ref"))
    cluster = SimulatedCluster(nodes, ranks_per_node, job, BUDGET, str(logs), parity=parity)
    victim = cluster.world_size - 1
    with ref, cluster:
        ref.launch(EXAMPLE + layout + ["--loss-log", str(runtime / "ref.jsonl")])  # beside the first attempt
        first = cluster.run(EXAMPLE + layout + INMEM + ["--loss-log", str(runtime / "first.jsonl"),
                                                        "--die-at", str(DIE_AT), "--die-rank", str(victim)])
        assert first.returncodes[victim] == -9, cluster.rank_log(first.number, first.first_failure or 0)
        log = cluster.rank_log(first.number, 0)  # snapshots skip save_checkpoint (patch.snapshot_without_save_checkpoint)
        assert f"snapshot rank=0 step={INTERVAL} event=committed" in log and "saved local checkpoint" not in log
        reference = ref.wait()
        assert reference.ok, ref.rank_log(reference.number, reference.first_failure)
        if lose_node is not None:
            wait_protected(cluster, INTERVAL)
            cluster.lose_node(lose_node)
            cluster.start_smp(lose_node)
        resumed = cluster.run(EXAMPLE + layout + INMEM + ["--loss-log", str(runtime / "resumed.jsonl")])
        assert resumed.ok, cluster.rank_log(resumed.number, resumed.first_failure)
        assert_specs_tile_the_model(manifests(cluster, ITERS // INTERVAL * INTERVAL), cluster.world_size, sizes(layout))
        source = "peer_reconstruction" if lose_node is not None else "memory"
        for rank in range(cluster.world_size):
            if lose_node is None or cluster.node_of(rank) == lose_node:
                assert f"restore rank={rank} step={INTERVAL} source={source}" in cluster.rank_log(resumed.number, rank)
    return metrics(runtime / "ref.jsonl"), metrics(runtime / "first.jsonl"), metrics(runtime / "resumed.jsonl")


def sizes(layout: list[str]) -> dict:
    tp = int(layout[layout.index("--tensor-model-parallel-size") + 1]) if "--tensor-model-parallel-size" in layout else 1
    pp = int(layout[layout.index("--pipeline-model-parallel-size") + 1]) if "--pipeline-model-parallel-size" in layout else 1
    return {"tp": tp, "pp": pp}


def assert_exact_resume(reference, first, resumed):
    assert sorted(reference) == list(range(1, ITERS + 1))
    assert sorted(first) == list(range(1, DIE_AT + 1))
    assert min(resumed) == INTERVAL + 1, "did not resume from the snapshot of iteration 3"
    # bit for bit: the run with snapshots, the killed one and the resumed one all follow the reference
    assert first == {i: reference[i] for i in first}
    assert resumed == {i: reference[i] for i in range(INTERVAL + 1, ITERS + 1)}


@pytest.mark.compat
def test_tp2_kill_and_resume_is_exact(runtime, job):
    assert_exact_resume(*kill_and_resume(runtime, job, ["--tensor-model-parallel-size", "2"]))


@pytest.mark.slow
def test_a_restored_state_that_goes_nan_rolls_back_by_itself_to_the_older_snapshot_exact(runtime, job):
    """Issue 40 on Megatron (TP2): the snapshot of iteration 6 holds a negative Adam moment (valid checksums);
    a rank is killed after 7. The restart restores 6 and train_step's loss at 8 is NaN: the sentinel marks 6 bad
    and every rank stops with one line; the next restart restores 3 and matches the uninterrupted run."""
    layout, bad = ["--tensor-model-parallel-size", "2"], 2 * INTERVAL
    logs = runtime / "logs"
    ref = SimulatedCluster(1, 2, f"{job}r", BUDGET, str(logs / "ref"))
    cluster = SimulatedCluster(1, 2, job, BUDGET, str(logs))
    with ref, cluster:
        ref.launch(EXAMPLE + layout + ["--loss-log", str(runtime / "ref.jsonl")])  # beside the first attempt
        first = cluster.run(EXAMPLE + layout + INMEM + ["--loss-log", str(runtime / "first.jsonl"), "--die-at",
                                                        str(bad + 1), "--die-rank", "1"],
                            extra_env={CORRUPT_AT: str(bad)})
        assert first.returncodes[1] == -9, cluster.rank_log(first.number, first.first_failure or 0)
        assert ref.wait().ok
        reference = metrics(runtime / "ref.jsonl")
        tripped = cluster.run(EXAMPLE + layout + INMEM + ["--loss-log", str(runtime / "tripped.jsonl")])
        assert not tripped.ok
        log = cluster.rank_log(tripped.number, 0)
        assert f"RestoredStateBad: inmem_ft: step {bad + 2} after the restore from step {bad}: loss nan" in log, log
        resumed = cluster.run(EXAMPLE + layout + INMEM + ["--loss-log", str(runtime / "resumed.jsonl")])
        assert resumed.ok, cluster.rank_log(resumed.number, resumed.first_failure)
        assert f"restore rank=0 step={INTERVAL} source=memory" in cluster.rank_log(resumed.number, 0)
    assert metrics(runtime / "resumed.jsonl") == {i: reference[i] for i in range(INTERVAL + 1, ITERS + 1)}


@pytest.mark.slow
def test_pp2_kill_and_resume_is_exact(runtime, job):
    assert_exact_resume(*kill_and_resume(runtime, job, ["--pipeline-model-parallel-size", "2"]))


@pytest.mark.slow
def test_dp2_distributed_optimizer_kill_and_resume_is_exact(runtime, job):
    assert_exact_resume(*kill_and_resume(runtime, job, ["--use-distributed-optimizer"]))


@pytest.mark.slow
def test_tp2_pp2_kill_then_lost_node_rebuilt_from_parity(runtime, job, monkeypatch):
    # Two simulated nodes of one TP group each (the pipeline stages): rank 3 is killed, then node 1 is lost
    # (trainers, SMP, memory); its empty replacement SMP rebuilds the snapshot from parity and the job resumes.
    monkeypatch.setenv("INMEM_FT_SECRET", "megatron-test-secret-0123456789")
    assert_exact_resume(*kill_and_resume(runtime, job, ["--tensor-model-parallel-size", "2",
                                                        "--pipeline-model-parallel-size", "2"],
                                         nodes=2, ranks_per_node=2, parity=1, lose_node=1))


def test_bad_argument_fails_at_start_naming_it(runtime):
    # Megatron's own parser with our arguments added: it exits before any process group or SMP exists
    proc = subprocess.run([sys.executable, *EXAMPLE, "--inmem-ft", "--inmem-ft-interval", "0"], cwd=runtime,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "argument --inmem-ft-interval: '0': must be an integer number of iterations >= 1" in proc.stderr


def test_handle_snapshot_takes_one_snapshot_at_the_end_of_that_iteration(runtime, job):
    # --inmem-ft-interval 100 never falls due in 8 iterations: the one snapshot is the one asked for in
    # iteration 4 (example flag --snapshot-at), and the interval is 100 again after it.
    with SimulatedCluster(1, 2, job, BUDGET, str(runtime / "logs")) as cluster:
        done = cluster.run(EXAMPLE + ["--inmem-ft", "--inmem-ft-interval", "100", "--snapshot-at", "4"])
        assert done.ok, cluster.rank_log(done.number, done.first_failure or 0)
        log = cluster.rank_log(done.number, 0)
    assert re.findall(r"snapshot rank=0 step=(\d+) event=committed", log) == ["4"]


def test_a_different_non_persistent_save_interval_is_refused_not_overwritten(runtime):
    # It would set how often the job snapshots; the adapter drives that interval and says which to drop.
    proc = subprocess.run([sys.executable, *EXAMPLE, *INMEM, "--non-persistent-save-interval", "5"], cwd=runtime,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert (f"--inmem-ft snapshots every {INTERVAL} iterations through Megatron's non-persistent save, but "
            f"--non-persistent-save-interval is 5: drop it, or give --inmem-ft-interval 5") in proc.stderr


@pytest.mark.parametrize("argv,config,message", [
    (["--inmem-ft-job", "a/b"], None, "argument --inmem-ft-job:"),
    (["--inmem-ft-config", "missing.json"], None, "argument --inmem-ft-config: [Errno 2]"),
    (["--inmem-ft-config", "{c}"], {"interval": 10}, 'no "inmem_ft" block'),
    (["--inmem-ft-config", "{c}"], {"inmem_ft": {"intervall": 10}}, "unknown key(s) ['intervall']"),
    (["--inmem-ft-config", "{c}"], {"inmem_ft": {"parity": -1}}, "'parity' = -1"),
])
def test_bad_argument_values_name_the_argument(tmp_path, capsys, argv, config, message):
    import argparse

    from inmem_ft.integrations.megatron import add_args

    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        add_args(argparse.ArgumentParser()).parse_args([a.format(c=path) for a in argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_config_block_with_the_command_line_over_it(tmp_path):
    import argparse

    from inmem_ft.integrations.megatron import add_args, block_from_args

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"inmem_ft": {"interval": 5, "memory_budget": "1GiB"}}))
    args = add_args(argparse.ArgumentParser()).parse_args(["--inmem-ft-config", str(path), "--inmem-ft-interval", "7"])
    assert block_from_args(args).interval == 7 and block_from_args(args).memory_budget == 1 << 30


TRANSLATION = r"""
import megatron_cpu_shim
megatron_cpu_shim.install()
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from inmem_ft.integrations.megatron.manager import Described, from_tree, to_tree
from inmem_ft.snapshot.tree import flatten, unflatten

def tasd(rows):
    w = ShardedTensor.from_rank_offsets("decoder.w", torch.arange(rows * 3.0).view(rows, 3), (0, 1, 2),
                                        replica_id=(0, 1, 0))
    b = ShardedTensor.from_rank_offsets("decoder.b", torch.ones(4), replica_id=0)
    rng = ShardedObject("rng_state", {"seed": torch.tensor([7])}, (1,), (0,), replica_id=0)
    return type("T", (), {"common": {"iteration": 3}, "sharded_state_dict": {"m": {"w": w, "b": b}, "rng": rng}})()

described = Described()
first = to_tree(tasd(2), deduplicated=False, described=described)
again = to_tree(tasd(2), deduplicated=False, described=described)
assert again["tensors"]["described"] is first["tensors"]["described"]
assert [d.specs for d in again["tensors"]["data"]] == [d.specs for d in first["tensors"]["data"]]
assert all(a.specs[0] is b.specs[0] for a, b in zip(again["tensors"]["data"], first["tensors"]["data"]))
changed = to_tree(tasd(3), deduplicated=False, described=described)  # a new shape: described afresh
assert changed["tensors"]["data"][0].specs[0].global_shape == (6, 3)
flat = flatten(changed)
back = from_tree(unflatten(flat.tree, flat.values))
shards = {sh.key: sh for sh in back.sharded_state_dict.values()}
w = shards["decoder.w"]
assert (w.global_shape, w.global_offset, w.local_shape, w.replica_id) == ((6, 3), (3, 0), (3, 3), (0, 1, 0)), w
assert torch.equal(w.data, torch.arange(9.0).view(3, 3)) and shards["decoder.b"].replica_id == 0
assert torch.equal(shards["rng_state"].data["seed"], torch.tensor([7])) and back.common == {"iteration": 3}
# Restore hands back views into one copy of the whole slot; Megatron's optimizer load deep-copies the common
# Adam step once per parameter, and a deep copy of a view copies its whole storage.
slot = torch.arange(1 << 16, dtype=torch.float32)
restored = unflatten(flat.tree, flat.values)
restored["common"] = {"optimizer": {"state": {"common_step": slot[5]}}}
step = from_tree(restored).common["optimizer"]["state"]["common_step"]
assert step.item() == 5 and step.untyped_storage().nbytes() == 4, step.untyped_storage().nbytes()
print("ok")
"""


def test_translation_is_reused_while_the_shards_stay_the_same_and_round_trips(tmp_path):
    """to_tree reuses its specs and the tensors' JSON text across saves of the same shards, describes a changed
    shard afresh, and from_tree gives back the shard ids Megatron matches on load (real ShardedTensors), with
    the common part's tensors standalone, not views of the restored slot."""
    import os

    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", TRANSLATION], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


ASYNC_FINALIZE = r"""
import sys, threading
import megatron_cpu_shim
megatron_cpu_shim.install()
import torch.distributed as dist
from concurrent.futures import Future
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from inmem_ft.integrations.megatron import patch

patch.finalize_when_committed()
queue, done, commit = AsyncCallsQueue(), [], Future()
ours = AsyncRequest(None, (commit,), [lambda: done.append("ours")])
ours.add_finalize_fn(lambda: done.append("megatron's line"))
queue.schedule_async_request(ours)
assert queue.maybe_finalize_async_calls(blocking=False) == [] and done == [], done  # still committing
commit.set_result(None)
assert queue.maybe_finalize_async_calls(blocking=False) == [0] and done == ["ours", "megatron's line"], done
queue.schedule_async_request(AsyncRequest(None, (), [lambda: done.append("stock")]))  # keeps the stock caller
assert queue.maybe_finalize_async_calls(blocking=False) == [1] and done[-1] == "stock", done
late = Future()
queue.schedule_async_request(AsyncRequest(None, (late,), [lambda: done.append("late")]))
timer = threading.Timer(0.2, late.set_result, (None,))
timer.daemon = True
timer.start()
assert queue.maybe_finalize_async_calls(blocking=True) == [2] and done[-1] == "late", done  # waits for it
print("ok")
"""


def test_async_save_is_finalized_once_its_commit_is_done(tmp_path):
    """With --async-save, Megatron finalizes our request (our wait, then its "successfully saved" line) only once
    the snapshot's commit is done, not at the next iteration's start while it still runs (real AsyncCallsQueue)."""
    import os

    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", ASYNC_FINALIZE, str(tmp_path / "store")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
