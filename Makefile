# The two entry points the README opens with; `make docs` builds the documentation site.
.PHONY: demo test test-full test-compat venv docs gpu-bundle

venv:
	@bash scripts/bootstrap.sh

demo: venv
	.venv/bin/python -m inmem_ft.demo

test: venv
	.venv/bin/python -m pytest -q

test-full: venv
	.venv/bin/python -m pytest -q -m "slow or not slow"

# The site, into site/, with warnings as errors; the docs tools (docs/requirements.txt, pinned) go into .venv
# once per change of that file. The reference and the benchmark figures are generated from the code and
# benchmarks/results/ during the build (scripts/mkdocs_hooks.py); README.md's figures block is checked too.
docs: venv
	@want=$$(sha256sum docs/requirements.txt | cut -c1-16); \
	if [ "$$(cat .venv/.docs-stamp 2>/dev/null)" != "$$want" ]; then \
		.venv/bin/python -m pip install -q -r docs/requirements.txt && echo "$$want" > .venv/.docs-stamp; fi
	.venv/bin/python benchmarks/render.py --check
	NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict --quiet

# Every combination of tests/compat/matrix.toml, each in a venv of its own (docs/compatibility.md).
test-compat: venv
	.venv/bin/python scripts/compat_matrix.py

# The wheels the device machine lacks for benchmarks/gpu_check.py, into .cache/gpu-bundle (README, "GPU check").
gpu-bundle: venv
	bash scripts/gpu_bundle.sh
