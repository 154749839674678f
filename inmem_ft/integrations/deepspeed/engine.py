"""A DeepSpeed CheckpointEngine whose files are entries of an inmem_ft snapshot.

DeepSpeed's own save_checkpoint/load_checkpoint keep deciding which rank writes and reads which file
(docs/design.md, "How the DeepSpeed adapter hooks DeepSpeed"); this engine only translates: save() collects the dicts,
commit() hands them to the owner (which takes the snapshot), load() serves a file from the restored
snapshot, or from disk with torch.load(weights_only=True).
"""
from __future__ import annotations

import os

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from . import versions
from .types import safe_load_context

MODEL_STATES = "model_states.pt"


class InMemCheckpointEngine(CheckpointEngine):
    def __init__(self, commit_fn):
        super().__init__()
        self.name = "inmem_ft"
        self._commit_fn = commit_fn  # (tag, {file name: state dict}) -> None; takes the snapshot
        self._info = None  # what create() got: a CheckpointCommitInfo or the tag (versions.py)
        self._files: dict[str, dict] | None = None
        self._serving: tuple[str, dict, str] | None = None  # (tag, files, anchor path)

    # ---- save ---------------------------------------------------------------------------------------------
    def create(self, info):
        self._info, self._files = info, {}

    def makedirs(self, path, exist_ok=False):
        # save_dir must really exist: DeepSpeed writes zero_to_fp32.py there with shutil.copyfile. The tag
        # directory would only ever hold our files, which go to the SMP, so it is not created.
        if self._info is not None and versions.is_tag_dir(self._info, path):
            return
        os.makedirs(path, exist_ok=True)

    def save(self, state_dict, path: str):
        # Tensors here are live (DeepSpeed does not clone): they are copied when commit() snapshots them,
        # still inside save_checkpoint, before any optimizer step can change them.
        self._files[os.path.basename(path)] = versions.plain(state_dict)

    def commit(self, info):
        files, self._files, self._info = self._files, None, None
        self._commit_fn(versions.tag(info), files or {})
        return True

    def is_data_parallel_writer(self, dp_rank):  # asked by MoE saves only (moe.py)
        return True  # every replica hands over what it holds; the snapshot splits the replicas' shares

    def preserves_storage_sharing(self):  # asked from 0.18 (versions.py)
        return False  # the snapshot copies each view's own elements; DeepSpeed need not clone first

    # ---- load ---------------------------------------------------------------------------------------------
    def serve(self, tag: str | None, files: dict | None = None, anchor: str | None = None) -> None:
        """Answer loads of `tag` from `files` (a restored snapshot); None stops serving."""
        self._serving = (tag, files, anchor) if tag is not None else None

    def held(self, path: str) -> dict | None:
        if self._serving is None:
            return None
        tag, files, anchor = self._serving
        if path == anchor:  # the model-states name handed to DeepSpeed (see Handle._load_memory)
            return next(sd for name, sd in files.items() if name.endswith(MODEL_STATES))
        if os.path.basename(os.path.dirname(path)) == tag:
            return files.get(os.path.basename(path))
        return None

    def load(self, path: str, map_location=None):
        sd = self.held(path)
        if sd is not None:
            return versions.loaded(sd)  # DeepSpeed reads the model states twice; a fresh top level each time
        import torch

        with safe_load_context():
            return torch.load(path, map_location=map_location, weights_only=True)
