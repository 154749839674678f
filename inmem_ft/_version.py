# The one place the version is written: the package metadata (pyproject.toml), inmem_ft.__version__,
# `inmem-ft --version` read it; CHANGELOG.md names it.
__version__ = "0.1.0"
