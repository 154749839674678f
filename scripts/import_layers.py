"""The import graph of inmem_ft/ against its layer table: import circles and arrows that point up a layer.

Every module is parsed (ast), never imported, so the count holds on a machine without torch or a framework.
Counted: every `import` and `from ... import` statement anywhere in a module, at the top, inside functions
and methods (a lazy import is still a dependency, and a lazy import back is how a circle hides), and under
`if TYPE_CHECKING:`. Not counted: `importlib.import_module` with a computed name (a dispatcher choosing a
format or an entry point) and the parent packages' `__init__` that Python runs on the way to a submodule
(an edge goes to the module named, `from .smp import paths` to `inmem_ft.smp.paths`). An arrow between two
modules of one layer is neither up nor down; circles are counted between modules, whatever their layers.

`python scripts/import_layers.py [ROOT]` prints (a) the circles, (b) the up-arrows, (c) the circles between
the package's first-level parts (smp/, cluster/, config.py, ...), each with its counts, and exits 1 when any is
non-empty; tests/test_layers.py keeps all three at zero. docs/design.md shows LAYERS.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parent.parent

# Lowest first; a module belongs to the longest entry that prefixes its name. Why the single modules sit
# where they do:
# - jobid.py (the job id rule), argtypes.py (the commands' argparse types and parser), compat.py (the
#   frameworks' tested ranges), deprecation.py, assets.py and telemetry.py (a rank's log lines, the loss
#   report, the fatal-signal handler) need nothing but errors/units: every layer may use them, the SMP too.
# - teardown.py (a rank's exit: process groups destroyed within bounds, then its own exit code) is used by
#   capture to bound its destroys; capture registers how to destroy its groups (teardown.destroy_first), so
#   teardown knows no layer above it: a leaf.
# - config.py (SnapshotConfig, the framework config's inmem_ft block) is a rank's settings: it resolves the
#   SMP's default socket (smp/paths.py), and capture is its first reader; nothing below capture reads it.
# - A `__main__` module is an entry point: it assembles the layers below it (`python -m inmem_ft.smp` wires
#   the daemon to cluster's peers, parity and reads) and nothing imports it, so it sits at the top.
# - export.py is `inmem-ft export`'s dispatcher over the adapters' writers: it sits with the CLI.
LAYERS: list[tuple[str, list[str]]] = [
    ("leaf", ["_lazy", "_version", "errors", "units", "envvars", "pages", "device", "jobid", "argtypes",
              "compat", "deprecation", "assets", "telemetry", "teardown"]),
    ("snapshot, ec", ["snapshot", "ec"]),
    ("persist", ["persist"]),
    ("smp", ["smp"]),
    ("cluster", ["cluster"]),
    ("capture", ["capture", "config"]),
    ("universal", ["universal"]),
    ("adapters", ["integrations", "dcp"]),
    ("planning", ["planning"]),
    ("agent", ["agent"]),
    ("launcher", ["launcher"]),
    ("top", ["cli", "demo", "export", "examples", ""]),  # and every __main__
]


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package under root, by its dotted name (a package by its own, for `__init__`)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    anchor = module.split(".")
    anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
    return ".".join(anchor + ([node.module] if node.module else []))


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the package that `module` imports, each resolved to the deepest module it names."""
    is_package = path.name == "__init__.py"
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def layer_of(module: str, package: str) -> int:
    """The index in LAYERS of the longest entry prefixing module (relative to the package)."""
    relative = module[len(package) + 1:] if module != package else ""
    if module.rpartition(".")[2] == "__main__":
        return len(LAYERS) - 1
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            hit = relative == prefix or (prefix and relative.startswith(prefix + "."))
            if hit and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise SystemExit(f"import_layers: {module} is in no layer of LAYERS; add it there (scripts/import_layers.py)")
    return best


def graph(root: Path) -> nx.DiGraph:
    known = modules(root)
    g = nx.DiGraph()
    g.add_nodes_from(known)
    for module, path in known.items():
        g.add_edges_from((module, target) for target in imports(module, path, known))
    return g


def circles(g: nx.DiGraph) -> list[list[str]]:
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def package_circles(g: nx.DiGraph, package: str) -> list[list[str]]:
    """Circles between the package's first-level parts (smp/, cluster/, config.py, ...): the circles (a) and
    the up-arrows (b) leave unseen where two parts of one layer import each other."""
    def part(module: str) -> str:
        if module.rpartition(".")[2] == "__main__":  # an entry point, above every part
            return module
        return module[len(package) + 1:].partition(".")[0] or package

    parts = nx.DiGraph((part(a), part(b)) for a, b in g.edges if part(a) != part(b))
    return circles(parts)


def up_arrows(g: nx.DiGraph, package: str) -> list[tuple[str, str]]:
    return sorted((a, b) for a, b in g.edges if layer_of(b, package) > layer_of(a, package))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path, default=REPO / "inmem_ft", help="the package folder")
    root = parser.parse_args(argv).root.resolve()
    g = graph(root)
    found_circles = circles(g)
    arrows = up_arrows(g, root.name)
    between = package_circles(g, root.name)
    print(f"{g.number_of_nodes()} modules, {g.number_of_edges()} import arrows")
    print(f"(a) {len(found_circles)} import circles ({sum(map(len, found_circles))} modules in them)")
    for circle in found_circles:
        print("    " + " <-> ".join(circle))
    print(f"(b) {len(arrows)} arrows pointing up a layer")
    for a, b in arrows:
        print(f"    {a} [{LAYERS[layer_of(a, root.name)][0]}] -> {b} [{LAYERS[layer_of(b, root.name)][0]}]")
    print(f"(c) {len(between)} circles between the package's parts")
    for circle in between:
        print("    " + " <-> ".join(circle))
    return 1 if found_circles or arrows or between else 0


if __name__ == "__main__":
    sys.exit(main())
