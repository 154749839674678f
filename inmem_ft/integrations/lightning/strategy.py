"""InmemFTStrategy: Lightning's DeepSpeedStrategy whose engine goes to the DeepSpeed adapter, and a resume at
the restored step as if the run had never stopped.

Why a strategy: DeepSpeedStrategy restores checkpoints after setup() builds the engine, so installing there
restores the engine before Lightning asks for a checkpoint; Lightning's own part of the checkpoint (loops,
callbacks, schedulers: what its save hands DeepSpeed as client state) travels in the snapshot's extra_state and is
handed to Lightning's own restore path, as if it had been loaded from a file.

Why snapshots are taken in on_train_batch_end: that is where Lightning's own ModelCheckpoint saves mid-epoch, and
its loops know how to resume from a checkpoint taken there. What Lightning does not do for a plain DataLoader is
skip the batches the epoch already consumed: the adapter skips them in the data fetcher at on_train_start, and
re-applies the restored RNG at the first resumed batch (the fetcher's start draws from torch's RNG).

The seams (pinned to the tested lightning minor by inmem_ft.compat): Trainer._checkpoint_connector (its
_get_loops_state_dict and _loaded_checkpoint), fit_loop._data_fetcher and _combined_loader.

Rule for trainer.fit(ckpt_path=...) with a step in memory: memory wins (one line says so); the engine already
holds it. Start the job under a new inmem_ft job id to resume from the file."""
from __future__ import annotations

import logging
from typing import Any

import lightning
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Callback
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer import call

from ... import compat
from ...capture import capture_rng_state, restore_rng_state
from ...config import InmemFTBlock
from ...errors import ConfigError

log = logging.getLogger("inmem_ft.lightning")


class InmemFTStrategy(DeepSpeedStrategy):
    """DeepSpeedStrategy(...) with the same arguments; `handle` is the DeepSpeed adapter's once setup() built the
    engine (None when the config's inmem_ft block is absent or disabled)."""

    def __init__(self, *args, allow_untested: bool = False, **kwargs):
        compat.check("lightning", lightning.__version__, allow_untested)
        super().__init__(*args, **kwargs)
        self.handle = None
        self._checkpoint: dict | None = None  # Lightning's restored part, until Lightning's restore has used it

    def setup_environment(self) -> None:
        if not _on_cpu():
            return super().setup_environment()
        # DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu, gloo), which DeepSpeedStrategy refuses (a CUDA check,
        # and one of CUDA device indices): what CPU machines and the tests run; the rest is device-agnostic
        from ..deepspeed import cpu_setup

        cpu_setup()
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if not _on_cpu():
            return super().setup_distributed()
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def root_device(self):
        # DeepSpeedStrategy hands DeepSpeed the device's index as its rank (`device_rank`): on CPU the local rank
        # (torch ignores a CPU device's index)
        return torch.device("cpu", self.local_rank) if _on_cpu() else super().root_device

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if not isinstance(self.config, dict):
            raise ConfigError("inmem_ft: InmemFTStrategy needs the DeepSpeed config as a dict or a JSON file path")
        block = InmemFTBlock.from_framework_config(self.config)
        if block is None or not block.enabled:
            return
        from ..deepspeed import install

        resume = _Resume(self)
        self.handle = install(self.deepspeed_engine, extra_state=resume.extras, config=block,
                              snapshot_in_step=False)
        trainer.callbacks.append(resume)
        restored = self.handle.restored
        if restored is None:
            return
        self._checkpoint = restored.extras
        # the RNG install() restored, re-applied at the first batch: the loop draws from it before
        resume.rng, resume.last = capture_rng_state(), restored.step
        trainer._checkpoint_connector._loaded_checkpoint = self._checkpoint  # restored as if read from a file

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        if self._checkpoint is None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        log.warning("inmem_ft: ckpt_path=%s not read: memory holds step %d, which the engine already holds (to "
                    "resume from the file, start the job under a new inmem_ft job id)", checkpoint_path,
                    self.handle.restored.step)
        return self._checkpoint

    def teardown(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        super().teardown()


def _on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


class _Resume(Callback):
    """Snapshots at the end of a snapshot step's batch; on a resume, the data position and the RNG."""

    def __init__(self, strategy: InmemFTStrategy):
        self.strategy = strategy
        self.rng = None  # the restored RNG, re-applied at the first resumed batch
        self.last = None  # the newest step snapshotted (or restored)

    def extras(self) -> dict:
        """Lightning's part of its checkpoint (Trainer._checkpoint_connector.dump_checkpoint) less the weights and
        optimizer states, which the engine's snapshot holds: dump_checkpoint itself would gather both."""
        trainer = self.strategy.lightning_module.trainer
        carried = {"epoch": trainer.current_epoch, "global_step": trainer.global_step,
                   "pytorch-lightning_version": lightning.__version__,
                   "loops": trainer._checkpoint_connector._get_loops_state_dict(),
                   "callbacks": call._call_callbacks_state_dict(trainer),
                   "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]}
        precision = trainer.precision_plugin.state_dict()
        if precision:
            carried[type(trainer.precision_plugin).__qualname__] = precision
        return carried

    def on_train_start(self, trainer, pl_module) -> None:
        if self.strategy._checkpoint is None:
            return
        self.strategy._checkpoint = None
        # the batches of this epoch the restored step had consumed (saved in on_train_batch_end: its own too)
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if done >= trainer.num_training_batches:
            return  # the epoch was over: the next one starts afresh
        fit_loop = trainer.fit_loop
        # Lightning started the fetcher (and its prefetch) before it sets the samplers' epoch: past epoch 0 that
        # order is epoch 0's. Restarted here with the restored epoch's.
        for loader in fit_loop._combined_loader.flattened:
            _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)
        fetcher = fit_loop._data_fetcher
        iter(fetcher)
        fetched = fetcher.fetched
        for _ in range(done):
            next(fetcher)
        fetcher.fetched = fetched  # the epoch loop adds the restored count itself

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.rng is not None:
            restore_rng_state(self.rng)
            self.rng = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        handle = self.strategy.handle
        step = int(handle.engine.global_steps)
        if not trainer.fit_loop._should_accumulate() and handle.snap.due(step):
            self._snapshot(step)

    def on_train_end(self, trainer, pl_module) -> None:
        handle = self.strategy.handle
        step = int(handle.engine.global_steps)
        if step != self.last:  # the end too: a restart after it stops at once
            self._snapshot(step)

    def _snapshot(self, step: int) -> None:
        self.strategy.handle.snapshot()
        self.last = step
