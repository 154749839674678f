"""The user-facing docs carry nothing of one machine or one afternoon: no absolute paths of a development
machine, no development history, no references to files outside the repository; the README stays short and its
benchmark figures are what the result files say."""
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README_LIMIT = 15 * 1024

FORBIDDEN = {
    "an absolute path of a development machine": re.compile(r"(?<![\w.])/(?:work|root|home)/"),
    "development history": re.compile(r"\bthis branch\b|\bmain at [0-9a-f]{7}|\b(?:before|after) this change\b",
                                      re.IGNORECASE),
    "a file outside the repository": re.compile(r"\bshared/[\w./-]+|\b(?:FINDINGS|DESIGN|MEGATRON)\.md\b"),
}


def user_docs() -> list[Path]:
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]


@pytest.mark.parametrize("path", user_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_machine_paths_history_or_outside_files(path):
    text = path.read_text()
    found = [f"line {text.count(chr(10), 0, m.start()) + 1}: {what}: {m.group(0)!r}"
             for what, pattern in FORBIDDEN.items() for m in pattern.finditer(text)]
    assert not found, f"{path.relative_to(REPO)}:\n" + "\n".join(found)


def test_result_files_name_no_machine_paths():
    for path in sorted((REPO / "benchmarks" / "results").glob("*.json")):
        match = FORBIDDEN["an absolute path of a development machine"].search(path.read_text())
        assert not match, f"{path.relative_to(REPO)} holds {match.group(0)!r}"


def test_readme_fits_in_15_kib():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; move detail into docs/ (limit {README_LIMIT})"


def test_readme_figures_are_the_result_files():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import render

    text = (REPO / "README.md").read_text()
    assert render.rewrite_readme(text) == text, "README.md's figures are stale: python benchmarks/render.py --readme"


def test_the_generated_reference_covers_the_code():
    sys.path.insert(0, str(REPO / "scripts"))
    import docs_reference
    from inmem_ft.config import InmemFTBlock

    tables = {name: generate() for name, generate in docs_reference.GENERATORS.items()}
    for key in InmemFTBlock.__dataclass_fields__:
        assert f"`{key}`" in tables["config-block"], key
    for option in ("--inmem-ft-interval", "--memory-budget", "--persist-dir", "--metrics-port"):
        assert f"`{option}`" in tables["megatron-args"] + tables["smp-module"], option
    assert "### `inmem-ft smp start`" in tables["cli"] and "### `inmem-ft export`" in tables["cli"]
    assert "`event=commit`" in tables["events"] and "`INMEM_FT_JOB`" in tables["env-vars"]
