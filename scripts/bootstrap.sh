#!/usr/bin/env bash
# Creates a venv with everything the demo and the tests need, from a fresh machine: .venv from constraints.txt
# by default; `bootstrap.sh DIR CONSTRAINTS` builds DIR from another set of pins (make test-compat's
# combinations). Idempotent: a stamp keyed on pyproject.toml and the pins skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
pins=$(realpath "${2:-constraints.txt}")
stamp=$venv/.inmem_ft-stamp
want=$(cat pyproject.toml "$pins" | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip setuptools wheel
# torch first, pinned by the constraints, so nothing later can pull another build.
python -m pip install -q -c "$pins" torch
# DeepSpeed is an sdist; DS_BUILD_OPS=0 skips its CUDA ops so it builds on a CPU-only machine.
DS_BUILD_OPS=0 python -m pip install -q -c "$pins" -e '.[test]'
# megatron-core 0.17-0.19 declare Python >= 3.12, yet their wheels install and run on 3.11 with the flag below
# (shared/MEGATRON.md). Never nvidia-resiliency-ext: on 3.11 it breaks `import megatron.core`.
python -m pip install -q -c "$pins" numpy psutil pyyaml
python -m pip install -q -c "$pins" --ignore-requires-python megatron-core
echo "$want" > "$stamp"
