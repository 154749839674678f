"""install(trainer): the Trainer's DeepSpeed engine goes to the DeepSpeed adapter, and the Trainer resumes at
the restored step as if it had never stopped.

Why two private seams (pinned to the tested transformers minor by inmem_ft.compat): the Trainer computes its
data skip in _init_training_state, before _prepare_for_training builds the engine, and its public callbacks
come after both. So _prepare_for_training is wrapped to install the engine (which restores it) and put back
the Trainer's state, and _run_epoch to start the epoch loop at the restored epoch and batch, through the
Trainer's own resume path (accelerate's skip of consumed batches, the sampler's epoch).

Why snapshots are taken in on_step_begin and not inside engine.step(): accelerate runs engine.step() inside
accelerator.backward(), before the Trainer adds the step's loss, moves global_step and logs; at the next step's
begin everything of the last step is done, and the next step's batches are fetched, which is also where the
Trainer re-applies the RNG on its own resume. The restored RNG is re-applied at the same point.

Rule for train(resume_from_checkpoint=...) with a step in memory: the newer wins; memory when it holds the
checkpoint's step or a later one (one line says so), else a refusal (the engine already holds memory's)."""
from __future__ import annotations

import dataclasses
import json
import logging

import torch
from transformers import TrainerCallback, TrainerState

from ...capture import capture_rng_state, restore_rng_state
from ...config import InmemFTBlock
from ...errors import ConfigError

log = logging.getLogger("inmem_ft.huggingface")
MEMORY = "inmem_ft:memory"  # the resume_from_checkpoint _run_epoch is handed: no such directory, no files read


class TrainerAdapter(TrainerCallback):
    """The callback and the two seams of one Trainer; `handle` is the DeepSpeed adapter's once train() built the
    engine."""

    @classmethod
    def install(cls, trainer) -> "TrainerAdapter | None":
        if not trainer.is_deepspeed_enabled:
            raise ConfigError("inmem_ft: install(trainer) needs a DeepSpeed config with the inmem_ft block in "
                              "TrainingArguments(deepspeed=...)")
        # here, before accelerate fills the config's "auto" values: ours are refused with the reason
        block = InmemFTBlock.from_framework_config(trainer.args.hf_deepspeed_config.config)
        if block is None or not block.enabled:
            return None
        adapter = cls(trainer, block)
        trainer.add_callback(adapter)
        return adapter

    def __init__(self, trainer, block: InmemFTBlock):
        self.trainer, self.block = trainer, block
        self.handle = None
        self.restored: dict | None = None  # the restored extras, until the epoch loop has used them
        self.step = None  # the restored step
        self.rng = None  # the restored RNG, re-applied at the first resumed step
        self.last = 0  # the newest step snapshotted (or restored)
        prepare, run_epoch = trainer._prepare_for_training, trainer._run_epoch

        def prepare_and_install(max_steps, train_dataloader, resume_from_checkpoint):
            out = prepare(max_steps, train_dataloader, resume_from_checkpoint)
            self._install(resume_from_checkpoint)
            return out

        def run_restored_epoch(**kw):
            return run_epoch(**kw) if self.step is None else self._resumed_epoch(run_epoch, kw)

        trainer._prepare_for_training, trainer._run_epoch = prepare_and_install, run_restored_epoch

    # ---- restore ------------------------------------------------------------------------------------------
    def _install(self, resume_from_checkpoint) -> None:
        from ..deepspeed import install

        trainer = self.trainer
        checkpoint_step = trainer.state.global_step if resume_from_checkpoint is not None else None
        self.handle = install(trainer.model_wrapped, extra_state=self._extras, config=self.block,
                              snapshot_in_step=False)
        restored = self.handle.restored
        if restored is None:
            return
        if checkpoint_step is not None and checkpoint_step > restored.step:
            raise ConfigError(f"inmem_ft: resume_from_checkpoint={resume_from_checkpoint} holds step "
                              f"{checkpoint_step}, newer than step {restored.step} in memory, which the engine "
                              f"now holds; drop resume_from_checkpoint to resume from memory, or start the job "
                              f"under a new inmem_ft job id to resume from the checkpoint")
        if checkpoint_step is not None:
            log.warning("inmem_ft: resume_from_checkpoint=%s holds step %d; memory holds step %d, which wins (the "
                        "newer, or the same)", resume_from_checkpoint, checkpoint_step, restored.step)
        extras = restored.extras
        state = TrainerState(**json.loads(extras["state"]))
        before = trainer.state
        state.is_local_process_zero, state.is_world_process_zero = (before.is_local_process_zero,
                                                                    before.is_world_process_zero)
        trainer.state = state
        trainer._load_callback_state()
        if extras["scheduler"] is not None:
            trainer.lr_scheduler.load_state_dict(extras["scheduler"])
        self.step, self.restored, self.last = restored.step, extras, restored.step
        self.rng = capture_rng_state()  # what install() restored; the loop may draw before the first step

    def _resumed_epoch(self, run_epoch, kw: dict):
        """_run_epoch as the Trainer's own resume at the restored step would call it: epochs before the
        restored one are skipped, the restored one starts past its consumed batches."""
        trainer, per_epoch = self.trainer, kw["num_update_steps_per_epoch"]
        epoch, at = divmod(self.step, per_epoch)
        if self.step >= trainer.state.max_steps:  # the job had finished: stop at once
            trainer.control.should_training_stop = True
            return None
        if kw["epoch"] < epoch:
            return None
        self.step = None
        kw.update(resume_from_checkpoint=MEMORY, epochs_trained=epoch,
                  steps_trained_in_current_epoch=at * trainer.args.gradient_accumulation_steps)
        return run_epoch(**kw)

    def on_train_begin(self, args, state, control, **kwargs):
        # The Trainer resets its logging counters after _prepare_for_training: the restored ones go back here.
        extras, trainer = self.restored, self.trainer
        if extras is None:
            return
        trainer._tr_loss = torch.tensor(extras["tr_loss"], dtype=trainer._tr_loss.dtype, device=trainer._tr_loss.device)
        trainer._total_loss_scalar = extras["total_loss_scalar"]
        trainer._globalstep_last_logged = extras["globalstep_last_logged"]
        trainer._initial_global_step = extras["initial_global_step"]
        trainer._initial_num_input_tokens_seen = extras["initial_num_input_tokens_seen"]
        trainer.current_flos = extras["current_flos"]
        self.restored = None

    # ---- snapshots ----------------------------------------------------------------------------------------
    def _extras(self) -> dict:
        trainer, engine = self.trainer, self.handle.engine
        scheduler = trainer.lr_scheduler
        outside = scheduler is not None and getattr(scheduler, "scheduler", scheduler) is not engine.lr_scheduler
        # as TrainerState.save_to_json writes it (json keeps a float's every bit)
        return {"state": json.dumps(dataclasses.asdict(trainer.state)),
                "tr_loss": float(trainer._tr_loss.item()),  # a float32 holds exactly in a float
                "total_loss_scalar": trainer._total_loss_scalar,
                "globalstep_last_logged": trainer._globalstep_last_logged,
                "initial_global_step": trainer._initial_global_step,
                "initial_num_input_tokens_seen": trainer._initial_num_input_tokens_seen,
                "current_flos": trainer.current_flos,
                "scheduler": scheduler.state_dict() if outside else None}

    def on_step_begin(self, args, state, control, **kwargs):
        if self.rng is not None:
            restore_rng_state(self.rng)
            self.rng = None
        step = state.global_step
        if self.handle is not None and step != self.last and self.handle.snap.due(step):
            self._snapshot(step)

    def _snapshot(self, step: int) -> None:
        self.trainer.state.stateful_callbacks["TrainerControl"] = self.trainer.control.state()
        self.handle.snapshot()
        self.last = step

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is None:
            return
        if state.global_step != self.last:  # the end too: a restart after it stops at once
            self._snapshot(state.global_step)
        self.handle.close()
