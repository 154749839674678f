"""Render the supported-versions table from tests/compat/results.json (written by make test-compat) into
README.md and docs/compatibility.md, between <!-- BEGIN compat-table --> and <!-- END compat-table -->.

    python scripts/compat_table.py [--check]

--check: change nothing; exit 1 naming each file whose table is not what the results give."""
from __future__ import annotations

import argparse
import json
import os
import sys

from packaging.specifiers import SpecifierSet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from inmem_ft.compat import TESTED  # noqa: E402

RESULTS = os.path.join(ROOT, "tests", "compat", "results.json")
FILES = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "compatibility.md")]
BEGIN, END = "<!-- BEGIN compat-table -->", "<!-- END compat-table -->"


def floors(framework: str) -> str:
    """The tested series as their first releases: '0.18.9+ or 0.19.8+'."""
    return " or ".join(next(f"{s.version}+" for s in SpecifierSet(series) if s.operator == ">=")
                       for series in TESTED[framework])


def table(results: dict) -> str:
    rows = ["| Combination | Python | torch | DeepSpeed | megatron-core | numpy | `compat` tests | Build + tests | Run |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        outcome = f"{r['passed']} passed" + (f", **{r['failed']} failed**" if r["failed"] else "") + (
            f", {len(r['not_run'])} not run" if r.get("not_run") else "")
        rows.append(f"| {name} | {r['python']} | {r['torch']} | {r['deepspeed']} | {r['megatron-core']} | "
                    f"{r['numpy']} | {outcome} | {r['build_s']} + {r['tests_s']} s | {r['date']}, {r['commit']} |")
    machines = sorted({r["machine"] for r in results.values()})
    return "\n".join([
        f"The adapters accept DeepSpeed {floors('deepspeed')} and megatron-core {floors('megatron-core')}, "
        f"within each minor series (`inmem_ft/compat.py`);",
        f"each row is a combination `make test-compat` ran (`tests/compat/results.json`, on {'; '.join(machines)};",
        "build time 0: an existing venv; what failed or was not run, and why: `docs/compatibility.md`):",
        "",
        *rows,
    ])


def rendered(text: str, block: str, path: str) -> str:
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise SystemExit(f"{os.path.relpath(path, ROOT)}: no {BEGIN} ... {END} markers")
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file's table is stale")
    args = p.parse_args()
    with open(RESULTS) as f:
        block = table(json.load(f))
    stale = []
    for path in FILES:
        with open(path) as f:
            text = f.read()
        new = rendered(text, block, path)
        if new != text:
            stale.append(os.path.relpath(path, ROOT))
            if not args.check:
                with open(path, "w") as f:
                    f.write(new)
    if args.check and stale:
        print(f"stale compat table in {', '.join(stale)}: run python scripts/compat_table.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
