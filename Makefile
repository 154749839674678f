# The two entry points the README opens with.
.PHONY: demo test test-full venv

venv:
	@bash scripts/bootstrap.sh

demo: venv
	.venv/bin/python -m inmem_ft.demo

test: venv
	.venv/bin/python -m pytest -q

test-full: venv
	.venv/bin/python -m pytest -q -m "slow or not slow"
