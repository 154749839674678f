#!/usr/bin/env bash
# Creates .venv with everything the demo and the tests need, from a fresh machine. Idempotent:
# a stamp keyed on the dependency files skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.inmem_ft-stamp
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel
# torch first, pinned, so nothing later can pull a CUDA build.
python -m pip install -q -c constraints.txt torch==2.13.0
# DeepSpeed is an sdist; DS_BUILD_OPS=0 skips its CUDA ops so it builds on a CPU-only machine.
DS_BUILD_OPS=0 python -m pip install -q -c constraints.txt -e '.[test]'
# megatron-core 0.19.2 declares Python >= 3.12, yet its wheel installs and runs on 3.11 with the flag below
# (shared/MEGATRON.md). Never nvidia-resiliency-ext: on 3.11 it breaks `import megatron.core`.
python -m pip install -q -c constraints.txt 'numpy<2.4' psutil
python -m pip install -q -c constraints.txt --ignore-requires-python megatron-core==0.19.2
echo "$want" > "$stamp"
