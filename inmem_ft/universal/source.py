"""One complete step of a job as the SMPs hold it, opened through the local SMP: the catalog of its global
tensors, each read whole or in pieces on demand, and any rank's small (unsharded) state, decoded from its
manifest.

Nothing is unpickled: manifests are JSON, tensor bytes are raw and checksum-verified by the SMPs.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from ..cluster.localreads import LocalReads
from ..errors import InmemFTError, StepIncomplete
from ..smp.client import SMPClient
from ..snapshot import catalog
from ..snapshot.tree import dtype_from_name, unflatten
from .assemble import Fragments, keys


class MemorySource:
    def __init__(self, slots, step: int | None = None, *, node: int | None = None,
                 accept: Callable[[dict], bool] | None = None, listing: dict | None = None):
        """`slots`: the local SMP's socket path, or what answers as its client does (catalog, read, close). `step`: default the newest one every rank holds. `node`: the reader's own node,
        whose copies are read first. `accept(entry)`: only the listed slots it accepts count (a reshard reads
        the old layout's). `listing`: the catalog listing, when the caller has just asked for it."""
        self.client = SMPClient(slots) if isinstance(slots, str) else slots
        self._local = None
        try:
            listing = listing or self.client.catalog()
            entries = [e for e in listing["entries"] if accept is None or accept(e)]
            try:
                self.step = catalog.complete_step(entries, step)
            except StepIncomplete as e:
                lost = "; ".join(f"node {u['node']}: {u['error']}" for u in listing["unreachable"])
                raise StepIncomplete(f"{e}{f' (unreachable: {lost})' if lost else ''}") from None
            self.table = catalog.fragments(entries, self.step, node)
            self.fragments = Fragments(self.table)
            catalog.check(self.fragments.cols, self.fragments.runs)
        except BaseException:
            self.client.close()
            raise
        self.read = self.client.read
        if node is not None and isinstance(slots, str):  # this node's slots straight from shared memory
            self._local = LocalReads(node, catalog.select(entries, self.step, node), self.client.read)
            self.read = self._local.read
        # The copy catalog.fragments reads (memory before parity) also gives each rank's manifest.
        self.manifests: dict[int, dict] = {}
        for e in catalog.select(entries, self.step, node):
            self.manifests.setdefault(e["rank"], e["manifest"])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
        self.client.close()

    def keys(self) -> list[str]:
        """The named global tensors (leaves without a shard spec, catalogued under `_...` keys, left out)."""
        return [k for k in keys(self.table) if not k.startswith("_")]

    def tensor(self, key: str):
        return self.fragments.tensor(key, self.read)

    def piece(self, key: str, offset=None, shape=None, flat=None, out=None):
        """Fragments.piece: only the bytes of the piece travel."""
        return self.fragments.piece(key, self.read, offset, shape, flat, out)

    @property
    def topology(self) -> dict:
        return self.manifests[0].get("topology", {})

    def topology_of(self, rank: int) -> dict:
        return self.manifests[rank].get("topology", {})

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
        if leaf["k"] == "a":  # numpy (its RNG state, say): the bytes, in numpy's dtype
            raw = self.source.fragments.raw(catalog.leaf_key(self.manifest, i), self.source.read) \
                if math.prod(leaf["sh"]) else np.zeros(0, np.uint8)
            return raw.view(np.dtype(leaf["dt"])).reshape(leaf["sh"])
        if not math.prod(leaf["sh"]):  # not catalogued: nothing to read
            return torch.empty(leaf["sh"], dtype=dtype_from_name(leaf["dt"]))
        return self.source.tensor(catalog.leaf_key(self.manifest, i))
