# The two entry points the README opens with.
.PHONY: demo test test-full test-compat venv

venv:
	@bash scripts/bootstrap.sh

demo: venv
	.venv/bin/python -m inmem_ft.demo

test: venv
	.venv/bin/python -m pytest -q

test-full: venv
	.venv/bin/python -m pytest -q -m "slow or not slow"

# Every combination of tests/compat/matrix.toml, each in a venv of its own (docs/compatibility.md).
test-compat: venv
	.venv/bin/python scripts/compat_matrix.py
