"""One complete step of a job as the SMPs hold it, opened through the local SMP: the catalog of its global
tensors, each read whole on demand, and any rank's small (unsharded) state, decoded from its manifest.

Nothing is unpickled: manifests are JSON, tensor bytes are raw and checksum-verified by the SMPs.
"""
from __future__ import annotations

import math

import torch

from ..errors import InmemFTError, StepIncomplete
from ..smp.client import SMPClient
from ..snapshot import catalog
from ..snapshot.tree import dtype_from_name, unflatten
from .assemble import keys, read_global


class MemorySource:
    def __init__(self, socket_path: str, step: int | None = None):
        self.client = SMPClient(socket_path)
        try:
            listing = self.client.catalog()
            try:
                self.step = catalog.complete_step(listing["entries"], step)
            except StepIncomplete as e:
                lost = "; ".join(f"node {u['node']}: {u['error']}" for u in listing["unreachable"])
                raise StepIncomplete(f"{e}{f' (unreachable: {lost})' if lost else ''}") from None
            self.table = catalog.fragments(listing["entries"], self.step)
            catalog.check(self.table)
        except BaseException:
            self.client.close()
            raise
        # The copy catalog.fragments reads (memory before parity) also gives each rank's manifest.
        self.manifests: dict[int, dict] = {}
        for e in sorted((e for e in listing["entries"] if e["step"] == self.step),
                        key=lambda e: (e["source"] != "memory", e["node"])):
            self.manifests.setdefault(e["rank"], e["manifest"])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.client.close()

    def keys(self) -> list[str]:
        """The named global tensors (leaves without a shard spec, catalogued under `_...` keys, left out)."""
        return [k for k in keys(self.table) if not k.startswith("_")]

    def tensor(self, key: str):
        return read_global(self.table, key, self.client.read)

    @property
    def topology(self) -> dict:
        return self.manifests[0].get("topology", {})

    def state(self, rank: int, *path: str):
        """The subtree at `path` (dict keys from the root) of `rank`'s state, with every leaf that is part of
        a global tensor left as None (read those whole with tensor()); the other leaves are read here."""
        man = self.manifests[rank]
        node = man["tree"]
        for name in path:
            while isinstance(node, dict) and "R" in node:  # a replicated subtree decodes as its content
                node = node["R"]
            body = node.get("d", node.get("od")) if isinstance(node, dict) else None
            if body is None or name not in body:
                raise InmemFTError(f"rank {rank}'s snapshot of step {self.step} has no {'/'.join(path)}: not "
                                   f"a snapshot this exporter understands (written by another integration?)")
            node = body[name]
        return unflatten(node, _Leaves(self, man))


class _Leaves:
    """The leaf list unflatten() indexes, read on demand: only the leaves of the decoded subtree travel."""

    def __init__(self, source: MemorySource, manifest: dict):
        self.source, self.manifest = source, manifest

    def __getitem__(self, i: int):
        leaf = self.manifest["leaves"][i]
        if "shards" in leaf:
            return None
        if leaf["k"] != "t":
            raise InmemFTError(f"leaf {i} of rank {self.manifest['rank']} is a numpy array; export reads torch "
                               f"tensors only")
        if not math.prod(leaf["sh"]):  # not catalogued: nothing to read
            return torch.empty(leaf["sh"], dtype=dtype_from_name(leaf["dt"]))
        return self.source.tensor(catalog.leaf_key(self.manifest, i))
