"""Lazy re-exports (PEP 562), so that `python -m inmem_ft.smp` and the CLI start without importing torch:
the SMP daemon needs none of it, and a node starts one per job."""
import importlib


def exporter(package: str, exports: dict[str, str]):
    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        importlib.import_module(package).__dict__[name] = value
        return value

    return __getattr__
