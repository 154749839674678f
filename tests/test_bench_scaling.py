"""benchmarks/scaling.py reports and draws whatever sections a run measured. (The figures are the benchmark's to
measure, never a test's.)"""
import importlib
import json
import os

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    return importlib.import_module("scaling")


def results():
    row = {"blocking_s": 0.02, "commit_s": 0.01, "floor_s": 0.02, "planned": 1, "stale": 0, "failures": 0}
    tensors = [{**row, "kind": kind, "tensors": n, "bytes": 64 << 20, "ratio_vs_fewest": n / 10,
                "ratio_vs_floor": 1.0, "overlap_call_s": 0.001} for kind in ("flat", "adam") for n in (10, 100_000)]
    return {"machine": {"cores": 2, "load_avg_1m": 3.0}, "config": {"quick": True, "repeats": 5},
            "size": [{**row, "bytes": b << 20} for b in (64, 1024)],
            "size_slope": {"blocking_s_per_GiB": 0.2, "commit_s_per_GiB": 0.1, "floor_s_per_GiB": 0.2},
            "tensors": tensors,
            "ranks": [{"ranks": r, "bytes_per_rank": 16 << 20, "blocking_s": 0.01 * r, "commit_s": 0.01,
                       "ratio_vs_one_rank": r, "node_GBps": 7.0} for r in (1, 8)],
            "protect": [{"nodes": g, "m": 1, "node_bytes": 16 << 20, "protect_s": 0.1 * g, "ratio_vs_smallest": g / 2,
                         "parity_bytes_per_node": (16 << 20) // (g - 1)} for g in (2, 8)],
            "nodes": [{"nodes": n, "node_bytes": 64 << 20, "commit_s": 0.1, "protect_s": 0.3, "restore_s": 0.05,
                       "rebuild_s": 0.3, "commit_cpu_s": 0.03, "protect_cpu_s": 0.2, "restore_cpu_s": 0.0}
                      for n in (2, 4)],
            "nodes_slope": {"protect_s_per_node": 0.01, "protect_cpu_s_per_node": 0.0}}


def test_every_section_is_reported_and_drawn(bench, tmp_path):
    text = bench.format_results(results())
    assert "goal: blocking at 100000 tensors <= 2x blocking at 10: 10000.00x (NOT met)" in text
    for title in ("state size", "tensor count", "ranks per node", "protection", "per-node costs vs nodes",
                  "slope per added node: protect_s_per_node +0.0100 s"):
        assert title in text
    bench.plot(results(), str(tmp_path / "all.png"))
    assert (tmp_path / "all.png").stat().st_size > 0
    json.dumps(results())  # what --json writes


def test_a_run_of_some_sections_is_reported_and_drawn(bench, tmp_path):
    for section in ("size", "tensors", "ranks", "protect", "nodes"):
        one = {k: v for k, v in results().items() if k in ("machine", "config", section, f"{section}_slope")}
        assert bench.format_results(one).count("\n") > 2
    bench.plot(one, str(tmp_path / "protect.png"))  # one panel, for the one section
    assert (tmp_path / "protect.png").stat().st_size > 0


def test_unknown_sections_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--only", "nodes,speed"])
    assert "unknown sections ['speed']" in capsys.readouterr().err
