"""Issue 26 items 2 and 3: the adapters accept the tested release ranges (patch releases, local builds of a
tested release), refuse others in one line naming the range and the opt-in, and run an untested one when opted
in; the ranges and the supported-versions table are what the compatibility matrix passed."""
import json
import logging
import os
import subprocess
import sys

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from inmem_ft import compat
from inmem_ft.config import InmemFTBlock
from inmem_ft.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("framework, version, tested", [
    ("deepspeed", "0.19.8", True),
    ("deepspeed", "0.19.9", True),
    ("deepspeed", "0.19.8+abc1234", True),  # a source build of a tested release
    ("deepspeed", "0.19.7", False),
    ("deepspeed", "0.18.9", True),  # the 0.18 series, from its tested release
    ("deepspeed", "0.18.8", False),
    ("deepspeed", "0.17.6", True),  # the 0.17 series, from its tested (and last) release
    ("deepspeed", "0.17.5", False),
    ("deepspeed", "0.16.9", True),  # the 0.16 series, from its tested (and last) release
    ("deepspeed", "0.16.8", False),
    ("deepspeed", "0.20.0", False),
    ("deepspeed", "0.20.0rc1", False),
    ("deepspeed", "not-a-version", False),
    ("megatron-core", "0.19.2", True),
    ("megatron-core", "0.19.5", True),
    ("megatron-core", "0.19.3+git1a2b3c", True),
    ("megatron-core", "0.19.1", False),
    ("megatron-core", "0.18.2", True),  # the 0.18 series, from its tested release
    ("megatron-core", "0.18.1", False),
    ("megatron-core", "0.17.1", True),  # the 0.17 series
    ("megatron-core", "0.17.0", False),
    ("megatron-core", "0.20.0", False),
])
def test_tested_ranges(framework, version, tested):
    assert compat.is_tested(framework, version) is tested


def test_untested_release_is_refused_in_one_line_naming_range_and_opt_in(monkeypatch):
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    with pytest.raises(ConfigError) as e:
        compat.check("deepspeed", "0.20.0", without="remove the inmem_ft block")
    said = str(e.value)
    assert "\n" not in said
    assert f"deepspeed 0.20.0 is not supported (tested: {compat.tested('deepspeed')})" in said
    assert "INMEM_FT_ALLOW_UNTESTED=1" in said and '"allow_untested": true' in said
    assert said.endswith("or remove the inmem_ft block")


@pytest.mark.parametrize("how", ["env", "config"])
def test_opt_in_runs_an_untested_release_with_one_warning(monkeypatch, caplog, how):
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    if how == "env":
        monkeypatch.setenv(compat.ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="inmem_ft"):
        assert compat.check("megatron-core", "0.21.0", allow_untested=how == "config") == "0.21.0"
    [record] = caplog.records
    assert f"megatron-core 0.21.0 is untested (tested: {compat.tested('megatron-core')})" in record.getMessage()
    assert ("INMEM_FT_ALLOW_UNTESTED=1" if how == "env" else '"allow_untested": true') in record.getMessage()


def test_env_opt_in_takes_only_a_true_value(monkeypatch):
    monkeypatch.setenv(compat.ALLOW_ENV, "0")
    with pytest.raises(ConfigError):
        compat.check("deepspeed", "0.21.0")


def test_config_key():
    assert InmemFTBlock.from_dict({}).allow_untested is False
    assert InmemFTBlock.from_dict({"allow_untested": True}).allow_untested is True
    with pytest.raises(ConfigError, match="'allow_untested' = 'yes': must be true or false"):
        InmemFTBlock.from_dict({"allow_untested": "yes"})


@pytest.mark.compat
def test_installed_megatron_core_passes_the_patch_check():
    """The check megatron's install() runs, on the installed megatron-core (through the CPU shim, in a process
    of its own as tests/test_megatron.py does)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), ROOT])}
    env.pop(compat.ALLOW_ENV, None)
    code = ("import megatron_cpu_shim; megatron_cpu_shim.install(); "
            "from inmem_ft.integrations.megatron import patch; print(patch.check_version())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert compat.is_tested("megatron-core", out.stdout.strip())


def test_package_extras_declare_the_tested_ranges():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert compat.requirement("deepspeed") in extras["deepspeed"]
    assert compat.requirement("megatron-core") in extras["megatron"]


def matrix_results():
    with open(os.path.join(ROOT, "tests", "compat", "results.json")) as f:
        return json.load(f)


def test_readme_and_docs_tables_are_what_the_matrix_results_give():
    """The supported-versions table cannot drift from tests/compat/results.json: README.md and
    docs/compatibility.md hold exactly what scripts/compat_table.py renders from it."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compat_table.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("framework", ["deepspeed", "megatron-core"])
def test_tested_ranges_start_at_the_oldest_release_the_matrix_passed(framework):
    passed = [r[framework] for r in matrix_results().values() if r["failed"] == 0 and r[framework]]
    assert passed and all(compat.is_tested(framework, v) for v in passed)
    floors = {Version(s.version) for series in compat.TESTED[framework] for s in SpecifierSet(series)
              if s.operator == ">="}
    assert {min(v for v in map(Version, passed) if (v.major, v.minor) == (f.major, f.minor)) for f in floors} == floors


def test_the_newest_combination_is_constraints_txt():
    newest = matrix_results()["newest"]
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        pins = dict(line.strip().split("==") for line in f if "==" in line)
    for name in ("torch", "deepspeed", "megatron-core"):
        assert Version(newest[name]).public == pins[name], name


def test_declared_ranges_include_the_gpu_target_stack():
    """The GPU machine the project is checked on (FINDINGS: Python 3.12, torch 2.11.0+cu130, numpy 2.5.2) must be
    installable into: pyproject's ranges cannot exclude it, though the matrix does not run it."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert SpecifierSet(project["requires-python"]).contains("3.12")
    wanted = {"torch": "2.11.0+cu130", "numpy": "2.5.2"}
    for requirement in map(Requirement, project["dependencies"]):
        if requirement.name in wanted:
            assert requirement.specifier.contains(wanted.pop(requirement.name)), requirement
    assert not wanted, f"not declared: {wanted}"
