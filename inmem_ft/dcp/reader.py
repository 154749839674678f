"""InmemStorageReader: DCP's StorageReader over the SMPs. dcp.load's own planner decides what each rank
reads, on any world size or mesh; each read item is a piece of one rank's stored chunk, read through the local
SMP (this node's shared memory, another node's, or parity for a lost node) straight into the target tensor."""
from __future__ import annotations

import io
import math
import time

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..capture.restore import NO_STEP
from ..capture import sentinel
from ..capture.resume import DCP_PREFIX, RestoreInfo, say
from ..config import SnapshotConfig
from ..errors import InmemFTError, StepIncomplete
from ..universal.source import MemorySource
from . import items, session



class NoSnapshot(StepIncomplete):
    """No node holds any committed snapshot of the job: a fresh start, not a failure to restore one."""


class InmemStorageReader(StorageReader):
    """`job`: the inmem_ft job (default from the environment); `step`: the step to load (or pass
    `checkpoint_id=step` to dcp.load), default the newest one every rank of the saving job holds (`step`
    says which once read_metadata opened it). Opening it is collective: every rank of the loading job agrees
    on the step."""

    def __init__(self, job: str | None = None, step: int | None = None, *, config: SnapshotConfig | None = None,
                 snapshotter=None):
        super().__init__()
        self._job, self._config, self._given = job, config, snapshotter
        self.step = step
        self._source: MemorySource | None = None
        self._metadata = None
        self._where: dict = {}
        self._t0 = 0.0
        self.info: RestoreInfo | None = None  # the last read_data's restore, as the restore line says it

    @property
    def snapshotter(self):
        return session.snapshotter(self._job, self._config, self._given)

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            step = session.step_of(checkpoint_id)
            if step is None:
                raise InmemFTError(f"InmemStorageReader reads a training step, not checkpoint id {checkpoint_id!r}: "
                                   f"InmemStorageReader(job, step=N) or dcp.load(..., checkpoint_id=N)")
            if step != self.step:
                self.close()
            self.step = step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return session.step_of(checkpoint_id) is not None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._open()
        return self._metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        src = self._source
        nbytes = 0
        for req in plan.items:
            where = self._where[items.index_key(req.storage_index)]
            if req.type == LoadItemType.BYTE_IO:
                raw = src.fragments.raw(where.key, src.read).tobytes() if where.key in src.fragments else b""
                planner.load_bytes(req, io.BytesIO(raw))  # DCP torch.loads its own byte items
                nbytes += len(raw)
                continue
            target = planner.resolve_tensor(req).detach()
            if math.prod(req.lengths):
                direct = target.device.type == "cpu" and target.is_contiguous() and target.dtype == where.dtype
                piece = src.piece(where.key, offset=req.storage_offsets, shape=req.lengths,
                                  out=target.view(-1) if direct else None)
                if not direct:
                    target.copy_(piece.view(tuple(req.lengths)))
                nbytes += target.numel() * target.element_size()
            planner.commit_tensor(req, target)
        self._resumed(nbytes)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
        self._source, self._metadata, self._where = None, None, {}

    # ---- internals ----------------------------------------------------------------------------------------
    def _open(self) -> None:
        """Open the step every rank agrees on (collective), and rebuild DCP's Metadata from its snapshots."""
        snap, self._t0 = self.snapshotter, time.perf_counter()
        wanted, error = self.step, None
        for _ in range(2):  # a second round only where listings differed (a node unreachable from some SMPs)
            try:
                self._source = MemorySource(snap.config.socket_path, wanted, node=snap.config.node)
                self._metadata, self._where = items.metadata(self._source)
            except InmemFTError as e:  # every rank must take part in the agreement below
                self.close()
                error = e
            step = self._source.step if self._source is not None else NO_STEP
            low, high = snap.agree_min([step, -step])
            if low == -high != NO_STEP:
                self.step = low
                return
            self.close()
            if low == NO_STEP:
                break
            wanted = low
        if error is not None and "no node holds any committed snapshot" in str(error):
            raise NoSnapshot(f"job {snap.config.job!r} has no snapshot on any reachable node: nothing to load "
                             f"(start fresh, or check the job id and that its SMPs run)") from None
        raise error or InmemFTError(f"another rank of job {snap.config.job!r} could not open the step to load (its "
                                    f"log says why); nothing was loaded")

    def _resumed(self, nbytes: int) -> None:
        snap, src = self.snapshotter, self._source
        read = dict(src.fragments.bytes_read)
        where = "parity" if read.get("parity") else "memory"
        self.info = RestoreInfo(src.step, DCP_PREFIX + where, time.perf_counter() - self._t0, nbytes,
                                losses=sentinel.recorded_in(src.manifests.get(snap.rank, {})))
        snap.resumed(self.info)
        say(snap.config.node, snap.rank, src.step, self.info.source, self.info.seconds, nbytes=nbytes,
            bytes_by_where=read)
