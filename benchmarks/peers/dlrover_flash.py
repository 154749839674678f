"""DLRover Flash Checkpoint for DeepSpeed, as benchmarks/deepspeed_save.py runs it: whether it is installed, and
its checkpointer with the adapters DLRover 0.6.1 needs on DeepSpeed 0.19.8 / torch 2.13."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys

VERSION = "0.6.1"  # the version the adapters below are written for
INSTALL = "pip install -c constraints.txt -r benchmarks/requirements-dlrover.txt"
RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dlrover_run.py")


def missing() -> str | None:
    """Why DLRover cannot run here (with the install line), or None. Finds modules without importing them."""
    for module, why in (("dlrover", "DLRover is not installed"),
                        ("grpc", "DLRover does not import without grpcio"),
                        ("kubernetes", "dlrover-run needs dlrover[k8s]"),
                        ("google.protobuf", "dlrover-run's local master needs protobuf")):
        if importlib.util.find_spec(module) is None:
            return f"{why} (no module '{module}'): {INSTALL}"
    if version() != VERSION:
        return f"DLRover {version()} is installed; the adapters here are written for {VERSION}: {INSTALL}"
    return None


def version() -> str:
    return importlib.metadata.version("dlrover")


def launcher(nproc: int, restarts: int) -> list[str]:
    """The command line of DLRover's own launcher, one node, `restarts` worker restarts after a failure."""
    return [sys.executable, RUN, "--standalone", "--nnodes", "1", "--nproc_per_node", str(nproc),
            "--max-restarts", str(restarts)]


def job_env(job: str, scratch: str) -> dict:
    """The environment of a DLRover job named `job` (which names its shared memory and sockets), with its
    event logs in `scratch` rather than a shared /tmp/dlrover."""
    from dlrover.python.common.constants import NodeEnv
    # Read by dlrover.python.training_event.config, which is not imported here: importing it starts an event
    # log of this process in /tmp/dlrover.
    return {NodeEnv.JOB_NAME: job, "DLROVER_EVENT_FILE_DIR": scratch}


def cleanup(job: str, nproc: int) -> None:
    """Frees what a DLRover job leaves behind when it ends: its agent does not unlink the shared memory that
    holds a copy of each local rank's state, nor remove its folder of local sockets."""
    from multiprocessing.shared_memory import SharedMemory
    from dlrover.python.common.multi_process import SOCKET_TMP_DIR
    from dlrover.python.elastic_agent.torch.ckpt_saver import CheckpointSharedObjPrefix
    for rank in range(nproc):
        try:
            shm = SharedMemory(name=f"{job}_{CheckpointSharedObjPrefix.SHM_NAME}{rank}")
        except FileNotFoundError:
            continue
        shm.close()
        shm.unlink()
    shutil.rmtree(os.path.join(SOCKET_TMP_DIR, job), ignore_errors=True)


def checkpointer(engine, checkpoint_dir: str):
    """DLRover's DeepSpeedCheckpointer for `engine`, saving under `checkpoint_dir`."""
    from dlrover.trainer.torch.flash_checkpoint.deepspeed import AsyncCheckpointAgent, DeepSpeedCheckpointer

    class Agent(AsyncCheckpointAgent):
        """DLRover swaps torch.save/torch.load for these two methods while DeepSpeed saves and loads, and they
        take only (state_dict, path) and (path, map_location); DeepSpeed 0.19.8's TorchCheckpointEngine also
        passes `_use_new_zipfile_serialization` to torch.save and `weights_only` to torch.load (TypeError)."""

        def save(self, state_dict, path, **_torch_save_kwargs):
            super().save(state_dict, path)

        def load(self, path, map_location=None, **_torch_load_kwargs):
            return super().load(path, map_location=map_location)

    ckpt = DeepSpeedCheckpointer(engine, checkpoint_dir)
    ckpt._ckpt_agent = Agent(ckpt._async_save_engine.storage)
    return ckpt


def save(ckpt, step: int, to_disk: bool) -> None:
    """One save of the engine's state at `step` (DLRover takes the tag as the step), to its shared memory, or
    to shared memory and then to disk behind training. Raises if DLRover skipped the memory copy (it does
    while its saver is still writing the previous step to disk), so a skip is never timed as a save."""
    from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
    ckpt.save_checkpoint(ckpt.checkpoint_dir, tag=step,
                         storage_type=StorageType.DISK if to_disk else StorageType.MEMORY)
    if ckpt._async_save_engine._cached_step != step:
        raise RuntimeError(f"DLRover skipped the memory copy of step {step} (its saver held the shared memory)")


def persisted_step(checkpoint_dir: str) -> int | None:
    """The newest step DLRover's saver has committed to disk (its tracer file), or None."""
    from dlrover.python.common.constants import CheckpointConstant
    try:
        with open(os.path.join(checkpoint_dir, CheckpointConstant.TRACER_FILE_NAME)) as f:
            return int(f.read().strip() or 0)
    except FileNotFoundError:
        return None
