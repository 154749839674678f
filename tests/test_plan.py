"""`inmem-ft plan` as a user runs it, and the goodput simulator behind it."""
import json
import subprocess
import sys

import pytest

from inmem_ft.config import InmemFTBlock
from inmem_ft.planning import plan as planning
from inmem_ft.planning.inputs import Cluster, Costs, Job, llama3_failures
from inmem_ft.planning.simulate import Restart, Schedule, Strategy, simulate


def plan(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "inmem_ft", "plan", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def llama3():
    """The plan for Llama 3's failure rate on 16,384 GPUs with the built-in (measured) costs."""
    out = plan("--preset", "llama3-405b", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_llama3_plan_meets_99_percent_and_beats_disk_checkpoints(llama3):
    ours, disk, replication, shrink = llama3["strategies"]
    assert ours["strategy"].startswith("in-memory EC") and ours["effective"] >= 0.99, ours
    assert shrink["strategy"].startswith("in-memory EC, shrink onto the survivors (") and shrink["effective"] >= 0.99, \
        shrink
    assert ours["low"] >= 0.99  # the 5th percentile over the seeded runs, too
    assert disk["effective"] < ours["effective"] and replication["effective"] <= ours["effective"] + 0.001
    assert llama3["memory"]["shm"] < llama3["memory"]["replication"]
    # Every second of the simulated runs is accounted for.
    for s in llama3["strategies"]:
        assert sum(s["accounts"].values()) == pytest.approx(1.0, abs=1e-9)
        assert s["accounts"]["useful"] == pytest.approx(s["effective"], abs=1e-9)


def test_disk_checkpoints_with_llama3s_published_setting_give_more_than_90_percent(llama3):
    """Llama 3 reports "more than 90%" effective training time with checkpoints to a 2 TB/s store."""
    disk = llama3["strategies"][1]
    assert disk["strategy"] == "disk checkpoints" and 0.90 < disk["effective"] < 0.995, disk
    assert 350 < sum(disk["failures"].values()) < 500  # Llama 3: 419 unexpected interruptions in 54 days


def test_the_report_prints_a_block_the_config_class_accepts_and_the_megatron_arguments(tmp_path):
    out = plan("--preset", "llama3-405b", "--seeds", "4", "--persist-dir", str(tmp_path / "ckpt"))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for line in ("recommended:", "  interval ", "  group, parity ", "  persist_every_steps ", "  memory per node ",
                 "effective training time over 54 days", "disk checkpoints", "full replication"):
        assert line in text
    start = text.index("{", text.index("inmem_ft block"))
    block = json.loads(text[start: text.index("\n}\n", start) + 2])["inmem_ft"]
    parsed = InmemFTBlock.from_dict(block)
    assert parsed.parity >= 1 and parsed.persist and parsed.memory_budget > 0
    assert f"--inmem-ft --inmem-ft-interval {block['interval']} --inmem-ft-config inmem_ft.json" in text


def test_a_plan_from_bytes_per_rank_and_a_measured_cost_file(tmp_path):
    costs = tmp_path / "scaling.json"
    costs.write_text(json.dumps({
        "size_slope": {"commit_s_per_GiB": 0.1},
        "nodes": [{"nodes": 2, "node_bytes": 1 << 30, "protect_s": 1.0, "restore_s": 0.2, "rebuild_s": 1.5},
                  {"nodes": 4, "node_bytes": 1 << 30, "protect_s": 1.1, "restore_s": 0.2, "rebuild_s": 1.6}],
        "nodes_slope": {"protect_cpu_s_per_node": 0.001, "commit_cpu_s_per_node": -0.01,
                        "restore_cpu_s_per_node": 0.0}}))
    out = plan("--nodes", "64", "--gpus-per-node", "8", "--bytes-per-rank", "4GiB", "--step-time-s", "2",
               "--node-mtbf-hours", "5000", "--costs", str(costs), "--shm", "200GiB", "--host-memory", "1TiB",
               "--seeds", "3", "--days", "10")
    assert out.returncode == 0, out.stderr
    assert f"protect_s_per_gib: 1 (measured: {costs})" in out.stdout
    assert "commit_slope_s_per_node: 0 (measured" in out.stdout  # a falling slope is not extrapolated
    assert "/dev/shm: needs" in out.stdout and "host memory: needs" in out.stdout


@pytest.mark.parametrize("args, message", [
    ((), "give --nodes and --gpus-per-node (or --preset llama3-405b)"),
    (("--nodes", "0"), "argument --nodes: '0' must be > 0"),
    (("--preset", "llama3-405b", "--share-node", "1.5"), "argument --share-node: '1.5' must be between 0 and 1"),
    (("--preset", "llama3-405b", "--share-node", "0.5"), "give all four --share-* values"),
    (("--nodes", "16", "--gpus-per-node", "8", "--params", "1e9", "--tp", "3", "--step-time-s", "1",
      "--node-mtbf-hours", "1000"), "TP 3 x PP 1 x DP 42 = 126 ranks, but the cluster has 128 GPUs"),
    (("--nodes", "16", "--gpus-per-node", "8", "--params", "1e9", "--node-mtbf-hours", "1000"), "give --step-time-s"),
    (("--nodes", "16", "--gpus-per-node", "8", "--bytes-per-rank", "1GiB", "--step-time-s", "1"),
     "give --node-mtbf-hours"),
    (("--nodes", "7", "--gpus-per-node", "8", "--bytes-per-rank", "1GiB", "--step-time-s", "1",
      "--node-mtbf-hours", "1000"), "7 nodes form no EC group"),
    (("--preset", "llama3-405b", "--costs", "/nonexistent/costs.json"), "--costs /nonexistent/costs.json: No such"),
    (("--preset", "llama3-405b", "--bytes-per-rank", "1GB", "--params", "1e9"), "either --params"),
])
def test_bad_inputs_give_one_line_and_exit_code_2(args, message):
    out = plan(*args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("inmem-ft plan: error: ") and message in out.stderr, out.stderr


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "ett.png"
    out = plan("--preset", "llama3-405b", "--nodes", "64", "--seeds", "2", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert f"plot: {png}" in out.stdout and png.stat().st_size > 10_000


# ---- the simulator ------------------------------------------------------------------------------------------

def strategy(interval_s, **kw):
    values = dict(name="s", interval_s=interval_s, blocking_s=5.0, commit_s=1.0, protect_s=2.0, persist_every=10,
                  persist_s=20.0, restore_memory_s=1.0, restore_peers_s=5.0, restore_disk_s=60.0, group_size=4,
                  tolerate=1)
    values.update(kw)
    return Strategy(**values)


RESTART = Restart(detect_s=1.0, restart_s=30.0, hang_timeout_s=60.0)
WEEK = 7 * 86400.0


def test_the_simulator_is_deterministic_by_seed():
    failures = llama3_failures()
    a, b, c = (simulate(strategy(120), RESTART, 2048, WEEK, failures, seed) for seed in (7, 7, 8))
    assert a.accounts == b.accounts and a.lost_per_failure == b.lost_per_failure
    assert a.accounts != c.accounts
    assert sum(a.failures.values()) == len(a.lost_per_failure) > 20


def test_without_failures_only_snapshots_cost_time():
    run = simulate(strategy(95), RESTART, 8, 10_000.0, Schedule(()))
    assert run.effective == pytest.approx(95 / 100, abs=1e-3)


def test_young_daly_interval_is_near_the_simulated_optimum():
    """With blocking b and job MTBF M, sqrt(2bM) should beat intervals 4x shorter and 4x longer."""
    failures = llama3_failures()
    mtbf = planning.job_mtbf_s(Cluster(2048, 8), failures)
    best = planning.young_daly(5.0, mtbf)

    def effective(interval):
        disk = strategy(interval, in_memory=False, persist_every=1, persist_s=0.0, restore_disk_s=10.0)
        return sum(simulate(disk, RESTART, 2048, 4 * WEEK, failures, seed).effective for seed in range(6)) / 6

    assert effective(best) > effective(best / 4) and effective(best) > effective(best * 4)


def test_a_loss_during_protection_falls_back_to_the_older_snapshot_and_beyond_m_to_disk():
    s = strategy(100, blocking_s=0.0, commit_s=0.0, protect_s=30.0, persist_every=3, persist_s=0.0,
                 restore_memory_s=0.0, restore_peers_s=0.0, restore_disk_s=0.0, group_size=2,
                 groups_span_racks=False)
    # A crash at 310 s restores the snapshot at 300 (committed at once): 10 s lost; a node lost at 410 s (10 s
    # after the snapshot at 400, still being protected) restores 300: 110 s lost; two nodes of one group at 650:
    # disk, whose newest is every 3rd snapshot, 600: 50 s lost.
    schedule = Schedule(((310.0, "crash", 0, 0.0), (410.0, "node", 1, 0.0), (650.0, "correlated", 2, 0.0)))
    run = simulate(s, Restart(0.0, 0.0, 0.0), 4, 2000.0, schedule)
    assert run.lost_per_failure == pytest.approx([10.0, 110.0, 50.0])
    assert dict(run.restores) == {"memory": 1, "peers": 1, "disk": 1}


def test_memory_per_node_counts_two_slots_and_two_parity_sets():
    job = Job(bytes_per_rank=1e9, checkpoint_bytes=1e12, step_s=1.0)
    mem = planning.memory(job, Cluster(16, 8), group_size=4, parity=1)
    assert mem.slots == 2 * 8e9 and mem.parity == pytest.approx(2 * 8e9 / 3) and mem.locked == 2 * 8e9


def test_shrinking_beats_waiting_for_a_spare_once_spares_are_slow():
    """A spare at hand: the shrink only adds its extra and the grow's restart. A spare that takes 10 minutes:
    every node loss waits it out, while the shrunk job loses 1/N of its rate meanwhile."""
    def effective(arrival):
        out = plan("--preset", "llama3-405b", "--seeds", "3", "--spare-arrival-s", arrival, "--json")
        assert out.returncode == 0, out.stderr
        waiting, _, _, shrink = json.loads(out.stdout)["strategies"]
        assert waiting["accounts"]["spare wait"] > 0 if arrival != "0" else waiting["accounts"]["spare wait"] == 0
        assert shrink["accounts"]["spare wait"] == 0 and shrink["accounts"]["grow"] > 0
        return waiting["effective"], shrink["effective"]

    waiting, shrink = effective("0")
    assert waiting > shrink
    waiting, shrink = effective("600")
    assert shrink > waiting


def test_costs_refuse_negative_values():
    with pytest.raises(ValueError, match="cost restart s must be a number >= 0"):
        Costs(restart_s=-1)


def test_the_built_in_costs_are_the_kept_result_files():
    """Every measured default is what the result files in benchmarks/results/ say (docs/planning.md renders
    them from there), so that a re-run benchmark and the planner's defaults cannot drift apart silently."""
    from pathlib import Path

    from inmem_ft.planning import inputs

    repo = Path(__file__).resolve().parent.parent
    measured = inputs.costs_from_results([str(repo / path) for path in inputs.KEPT_RESULTS])
    for name, source in measured.sources.items():
        assert getattr(Costs(), name) == pytest.approx(getattr(measured, name), rel=0.005, abs=1e-4), (name, source)
    assert set(measured.sources) >= {name for name, text in inputs.SOURCES.items() if "benchmarks/results/" in text}
