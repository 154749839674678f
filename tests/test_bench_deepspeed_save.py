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
