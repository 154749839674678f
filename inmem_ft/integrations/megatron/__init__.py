"""Megatron-Core adapter: one pretrain argument and one call in the entry script.

    from inmem_ft.integrations import megatron as inmem_megatron

    args = parse_and_validate_args(extra_args_provider=inmem_megatron.add_args, args_defaults={})
    cfg = pretrain_cfg_container_from_args(args, model_cfg)
    handle = inmem_megatron.install(args)      # None unless --inmem-ft
    pretrain(cfg, ...)
    if handle: handle.close()

(on megatron-core 0.17, which has neither parse_and_validate_args nor a pretrain() config, versions.py's
functions of those names stand in, as examples/megatron_gpt.py uses them.)

Megatron keeps deciding what to save and load: the adapter is its local-checkpoint manager (manager.py),
driven by `--inmem-ft-interval` through Megatron's non-persistent save interval. Megatron's persistent
`--save` checkpoints stay stock and remain the disk tier. What is patched, and why: patch.py.
"""
from __future__ import annotations

import importlib
import logging
import os
import time

from ..._lazy import exporter
from .args import add_args, block_from_args

log = logging.getLogger("inmem_ft.megatron")
# Restored is capture's (its import brings torch): Megatron's entry script imports this module before torch.
__getattr__ = exporter(__name__, {"Restored": "...capture.resume"})


class Handle:
    """Made by install(); its Snapshotter exists once Megatron has initialized torch.distributed."""

    def __init__(self, args, block):
        self.args, self.block = args, block
        self.snap = self.manager = self.layout = None
        self.restored: Restored | None = None
        self._setup_s: dict = {}  # seconds of the load's setup phases, for the restore's log line
        self._asked: int | None = None  # saves made when snapshot() was asked (None: not asked)

    def _before_load(self, checkpointing_context: dict, model, optimizer):
        """Our manager in Megatron's context, and what Megatron's load then runs in: the restored state views
        the slots (no copy of it into fresh memory on the way), Megatron copies parameters into its own tensors,
        and whatever it keeps as it is (torch's Optimizer.load_state_dict keeps the Adam moments it is given;
        on a GPU it would copy them to the device) is copied out behind the first forward/backward and swapped
        in before the first optimizer step (capture.views)."""
        import torch
        from megatron.core.utils import unwrap_model

        from ...capture import Snapshotter
        from ...capture.monitor_metrics import Unreported
        from ...capture.views import PrivateAfterLoad
        from . import patch
        from .layout import MegatronLayout
        from .manager import NONE, InmemCheckpointManager

        t0 = time.perf_counter()
        self.snap = Snapshotter(self.block.snapshot_config())
        self._unreported = Unreported(self.snap.metrics)
        t1 = time.perf_counter()
        self.layout = MegatronLayout(self.args, model, optimizer)
        self._setup_s = {"snapshotter": round(t1 - t0, 4), "layout": round(time.perf_counter() - t1, 4)}
        self.manager = InmemCheckpointManager(
            self.snap, self.args.non_persistent_local_ckpt_dir, self.layout.topology,
            deduplicated=self.args.non_persistent_local_ckpt_algo == "fully_parallel",
            extra_specs=self._extra_specs, reshard=self._reshard if self.block.reshard == "auto" else None)
        checkpointing_context["local_checkpoint_manager"] = self.manager
        if self.manager.find_latest() != NONE:  # collective: every rank is in load_checkpoint now
            patch.fill_empty_optimizer_state(optimizer)
        chained = getattr(optimizer, "chained_optimizers", [optimizer] if optimizer is not None else [])
        inner = [o.optimizer for o in chained if isinstance(getattr(o, "optimizer", None), torch.optim.Optimizer)]
        return PrivateAfterLoad(self.snap, inner, unwrap_model(model), defer=True)  # not DDP: its .buffers is a list

    def _reshard(self, source):
        """The newest snapshots are of another layout (`reshard: auto`): a ReshardedLoad of them (collective;
        `source`: the restore's ReshardSource, which the manager closes)."""
        from .reshard import ReshardedLoad

        attempt = time.perf_counter() - self.manager.restore_t0  # the listing and agreement, less the open in it
        rs = source.open()
        self._setup_s["restore_attempt"] = round(attempt - (rs.seconds["open"] if source.settled else 0.0), 4)
        return ReshardedLoad(rs, self.layout, self.snap.agree_min)

    def _after_load(self, model, optimizer, iteration: int) -> None:
        from ...capture.resume import RestoreInfo, Restored, say_framework_disk, say_fresh
        from . import patch

        patch.restore_adam_steps(optimizer)
        patch.fence_before_step(optimizer, self._fence)
        resharded = self.manager.resharded
        served = self.manager.release()
        if served and resharded is not None:
            rs, seconds = resharded.rs, time.perf_counter() - self.manager.restore_t0
            # The SMPs keep the old layout's step until this layout completes a newer one.
            self.snap.resumed(RestoreInfo.resharded(rs, seconds, rs.seconds))
            self.restored = Restored.from_reshard(rs, seconds, {**self._setup_s, **rs.seconds})
            self.restored.say(self.snap.config.node, self.snap.rank, log)
        elif served:
            info = self.snap.last_restore
            seconds = time.perf_counter() - self.manager.restore_t0
            # Everything after the snapshot was back: Megatron's load_checkpoint of it (our translation, its
            # to_state_dict, the model's and optimizer's load_state_dict) and the step fix above.
            phases = {**self._setup_s, **info.phases, "megatron_load": round(seconds - info.seconds, 4)}
            self.restored = Restored.in_place(info, seconds, phases)
            self.restored.say(self.snap.config.node, self.snap.rank, log)
        elif iteration:  # Megatron found a newer persistent checkpoint under --load and took it
            say_framework_disk(self.snap.rank, iteration, "Megatron's --load checkpoint", log)
        else:
            say_fresh(self.snap.rank, log)

    def _observe(self, iteration: int, loss_dict: dict, grad_norm, skipped: bool) -> None:
        """Each iteration's loss (the loss dict's first entry) and grad norm to the check after a restore
        (Snapshotter.observe; it raises RestoredStateBad out of pretrain()). A skipped iteration's norm (an fp16
        overflow) is not screened: the loss scaler handles it."""
        if self.snap is not None:
            loss = next(iter(loss_dict.values()), None) if loss_dict else None
            self.snap.observe(iteration, loss, None if skipped else grad_norm)

    def _screening(self) -> bool:
        return self.snap is not None and self.snap.screening

    def _extra_specs(self, sh):
        return self.layout.model_space_specs(sh) if self.layout and self.layout.bucket_params else ()

    def snapshot(self) -> None:
        """Snapshot at the end of this iteration, whatever the interval (collective: every rank asks in the same
        iteration, e.g. from a training_log or forward_step hook). Megatron decides at each iteration's end
        whether its non-persistent save is due: that save, ours, is made due once, and the interval is
        --inmem-ft-interval again from the next iteration on."""
        if self.snap is None:
            from ...errors import InmemFTError

            raise InmemFTError("snapshot: pretrain() has not loaded yet; ask from inside the training loop")
        self._asked = self.snap.metrics.stall_count
        self.args.non_persistent_save_interval = 1

    def _fence(self) -> None:
        """Before each optimizer step: wait for the snapshot's copy, then report (_report); after a snapshot
        asked for, the interval is the configured one again."""
        self.snap.fence()
        if self._asked is not None and self.snap.metrics.stall_count > self._asked:
            self.args.non_persistent_save_interval, self._asked = self.block.interval, None
        self._report()

    def _report(self) -> None:
        """The newest committed snapshot's stall, commit time and bytes into Megatron's TensorBoard and W&B
        writers (on the rank that has them)."""
        events = self._unreported.events()
        if events:
            from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

            tensorboard, wandb = get_tensorboard_writer(), get_wandb_writer()
            for name, value, step in events:
                if tensorboard is not None:
                    tensorboard.add_scalar(name, value, step)
                if wandb is not None:
                    wandb.log({name: value}, step)

    def wait(self) -> None:
        """Until the last snapshot is committed."""
        if self.snap is not None:
            self.snap.wait()

    def flush(self, timeout_s: float = 600.0) -> dict:
        """Put the job's newest complete step on disk on every node now and return once it is there (see
        Snapshotter.flush; not collective, so a callback or another thread may call it). Raises InmemFTError
        saying why not, also before Megatron's load made the Snapshotter."""
        if self.snap is None:
            from ...errors import InmemFTError

            raise InmemFTError("flush: no snapshot yet (pretrain() has not loaded, so nothing was snapshotted)")
        flushed = self.snap.flush(timeout_s)
        self._report()
        return flushed

    def close(self) -> None:
        """After pretrain(): wait for the last commit, then let go of the SMP."""
        if self.snap is not None:
            self.snap.close()


def install(args) -> Handle | None:
    """Turn on in-memory snapshots for this pretrain run, per `--inmem-ft*` (see add_args). Call it on every
    rank after parse_and_validate_args and before pretrain(). Returns None without --inmem-ft."""
    if not getattr(args, "inmem_ft", False):
        return None
    from ...errors import ConfigError
    from ...smp import paths
    from . import patch

    block = block_from_args(args)
    patch.check_version(block.allow_untested)
    # What the load runs is imported here, at startup, as Megatron imports its own checkpointing code: inside
    # load_checkpoint these imports (the resharding loader's pyarrow above all) took every rank at once
    # 0.1-1.3 s of the resume.
    for module in ("layout", "reshard") if block.reshard == "auto" else ("layout",):
        importlib.import_module(f"{__name__}.{module}")
    if args.non_persistent_ckpt_type is not None:
        raise ConfigError(f"--inmem-ft replaces --non-persistent-ckpt-type (got {args.non_persistent_ckpt_type!r}); "
                          f"drop one of them")
    if args.ckpt_format != "torch_dist" and not args.auto_detect_ckpt_format:
        raise ConfigError(f"--inmem-ft needs --ckpt-format torch_dist (got {args.ckpt_format!r}) or "
                          f"--auto-detect-ckpt-format: Megatron reads local checkpoints only then")
    scratch = os.path.join(paths.job_dir(block.snapshot_config().job), "megatron")
    # Megatron's non-persistent 'local' checkpoints, ours: every `interval` iterations unless a persistent
    # --save falls on the same one. They need args.save set, and loading needs args.load set; a run without
    # --save/--load gets a scratch directory (pretrain's cfg keeps save=None, so no persistent save at the
    # end). The cfg's non_persistent_ckpt_type stays None: pretrain() would build nvrx's manager.
    # A different interval of the user's is refused, not overwritten: the interval sets how much work a
    # failure loses, so a job must not silently run at one nobody chose.
    if getattr(args, "non_persistent_save_interval", None) not in (None, block.interval):
        raise ConfigError(f"--inmem-ft snapshots every {block.interval} iterations through Megatron's "
                          f"non-persistent save, but --non-persistent-save-interval is "
                          f"{args.non_persistent_save_interval}: drop it, or give --inmem-ft-interval "
                          f"{args.non_persistent_save_interval}")
    args.non_persistent_ckpt_type = "local"
    args.non_persistent_save_interval = block.interval
    args.non_persistent_local_ckpt_dir = scratch
    args.save = args.save or scratch
    args.load = args.load or scratch
    os.makedirs(scratch, exist_ok=True)
    patch.allow_local_tasd()
    if args.ckpt_assume_constant_structure:
        patch.validate_structure_once()
    patch.register_safe_classes(args)
    patch.finalize_when_committed()
    from .manager import InmemCheckpointManager

    patch.snapshot_without_save_checkpoint(InmemCheckpointManager)
    handle = Handle(args, block)
    patch.around_load(handle._before_load, handle._after_load)
    patch.observe_train_step(handle._observe)
    patch.screened_steps_to_sentinel(handle._screening)
    return handle


__all__ = ["add_args", "install", "Handle", "Restored"]
