"""benchmarks/report.py: every result file says where, when, at which commit and by which command it was
measured, names no folder of the machine, and benchmarks/render.py renders every result file kept."""
import importlib
import json
import os
import platform

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


@pytest.fixture
def report(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    return importlib.import_module("report")


def test_results_carry_their_provenance_and_relative_paths(report, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", [os.path.join(BENCH, "scaling.py"), "--quick", "--json", "x.json"])
    out = tmp_path / "r.json"
    report.write({"lib": os.path.join(ROOT, ".venv", "lib", "x.so"), "n": 1.5}, str(out))
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["benchmark"] == "scaling"
    assert meta["command"] == "python benchmarks/scaling.py --quick --json x.json"
    assert meta["date"].endswith("Z") and meta["commit"]
    assert meta["machine"]["cores"] == os.cpu_count() and len(meta["machine"]["load_average"]) == 2
    assert data["lib"] == os.path.join(".venv", "lib", "x.so")
    host = platform.node()
    assert len(host) < 4 or host not in out.read_text()  # a host name too short to tell apart is not checked


def test_every_kept_result_file_renders(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    render = importlib.import_module("render")
    results = render.load()
    page = render.render_page(with_plots=False)
    for name, data in results.items():
        assert f"## `{name}`" in page and data["meta"]["command"] in page
