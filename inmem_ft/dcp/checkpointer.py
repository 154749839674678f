"""Checkpointer: the common FSDP2 / DTensor loop's snapshots through DCP, in memory.

The state is DCP's own (torch.distributed.checkpoint.state_dict.get_state_dict of model and optimizer, the
LR scheduler, `extra_state`'s Stateful objects, the step), so dcp.load reshards it onto any world size; the
torch RNG state is per rank, stored under a key of its rank (a key all ranks share DCP would save once), and
a rank of a new world size takes that of rank (its rank mod the old world size).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..capture.snapshotter import Snapshotter
from ..config import SnapshotConfig
from .reader import InmemStorageReader, NoSnapshot
from .writer import InmemStorageWriter

RNG = "rng"


class _Scheduler:
    """An LR scheduler as a DCP Stateful."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state):
        self.scheduler.load_state_dict(state)


class Checkpointer:
    """`maybe_save(step)` every step (a snapshot every `interval`), `restore()` once at start (the step to
    resume after, or None on a fresh start). `extra_state`: {name: object with state_dict()/load_state_dict()}
    (a data-loader position, say), job-wide. `async_save`: dcp.async_save, blocking only for the copy out;
    its background planning runs on `process_group` (default: a gloo group of its own, so that it never meets
    the training's collectives)."""

    def __init__(self, job: str | None, interval: int, model, optimizer, *, scheduler=None,
                 extra_state: dict | None = None, async_save: bool = False, process_group=None,
                 config: SnapshotConfig | None = None):
        overrides = {"interval": interval, **({"job": job} if job else {})}
        self.snap = Snapshotter(config or SnapshotConfig.from_env(**overrides))
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.extra = dict(extra_state or {})
        self.async_save = async_save
        self.group = process_group or (dist.new_group(backend="gloo") if async_save else None)
        self._upload = None
        self.last_restore = None

    def _state(self, step: int, rng_rank: int) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optimizer": optim_sd, "step": step, **self.extra,
                 RNG: {f"rank{rng_rank}": torch.get_rng_state()}}
        if self.scheduler is not None:
            state["scheduler"] = _Scheduler(self.scheduler)
        return state

    def maybe_save(self, step: int) -> bool:
        """Snapshot if `step` is due; call it every step (it is also the rank's heartbeat)."""
        self.snap.heartbeat(step=step)
        if not self.snap.due(step):
            return False
        self.wait()
        writer = InmemStorageWriter(step=step, snapshotter=self.snap)
        state = self._state(step, self.snap.rank)
        if self.async_save:
            self._upload = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        else:
            dcp.save(state, storage_writer=writer)
        return True

    def wait(self) -> None:
        """Wait for the last async save's commit (raises its failure)."""
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.result()

    def restore(self, step: int | None = None) -> int | None:
        """Collective: load the newest step every rank of the saving job holds (or `step`) into the model,
        optimizer, scheduler and extras, in place; returns its step, or None when the job has no snapshot."""
        reader = InmemStorageReader(step=step, snapshotter=self.snap)
        try:
            metadata = reader.read_metadata()
        except NoSnapshot:
            return None
        saved = sorted(k for k in metadata.state_dict_metadata if k.startswith(f"{RNG}.rank"))
        state = self._state(-1, self.snap.rank % len(saved) if saved else self.snap.rank)
        try:
            dcp.load(state, storage_reader=reader)
        finally:
            reader.close()
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        torch.set_rng_state(next(iter(state[RNG].values())).clone())
        self.last_restore = reader.info
        return state["step"]

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.snap.close()
            if self.group is not None:
                dist.destroy_process_group(self.group)
