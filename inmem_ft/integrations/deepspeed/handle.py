"""install(engine): snapshots every `interval` steps into the node's SMP, restore on start from the newest
tier the SMPs hold (memory, peer_reconstruction, or the disk tier they flushed and adopted again), and an
explicit `engine.save_checkpoint(dir)` that writes a stock DeepSpeed checkpoint. Translation only: the protocol
(copy, commit, agreement, replication) lives in inmem_ft.capture, the disk tier in the SMP (smp/disktier.py)."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from typing import Any, Callable

import torch
from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, SINGLE_PARTITION_OF_FP32_GROUPS

from ...capture import Snapshotter, capture_rng_state, restore_rng_state
from ...capture.monitor_metrics import Unreported
from ...capture.resume import ReshardSource, RestoreInfo, Restored, say_fresh
from ...capture.views import PrivateAfterLoad, private
from ...config import InmemFTBlock
from ...errors import ConfigError
from ...smp import paths
from ...snapshot import Replicated, Topology, annotate
from ...snapshot.topology import hyperparameters
from ...universal.reshard import FromMemory
from . import moe, pipeline, reshard, shards, stock, support, tensor_parallel, types
from .engine import MODEL_STATES, InMemCheckpointEngine

log = logging.getLogger("inmem_ft.deepspeed")
# The fp32 master partitions of a ZeRO optimizer, and the key its checkpoint saves them under (ZeRO-1/2, ZeRO-3).
FP32_PARTITIONS = (("single_partition_of_fp32_groups", SINGLE_PARTITION_OF_FP32_GROUPS),
                   ("fp32_partitioned_groups_flat", FP32_FLAT_GROUPS))


class Handle:
    def __init__(self, engine, block: InmemFTBlock, extra_state: Callable[[], Any] | None = None,
                 snapshot_in_step: bool = True):
        types.register()
        self.engine, self.block, self.extra_state = engine, block, extra_state
        self.snapshot_in_step = snapshot_in_step
        engine.inmem_ft_installed = True  # integrations/block_watch.py: this engine's block is not a silent no-op
        config = block.snapshot_config()
        self.zero_stage = int(engine.zero_optimization_stage())
        self.zero3 = self.zero_stage == 3
        self.pipe = pipeline.Pipeline(engine) if engine.pipeline_parallelism else None
        # before the SMP is asked for anything: an unmarked split parameter is refused here (tensor_parallel.py)
        self.tp = tensor_parallel.TensorParallel(engine, (self.pipe or reshard.ModuleKeys).key_of,
                                                 block.partition_dims) if tensor_parallel.size_of(engine) > 1 else None
        dp_group = engine.seq_data_parallel_group
        self.snap = Snapshotter(config, dp_group=dp_group)
        self.rank, self.dp_rank, self.dp_size = self.snap.rank, self.snap.dp_rank, self.snap.dp_size
        self._check_smp()
        self.scratch = os.path.join(paths.job_dir(config.job), "deepspeed-scratch")
        os.makedirs(self.scratch, exist_ok=True)
        self.ckpt = InMemCheckpointEngine(self._commit)
        # (checkpoint engine, save_non_zero_checkpoint) of stock saves, and of our snapshots
        self._stock = (engine.checkpoint_engine, engine.save_non_zero_checkpoint)
        # ZeRO-0/1/2 build the model-states dict on every rank but hand it to the engine on DP rank 0 only; for a
        # snapshot every replica hands it over here and stores 1/DP of it (Replicated), so restore gathers it
        # back on every rank without reading a peer's memory.
        self._ours = (self.ckpt, not self.zero3 or engine.save_non_zero_checkpoint)
        engine.checkpoint_engine, engine.save_non_zero_checkpoint = self._ours
        self._param_names = self._zero0_param_names() if self.zero_stage == 0 else {}
        self.moe = moe.Experts(engine) if engine.has_moe_layers else None
        self._unreported = Unreported(self.snap.metrics)
        self._loss = None  # the last backward's loss (wrapped_backward)
        self._wrap(engine)
        self.restored: Restored | None = self._restore()

    # ---- setup --------------------------------------------------------------------------------------------
    def _check_smp(self) -> None:
        if self.block.memory_budget is None:
            return
        budget = self.snap._smp.call("status").get("budget")
        if budget is not None and budget != self.block.memory_budget:
            log.warning("inmem_ft: memory_budget in the config is %d bytes, the node's SMP runs with %d; the SMP's "
                        "value applies (start it from the same config block)", self.block.memory_budget, budget)

    def _zero0_param_names(self) -> dict[int, str]:
        """ZeRO-0 optimizer state is keyed by parameter index: index -> name. With bf16 the inner optimizer
        holds fp32 copies; `fp16_groups` lists the module parameters they stand for, in the same order."""
        opt = self.engine.optimizer
        groups = getattr(opt, "fp16_groups", None) or [g["params"] for g in opt.param_groups]
        return annotate.param_names(self.engine.module, groups)

    def _before_update(self) -> None:
        self.snap.fence()  # the last snapshot's copy ran behind forward/backward; the step changes the state
        # The optimizer now steps in the restored tensors themselves (copy-on-write views of the slot): they
        # no longer hold the snapshot, so a later load of its tag is DeepSpeed's own, from disk.
        self._memory = None

    def _after_update(self, before: int, loss) -> None:
        """After engine.step() or train_batch(): `loss`, the step's loss (None: no backward seen), is screened."""
        now = self.engine.global_steps
        self.snap.heartbeat(step=now)
        if now != before:  # an optimizer step (gradient-accumulation boundary)
            if loss is not None:
                self.snap.observe(now, loss, self.engine.get_global_grad_norm())
            if self.snapshot_in_step and self.snap.due(now):
                self.snapshot()
        self._report()

    def _wrap(self, engine) -> None:
        step, save, load, backward = engine.step, engine.save_checkpoint, engine.load_checkpoint, engine.backward

        @functools.wraps(backward)
        def wrapped_backward(loss, *a, **kw):
            self._loss = loss  # the step's last micro-batch loss: what the check after a restore screens
            return backward(loss, *a, **kw)

        @functools.wraps(step)
        def wrapped_step(*a, **kw):
            self._before_update()
            before = engine.global_steps
            out = step(*a, **kw)
            self._after_update(before, self._loss)
            return out

        @functools.wraps(save)
        def wrapped_save(save_dir, tag=None, client_state={}, save_latest=True, **kw):
            if save_dir == self.scratch:  # a snapshot (Handle.snapshot): the bytes go to the SMP, no `latest`
                with self.moe.every_replica_saves() if self.moe else contextlib.nullcontext():
                    return save(save_dir, tag=tag, client_state=client_state, save_latest=False, **kw)
            # The user's own save: a durable stock checkpoint in save_dir, by DeepSpeed's own engine and rules
            # (loadable without inmem_ft). The overlapped copy of the last snapshot reads the same tensors.
            self.snap.fence()
            engine.checkpoint_engine, engine.save_non_zero_checkpoint = self._stock
            try:
                return save(save_dir, tag=tag, client_state=client_state, save_latest=save_latest, **kw)
            finally:
                engine.checkpoint_engine, engine.save_non_zero_checkpoint = self._ours

        @functools.wraps(load)
        def wrapped_load(load_dir, tag=None, *a, **kw):
            self.snap.fence()
            restored = self.restored
            if restored is not None and tag == restored.tag and self._memory:
                return self._load_memory(*self._memory, *a, **kw)
            return load(load_dir, tag, *a, **kw)

        if self.pipe is not None:  # train_batch() steps inside; engine.step() raises
            self.pipe.wrap(self._before_update, self._after_update)
        else:
            engine.step, engine.backward = wrapped_step, wrapped_backward
        engine.save_checkpoint, engine.load_checkpoint = wrapped_save, wrapped_load
        self._load = load
        self._memory = None

    # ---- saving -------------------------------------------------------------------------------------------
    def _replicated(self, name: str) -> bool:
        return not self.zero3 and name.startswith("mp_rank_") and name.endswith(MODEL_STATES)

    def _commit(self, tag: str, files: dict) -> None:
        """InMemCheckpointEngine.commit: inside save_checkpoint, before its final barrier. Blocks for the copy."""
        step = int(self.engine.global_steps)
        self._memory = None  # a restored state views slots that snapshots from now on may rewrite
        if self.pipe is not None:
            files = self.pipe.without_layer_files(files)
        if self.moe is not None:
            files = self.moe.without_expert_files(files)
        files = shards.with_specs(files, zero_stage=self.zero_stage, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                param_names=self._param_names,
                                partition_ranks=self.moe.partition_ranks() if self.moe else None)
        if self.pipe is not None:
            self.pipe.rekey(files)
        if self.moe is not None:
            self.moe.rekey(files)
        if self.tp is not None:
            self.tp.place(files)
        state = {"tag": tag, "step": step,
                 "files": {n: Replicated(sd) if self._replicated(n) else sd for n, sd in files.items()},
                 "rank": {"rng": capture_rng_state(), "extras": self.extra_state() if self.extra_state else None}}
        if self.pipe is not None:
            layers = self.pipe.layer_files()  # the same on every DP replica of the stage
            state["layers"] = Replicated(self.tp.place(layers) if self.tp is not None else layers)
            state["pipeline"] = {"names": self.pipe.names()}
        # overlap: the copy runs behind the next forward/backward; the wrapped step fences before the update.
        self.snap.save(step, state, overlap=True, topology=self._topology(files))

    def _topology(self, files: dict) -> Topology:
        import deepspeed

        engine = self.engine
        groups = []
        for fname, sd in files.items():
            osd = sd.get("optimizer_state_dict") if fname.endswith("optim_states.pt") else sd.get("optimizer")
            inner = (osd or {}).get("base_optimizer_state") or (osd or {}).get("optimizer_state_dict") or osd
            if inner and "param_groups" in inner:
                groups = [hyperparameters(g) for g in inner["param_groups"]]
                break
        if self.zero_stage in (1, 2):
            for group, shapes in zip(groups, shards.files_param_shapes(files)):
                group["keys"] = list(shapes)
        topology = self._layout()
        topology.position = {"global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples)}
        topology.optimizer = {"type": type(engine.basic_optimizer).__name__, "param_groups": groups}
        return topology

    def _layout(self) -> Topology:
        import deepspeed

        pipe, tp, experts = self.pipe, self.tp, self.moe
        return Topology(framework="deepspeed", framework_version=deepspeed.__version__,
                        world_size=self.snap.world_size, dp=self.dp_size,
                        tp=tp.size if tp else 1, pp=pipe.stages if pipe else 1,
                        ep=experts.ep if experts else 1,  # a split of DP: a rank's dp coordinate names its experts
                        coords={"dp": self.dp_rank, "tp": tp.rank if tp else 0, "pp": pipe.stage if pipe else 0},
                        zero_stage=self.zero_stage)

    def snapshot(self) -> None:
        """Take a snapshot now (collective). Returns at once: the copy runs behind training until the next
        engine.step() (which waits for it), the commit behind that."""
        self.engine.save_checkpoint(self.scratch, tag=stock.tag_of(int(self.engine.global_steps)))
        self._report()  # the snapshot before it, committed by now

    def wait(self) -> None:
        """Until the last snapshot is committed (the disk tier is the SMPs' business)."""
        self.snap.wait()

    def flush(self, timeout_s: float = 600.0) -> dict:
        """Put the job's newest complete step on disk on every node now and return once it is there (see
        Snapshotter.flush); after snapshot() it is that snapshot. Raises InmemFTError saying why not."""
        flushed = self.snap.flush(timeout_s)
        self._report()
        return flushed

    def _report(self) -> None:
        """The newest committed snapshot's stall, commit time and bytes into DeepSpeed's monitor (TensorBoard,
        W&B, CSV: what the config's monitor sections enable), which writes rank 0's."""
        events = self._unreported.events()
        monitor = getattr(self.engine, "monitor", None)
        if events and monitor is not None and monitor.enabled:
            monitor.write_events(events)

    # ---- restoring ----------------------------------------------------------------------------------------
    def _restore(self) -> Restored | None:
        """Collective: load the newest step complete in some tier; every rank loads the same one."""
        t0 = time.perf_counter()
        # views: the engine copies what it keeps (_load_memory); the checksums of the large regions run behind
        # the load and the first forward/backward, and the wrapped step's fence takes their verdict; what lived
        # on the GPU comes back there (to_device), so the engine's load copies on the device
        layout = self._layout()
        got = self.snap.resume(layout=layout, views=True, defer_checks=True, summary=False, to_device=True,
                               reshard=None if self.block.reshard == "never" else FromMemory.of(self.snap, layout))
        if got.reshard is not None:
            restored = self._load_resharded(got.reshard)
        elif got.state is not None:
            restored = self._load_memory(got.state)
        else:
            say_fresh(self.rank, log)
            return None
        restored.seconds = time.perf_counter() - t0
        restored.say(self.snap.config.node, self.rank, log)
        return restored

    def _load_memory(self, state: dict, *a, **kw) -> Restored:
        t0 = time.perf_counter()
        tag, anchor = state["tag"], self.snap.last_restore.path
        self._memory = (state,)
        # MoE: the expert files DeepSpeed asks for hold the live weights; moe.restored() sets them from the masters
        self.ckpt.serve(tag, {**state["files"], **self.moe.expert_files(tag)} if self.moe else state["files"],
                        anchor)
        # load_checkpoint globs <dir>/<tag>/mp_rank_*_model_states.pt and SDLoaderBase.load asserts
        # os.path.exists on the result before calling our engine.load. Instead of faking files, DeepSpeed gets
        # a path that exists and names this very snapshot: the shared-memory slot it was restored from
        # (/dev/shm/...). Our load() maps it to the model-states dict; the optimizer files DeepSpeed names
        # itself under <dir>/<tag>/ and only probes with os.path.exists, which a missing file passes.
        self.engine._get_all_ckpt_names = lambda _dir, _tag: [anchor] * self.engine.mp_world_size
        optimizer = self.engine.optimizer
        inner = [o for o in (optimizer, getattr(optimizer, "optimizer", None)) if isinstance(o, torch.optim.Optimizer)]
        # DeepSpeed's defaults: it loads the optimizer states and relinks the partitions
        displaced, shared = self._adopt_partitions(state["files"]) if not a and not kw else ([], [])
        try:
            # The state views a copy-on-write mapping of the slot; the engine copies parameters into its own
            # tensors (its fp32 partitions already are the views), and torch's optimizer keeps what it is given:
            # what is kept gets pages of its own behind the first forward/backward, done by the fence before the
            # first optimizer step (wrapped_step) or snapshot; the partitions the engine had are freed after
            # that. That work and the restore's background checks start as the block ends: started earlier, they
            # take cores from what is left of the restore (on a node with a core per rank, a rank's main thread
            # then waited 4-40 ms for a core in the few Python lines below).
            with PrivateAfterLoad(self.snap, inner, [self.engine.module], [optimizer] if optimizer is not None
                                  else [], defer=True, release=displaced), \
                    self.pipe.serving(state["layers"]) if self.pipe else contextlib.nullcontext():
                path, _ = self._load(self.scratch, tag, *a, **kw)
                if path is None:
                    raise RuntimeError(f"DeepSpeed did not load snapshot {tag} from memory")
                for master in shared:
                    master.data = self.snap.private_twin(master.data)
                if self.moe is not None:
                    self.moe.restored()
                restore_rng_state(state["rank"]["rng"])
                extras = private(state["rank"]["extras"], self.snap.mapped_storages())
        finally:
            del self.engine._get_all_ckpt_names
            self.ckpt.serve(None)
        phases = {**self.snap.last_restore.phases, "engine": round(time.perf_counter() - t0, 4)}
        return Restored.in_place(self.snap.last_restore, 0.0, phases, extras=extras, tag=tag)

    def _adopt_partitions(self, files: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Point the engine's fp32 master partitions at the restored ones where they match. Those are views of a
        copy-on-write mapping of the slot (Snapshotter.restore with views), so DeepSpeed's load, which copies the
        saved partitions into the engine's, finds them already there and copies nothing (torch's copy_ returns
        at once when source and destination are the same memory); PrivateAfterLoad then gives their pages to
        this process, behind the first forward/backward. Returns the tensors they had, and the masters whose
        view the module's partitions share for the load (_share_module_partitions)."""
        optimizer, cow, displaced, shared = self.engine.optimizer, self.snap.private_mappings(), [], []
        for ours, saved_key in FP32_PARTITIONS:
            current = getattr(optimizer, ours, None)
            saved = next((sd["optimizer_state_dict"][saved_key] for sd in files.values()
                          if saved_key in (sd.get("optimizer_state_dict") or {})), None)
            if current is None or saved is None or len(current) != len(saved):
                continue
            for mine, theirs in zip(current, saved):
                if (isinstance(theirs, torch.Tensor) and theirs.untyped_storage().data_ptr() in cow
                        and theirs.is_contiguous() and theirs.numel() == mine.numel()
                        and theirs.dtype == mine.dtype and theirs.device == mine.device):
                    displaced.append(mine.data)
                    mine.data = theirs.view(mine.shape)
            if ours == "fp32_partitioned_groups_flat":
                had = self._share_module_partitions(current, cow)
                displaced += had
                shared += current if had else []
        return displaced, shared

    def _share_module_partitions(self, masters: list[torch.Tensor], cow: set[int]) -> list[torch.Tensor]:
        """ZeRO-3's load then fills the partitions of the module's parameters from the masters: a copy of every
        parameter, most of the load on a CPU node. Where those partitions are one flat buffer of the master's
        dtype and device (an fp32 model, one sub-group, parameters not offloaded), the buffer takes the master's
        view too and that copy also finds the bytes in place; after the load the master gets a mapping of its
        own (Snapshotter.private_twin), since the two change apart. Returns what the buffer had ([]: not
        shared; DeepSpeed copies)."""
        optimizer = self.engine.optimizer
        flats, buffer = getattr(optimizer, "fp16_partitioned_groups_flat", None), \
            getattr(optimizer, "lp_param_buffer", None)
        if not (flats and len(flats) == 1 == len(masters) and isinstance(buffer, torch.Tensor)):
            return []
        flat, master = flats[0], masters[0]
        if (flat is master or master.untyped_storage().data_ptr() not in cow
                or flat.data_ptr() != buffer.data_ptr() or not flat.shape == buffer.shape == master.shape
                or flat.dtype != master.dtype or flat.device != master.device):
            return []
        had = buffer.data
        # lp_param_buffer backs the flat (DeepSpeed's offload_states/reload_states re-slice it): both move
        flat.data = buffer.data = master.data
        return [had]

    def _load_resharded(self, source: ReshardSource) -> Restored:
        """The step to restore was taken on another layout: every rank builds its state from it (collective)."""
        t0 = time.perf_counter()
        with source:  # a refusal below lets go of what the restore opened, too
            rs = source.open()
            pipeline.check_reshard(self.engine, rs.old.pp)
            reshard.check_target(self.engine)
            got = reshard.load(self.engine, rs, self.snap.agree_min, self.pipe or self.moe or reshard.ModuleKeys,
                               boxes=self.tp)
            phases = {**rs.seconds, **got["seconds"]}
            # the SMPs keep that step until a newer one is complete
            self.snap.resumed(RestoreInfo.resharded(rs, time.perf_counter() - t0, phases))
            return Restored.from_reshard(rs, 0.0, phases, extras=got["extras"], tag=stock.tag_of(rs.step))

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the last commit (and report it), then let go of the SMP."""
        try:
            self.snap.wait()
            self._report()
        finally:
            self.snap.close()


def install(engine, *, extra_state: Callable[[], Any] | None = None, config: dict | InmemFTBlock | None = None,
            snapshot_in_step: bool = True):
    """Protect a DeepSpeed engine with inmem_ft, per the `"inmem_ft"` block of its config (or `config`).

    Call it right after deepspeed.initialize, on every rank. It restores the newest snapshot (memory, else
    disk) into the engine and returns a Handle, whose `restored` says what was loaded (None: fresh start);
    None if the block is absent or disabled.

    `extra_state()` is called on every rank when a snapshot is taken: inside engine.step() at a snapshot step,
    after the update and before the caller's loop moves its own counters (so it returns the position after
    this step). `snapshot_in_step=False`: engine.step() takes none; the caller calls handle.snapshot() where
    its own state is between steps (the Hugging Face Trainer integration, whose counters move after the step).
    """
    if isinstance(config, InmemFTBlock):
        block = config
    elif config is not None:
        block = InmemFTBlock.from_dict(config)
    else:
        block = InmemFTBlock.from_framework_config(engine._config._param_dict)
    if block is None or not block.enabled:
        return None
    support.check_supported(engine, allow_untested=block.allow_untested)
    if engine.zero_optimization_partition_weights() and engine.global_steps:
        raise ConfigError("inmem_ft: install() on a ZeRO-3 engine that already trained; call it right after "
                          "deepspeed.initialize (DeepSpeed cannot load into a trained ZeRO-3 engine)")
    return Handle(engine, block, extra_state, snapshot_in_step)
