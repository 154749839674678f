"""Training state <-> manifest + raw tensor regions (no pickle anywhere), and the slot byte layout."""
from .._lazy import exporter

_EXPORTS = {"ShardSpec": ".shardspec", "Topology": ".topology", "Replicated": ".tree", "Sharded": ".tree",
            "flatten": ".tree", "unflatten": ".tree", "plan": ".layout", "unpack": ".layout",
            "shard_specs": ".layout", "register_safe_class": ".safe_types"}
__getattr__ = exporter(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
