#!/usr/bin/env bash
# The wheels the one-GPU check needs that the device machine lacks (it reaches no package registry): Python 3.12
# binary wheels of inmem_ft's and DeepSpeed's dependencies the device has not (it has torch, numpy, pyarrow,
# xxhash, psutil, pytest, tqdm, packaging, transformers, accelerate, lightning), inmem_ft's own wheel and
# DeepSpeed without its ops. Installed there with:
#   pip install --no-index --find-links .cache/gpu-bundle inmem_ft deepspeed
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cache/gpu-bundle
pip=(.venv/bin/python -m pip)
rm -rf "$dest" && mkdir -p "$dest"
# --no-deps, so no second torch or numpy comes along; the list is what the device lacks of their closures.
"${pip[@]}" download -q -d "$dest" -c constraints.txt --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --no-deps pyeclib cryptography cffi pycparser prometheus_client \
    hjson ninja py-cpuinfo msgpack einops pydantic pydantic-core annotated-types typing-inspection
had_build=$([ -e build ] && echo 1 || true)
"${pip[@]}" wheel -q --no-deps --no-build-isolation -w "$dest" .
[ -n "$had_build" ] || rm -rf build  # setuptools' scratch folder, left in the checkout otherwise
DS_BUILD_OPS=0 "${pip[@]}" wheel -q --no-deps -w "$dest" "deepspeed==$(sed -n 's/^deepspeed==//p' constraints.txt)"
du -sh "$dest"
ls "$dest"
