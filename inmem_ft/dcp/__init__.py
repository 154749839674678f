"""torch.distributed.checkpoint (DCP) on inmem_ft: a StorageWriter/StorageReader pair over the SMPs, and a
Checkpointer for the common FSDP2 / DTensor training loop. An adapter: DCP plans and reshards, the capture
path (copier, checksums, commit, agreement, erasure coding, disk tier) stores and reads."""
from .checkpointer import Checkpointer
from .reader import InmemStorageReader, NoSnapshot
from .session import close
from .writer import InmemStorageWriter

__all__ = ["Checkpointer", "InmemStorageReader", "InmemStorageWriter", "NoSnapshot", "close"]
