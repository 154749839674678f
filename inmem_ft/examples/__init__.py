"""Runnable examples; `python -m inmem_ft.examples.<name>`."""
