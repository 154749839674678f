"""Training state <-> manifest + raw tensor regions (no pickle anywhere), and the slot byte layout."""
from .layout import fragments, plan, unpack
from .safe_types import register_safe_class
from .tree import Fragment, Replicated, Sharded, flatten, unflatten

__all__ = ["Fragment", "Replicated", "Sharded", "flatten", "unflatten", "plan", "unpack", "fragments",
           "register_safe_class"]
