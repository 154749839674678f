"""Imports point down: no import circle in inmem_ft/, no arrow up scripts/import_layers.py's layer table, no
circle between the package's parts. The graph is read from the sources (ast), so this costs under a second."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import import_layers  # noqa: E402

# Arrows up that stay for now, each with why; an entry whose arrow is gone fails the test, so it goes too.
ALLOWED_UP: set[tuple[str, str]] = set()  # none left: add one only with the issue that removes it


def test_imports_point_down():
    g = import_layers.graph(REPO / "inmem_ft")
    stale = sorted(edge for edge in ALLOWED_UP if not g.has_edge(*edge))
    assert not stale, f"these arrows are gone: remove them from tests/test_layers.py's ALLOWED_UP: {stale}"
    g.remove_edges_from(ALLOWED_UP)
    report = "see `python scripts/import_layers.py`; move the shared code down a layer (docs/design.md, Layers)"
    for what, found in (("import circles", import_layers.circles(g)),
                        ("arrows up a layer", import_layers.up_arrows(g, "inmem_ft")),
                        ("circles between the package's parts", import_layers.package_circles(g, "inmem_ft"))):
        assert not found, f"{what}: {found}; {report}"
