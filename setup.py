"""For tools that still run `python setup.py ...`: everything (metadata, packages, package data) is in
pyproject.toml, which `pip install .` and `python -m build` read directly."""
from setuptools import setup

setup()
