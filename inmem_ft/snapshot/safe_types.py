"""The allowlist of Python classes a snapshot may carry besides plain data.

A manifest names classes by string; decoding never imports anything. Only classes registered here in the
running process can be rebuilt, the same idea as torch.load(weights_only=True)'s safe globals.
"""
import enum

_SAFE: dict[str, type] = {}


def class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def register_safe_class(*classes: type) -> None:
    """Allow instances of these classes (plain objects whose __dict__ is data, or enums) in snapshots."""
    for cls in classes:
        _SAFE[class_name(cls)] = cls


def is_registered(cls: type) -> bool:
    return _SAFE.get(class_name(cls)) is cls


def lookup(name: str) -> type:
    try:
        return _SAFE[name]
    except KeyError:
        from ..errors import UnsafeType

        raise UnsafeType(
            f"snapshot names class {name!r}, which is not registered in this process; "
            f"import the integration that registers it or call "
            f"inmem_ft.snapshot.register_safe_class(<that class>) before restoring"
        ) from None


def is_enum(cls: type) -> bool:
    return issubclass(cls, enum.Enum)
