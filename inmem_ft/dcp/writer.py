"""InmemStorageWriter: DCP's StorageWriter (and AsyncStager) over the SMPs.

dcp.save: write_data snapshots the rank's planned items through the Snapshotter (copy into the slot,
checksums, commit, job-wide agreement) and its future completes once the step is committed on every rank.
dcp.async_save: the writer is the stager; stage() makes that same copy of all the rank's local items (the
only part that blocks training) and the background save's write_data just waits for the commit: there is no
second copy. DCP's finish() has nothing left to write: the Metadata is rebuilt from the snapshots (items.py).
"""
from __future__ import annotations

import time
from concurrent.futures import Future as CommitFuture

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..config import SnapshotConfig
from ..errors import InmemFTError
from . import items, session


class InmemStorageWriter(StorageWriter):
    """`job`: the inmem_ft job (default from the environment, as SnapshotConfig.from_env); `step`: the
    training step this save is (or pass `checkpoint_id=step` to dcp.save); `config` / `snapshotter`: a
    SnapshotConfig, or a Snapshotter to use instead of this process's shared one for the job."""

    def __init__(self, job: str | None = None, step: int | None = None, *, config: SnapshotConfig | None = None,
                 snapshotter=None):
        super().__init__()
        self._job, self._config, self._given = job, config, snapshotter
        self.step = step
        self._staged: dict | None = None  # the index of what stage() snapshotted: {item key: position}
        self._commit: CommitFuture | None = None
        self.stall_s = 0.0  # seconds the last stage() or write_data() held the caller

    @property
    def snapshotter(self):
        return session.snapshotter(self._job, self._config, self._given)

    # ---- StorageWriter ----------------------------------------------------------------------------------
    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.step = self._step(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return session.step_of(checkpoint_id) is not None

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.snapshotter  # created here (collective) if this is the job's first save in this process

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._staged is None:  # dcp.save: snapshot the planned items now
            pairs = [(item, planner.resolve_data(item)) for item in plan.items]
            self._snapshot(pairs, getattr(planner, "mappings", None))
        staged, commit, step, rank = self._staged, self._commit, self.step, self.snapshotter.rank
        self._staged = self._commit = None
        missing = [item.index.fqn for item in plan.items if items.index_key(item.index) not in staged]
        results = [WriteResult(index=item.index, size_in_bytes=_nbytes(item), storage_data=(rank, staged.get(
            items.index_key(item.index)))) for item in plan.items]
        fut: Future = Future()

        def committed(done: CommitFuture) -> None:
            try:
                done.result()
                if missing:
                    raise InmemFTError(f"DCP planned items the staged snapshot lacks ({missing[:3]}...): the state "
                                       f"dict changed between async_save's staging and its plan")
                if self.snapshotter.complete != step:
                    raise InmemFTError(f"step {step} was not committed on every rank (the rank logs say why: a "
                                       f"skipped or failed snapshot); the previous complete step is kept")
                fut.set_result(results)
            except BaseException as e:  # DCP raises it from finish, on every rank
                fut.set_exception(e)

        commit.add_done_callback(committed)
        return fut

    def finish(self, metadata, results) -> None:
        """Nothing to write: DCP's Metadata is rebuilt from the snapshots themselves."""

    def storage_meta(self):
        return None

    # ---- AsyncStager (dcp.async_save uses the writer as its stager) ----------------------------------------
    _synchronize_after_execute = False  # stage() returns with the copy done: nothing to synchronize

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict):
        """Snapshot every local item of `state_dict` (training may go on once this returns) and hand DCP the
        same state dict: its background save only plans, and write_data waits for this snapshot's commit."""
        snap = self.snapshotter
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict, None, snap.rank == 0)  # DCP's coordinator (rank 0) saves byte items
        plan = planner.create_local_plan()
        self._snapshot([(item, planner.resolve_data(item)) for item in plan.items], plan.planner_data)
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass

    # ---- internals ----------------------------------------------------------------------------------------
    def _snapshot(self, pairs, planner_data) -> None:
        step = self._step(self.step)
        t0 = time.perf_counter()
        self._commit = self.snapshotter.save(step, items.stored(pairs, planner_data))
        self._staged = {items.index_key(item.index): j for j, (item, _) in enumerate(pairs)}
        self.stall_s = time.perf_counter() - t0

    @staticmethod
    def _step(checkpoint_id) -> int:
        step = session.step_of(checkpoint_id)
        if step is None:
            raise InmemFTError(f"InmemStorageWriter needs the training step as the checkpoint id, not "
                               f"{checkpoint_id!r}: InmemStorageWriter(job, step=N) or dcp.save(..., checkpoint_id=N)")
        return step


def _nbytes(item) -> int:
    if item.tensor_data is None:
        return 0
    return item.tensor_data.chunk.sizes.numel() * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
