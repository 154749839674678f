"""benchmarks/deepspeed_save.py reports a peer it could not run: its rows say "skipped", one line says why with
the install line, and the plot is drawn all the same. (The figures are the benchmark's to measure, never a test's.)"""
import importlib
import os
import re

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    return importlib.import_module("deepspeed_save")


def stage(skipped: dict) -> dict:
    return {"inmem_blocking_s": 0.02, "inmem_save_call_s": 0.02, "torch_engine_s": 1.9, "restore_s": 1.2,
            "disk_load_s": 1.1, "inmem_commit_s": 0.3, "step_overhead_interval1": 1.1, "step_overhead_interval10": 1.01,
            "ratio_vs_torch_engine": 0.01, "restore_vs_disk_load": 1.09, "ratio_vs_dlrover_memory": None,
            "restore_vs_dlrover": None, "restore_vs_dlrover_load": None, "skipped": skipped}


def test_dlrover_rows_say_skipped_and_why(bench, capsys, tmp_path):
    why = f"DLRover is not installed (no module 'dlrover'): {bench.dlrover_flash.INSTALL}"
    results = {"params": 100.7e6, "ranks": 2, "repeats": 2, "quick": True,
               "stages": {"1": stage({"dlrover": why}), "3": stage({"dlrover": why})}}
    bench.print_table(results)
    out = capsys.readouterr().out
    for key in ("dlrover_memory_save_s", "dlrover_disk_save_s", "dlrover_restore_s", "ratio_vs_dlrover_memory",
                "restore_vs_dlrover"):
        assert re.search(rf"^  {key} .* skipped +skipped$", out, re.M), (key, out)
    assert out.count(why) == 1 and f"ZeRO-1,3 skipped DLRover rows: {why}" in out
    assert re.search(r"^  ratio_vs_torch_engine .* 0\.010 +0\.010$", out, re.M), out
    bench.plot(results, str(tmp_path / "ds.png"))
    assert (tmp_path / "ds.png").stat().st_size > 0


def test_dlrover_extra_pins_the_version_the_adapters_are_for(bench):
    with open(os.path.join(BENCH, "requirements-dlrover.txt")) as f:
        pins = [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]
    assert f"dlrover[k8s]=={bench.dlrover_flash.VERSION}" in pins


def test_pipeline_case_prints_its_ratio_plots_and_renders(bench, monkeypatch, capsys, tmp_path):
    """benchmarks/deepspeed_pipe_save.py (PP2 x DP2, sharing deepspeed_save's worker setup): its table, plot and
    the docs' rendering of a result."""
    pipe, render = importlib.import_module("deepspeed_pipe_save"), importlib.import_module("render")
    results = {"params": 100.7e6, "ranks": 4, "pp": 2, "dp": 2, "repeats": 3, "quick": True,
               "inmem_blocking_s": 0.03, "inmem_save_call_s": 0.02, "torch_engine_s": 3.0, "inmem_commit_s": 0.5,
               "step_s": 0.4, "ratio_vs_torch_engine": 0.01}
    pipe.print_table(results)
    out = capsys.readouterr().out
    assert "PP2 x DP2 (4 ranks" in out and re.search(r"^  ratio_vs_torch_engine .* 0\.010$", out, re.M), out
    pipe.plot(results, str(tmp_path / "pipe.png"))
    assert (tmp_path / "pipe.png").stat().st_size > 0
    assert "| DeepSpeed TorchCheckpointEngine save_checkpoint | 3.000 s |" in render.deepspeed_pipe_save(results)


def test_restart_headline_and_the_first_steps_parts(bench, capsys):
    """The headline is restart to first step done; each first step's parts (time, CPU time, page faults) are
    those of the run whose span was the median one."""
    def run(kind: str, span: float) -> dict:
        parts = {"forward": {"s": span, "cpu_s": 0.1, "minflt": int(span * 1000), "majflt": 0}}
        return {f"{kind}_then_step_s": span, f"{kind}_first_step_phases": parts}

    merged = bench.merge_load_runs([run("disk", 4.0), run("restore", 3.0), run("disk", 5.0), run("restore", 2.0),
                                    run("disk", 6.0), run("restore", 2.5)])
    assert merged["disk_then_step_s"] == 5.0 and merged["restore_then_step_s"] == 2.5
    assert merged["restore_first_step_phases"]["forward"]["minflt"] == 2500
    results = {"params": 100.7e6, "ranks": 2, "repeats": 2, "quick": True,
               "stages": {"1": {**stage({}), **merged, "restore_then_step_vs_disk": 0.5}}}
    bench.print_table(results)
    out = capsys.readouterr().out
    assert re.search(r"^  restore_then_step_vs_disk .* 0\.500$", out, re.M), out
    assert "ZeRO-1 after the inmem_ft restore, per part (s / CPU s / minor faults / major faults): " \
           "forward 2.500/0.100/2500/0" in out
