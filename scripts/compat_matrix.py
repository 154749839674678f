"""make test-compat: run the tests marked `compat` in one venv per combination of tests/compat/matrix.toml and
record each combination's versions and outcome in tests/compat/results.json, from which
scripts/compat_table.py renders the supported-versions table.

    python scripts/compat_matrix.py [--ci] [NAME ...]

--ci: only the combinations marked `ci = true`, each running its `ci_tests` (default: all its compat tests) and
recording nothing (results.json is what full runs found). Exits 1 when a combination fails its build or a test."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATRIX = os.path.join(ROOT, "tests", "compat", "matrix.toml")
RESULTS = os.path.join(ROOT, "tests", "compat", "results.json")
CACHE = os.path.join(ROOT, ".cache", "compat")
MAIN_VENV = os.path.join(ROOT, ".venv")  # the newest combination's, made by `make venv`
DISTRIBUTIONS = ("torch", "deepspeed", "megatron-core", "numpy")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def combinations() -> list[dict]:
    with open(MATRIX, "rb") as f:
        return tomllib.load(f)["combination"]


def constraints(pins: dict) -> str:
    """constraints.txt with the combination's pins in place of its lines for the same distributions."""
    kept = []
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        for line in f:
            name = _NAME.match(line.strip())
            if not (name and name.group(0).lower() in pins):
                kept.append(line.rstrip("\n"))
    return "\n".join(kept + [f"{name}=={version}" for name, version in sorted(pins.items())]) + "\n"


def build(combo: dict) -> str:
    """The combination's venv, built (or kept, when its pins are unchanged) by scripts/bootstrap.sh, less the
    distributions its `without` names."""
    pins = combo.get("pins", {})
    if not pins:
        return MAIN_VENV
    venv = os.path.join(CACHE, combo["name"])
    os.makedirs(venv, exist_ok=True)
    path = os.path.join(CACHE, f"{combo['name']}.constraints.txt")
    with open(path, "w") as f:
        f.write(constraints(pins))
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "bootstrap.sh"), venv, path], check=True)
    if combo.get("without"):
        subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", "uninstall", "-q", "-y", *combo["without"]],
                       check=True)
    return venv


def installed(python: str) -> dict:
    code = ("import json, platform, importlib.metadata as m\n"
            "def v(d):\n"
            "    try: return m.version(d)\n"
            "    except m.PackageNotFoundError: return None\n"
            f"print(json.dumps({{'python': platform.python_version(), **{{d: v(d) for d in {DISTRIBUTIONS!r}}}}}))")
    return json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)


def run_tests(python: str, name: str, not_run: dict, only: list | None = None) -> dict:
    """The compat tests in `python`'s venv (`only` these node ids, if given) less those `not_run` names (node id:
    why the combination cannot run it): counts, and the node ids that did not pass (a skip counts: a test that
    cannot run there says nothing about the combination)."""
    report = os.path.join(CACHE, f"{name}.junit.xml")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": os.path.join(CACHE, f"{name}.torch_extensions")}
    env.pop("INMEM_FT_ALLOW_UNTESTED", None)  # each combination must pass the adapters' own version check
    if os.path.exists(report):
        os.remove(report)
    # A basetemp of its own keeps the combination's logs after the run (pytest keeps only the newest three of
    # its shared ones); under /tmp, since the SMPs' socket paths inside it must stay short.
    deselect = [arg for node in not_run for arg in ("--deselect", node)]
    subprocess.run([python, "-m", "pytest", "-q", "-m", "compat", *(only or []), f"--junitxml={report}", *deselect,
                    f"--basetemp={tempfile.gettempdir()}/inmem_ft-compat-{name}"], cwd=ROOT, env=env)
    if not os.path.exists(report):
        return {"passed": 0, "failed": 1, "not_passed": ["pytest wrote no report"], "not_run": not_run}
    passed, failed = 0, []
    for case in ET.parse(report).getroot().iter("testcase"):
        if any(child.tag in ("failure", "error", "skipped") for child in case):
            failed.append(f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}")  # the node id
        else:
            passed += 1
    return {"passed": passed, "failed": len(failed), "not_passed": failed, "not_run": not_run}


def commit() -> str:
    def git(*argv):
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def record(name: str, result: dict) -> None:
    results = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            results = json.load(f)
    results[name] = result
    order = [c["name"] for c in combinations()]
    results = {n: results[n] for n in sorted(results, key=lambda n: order.index(n) if n in order else len(order))
               if n in order}
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")


def run(combo: dict, ci: bool = False) -> bool:
    name = combo["name"]
    ran = commit()  # what the tests run, before anything can change the checkout
    print(f"[compat] {name}: building", flush=True)
    start = time.monotonic()
    try:
        python = os.path.join(build(combo), "bin", "python")
    except subprocess.CalledProcessError as e:
        print(f"[compat] {name}: the venv did not build ({e})", file=sys.stderr)
        return False
    built = time.monotonic()
    versions = installed(python)
    print(f"[compat] {name}: {versions}", flush=True)
    outcome = run_tests(python, name, combo.get("not_run", {}), combo.get("ci_tests") if ci else None)
    if not ci:
        record(name, {**versions, **outcome, "build_s": round(built - start),
                      "tests_s": round(time.monotonic() - built), "date": datetime.date.today().isoformat(),
                      "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
                      "commit": ran})
    print(f"[compat] {name}: {outcome['passed']} passed, {outcome['failed']} not passed "
          f"{outcome['not_passed']} in {time.monotonic() - start:.0f} s", flush=True)
    return outcome["failed"] == 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ci", action="store_true", help="only the combinations marked ci = true, their ci_tests")
    p.add_argument("names", nargs="*", help="only these combinations")
    args = p.parse_args()
    known = {c["name"]: c for c in combinations()}
    unknown = set(args.names) - set(known)
    if unknown:
        p.error(f"no combination {', '.join(sorted(unknown))} in tests/compat/matrix.toml (have: {', '.join(known)})")
    chosen = [c for c in known.values() if (not args.names or c["name"] in args.names) and (c.get("ci") or not args.ci)]
    ok = [run(c, args.ci) for c in chosen]  # one at a time: each combination's tests use the whole machine
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
