"""inmem_ft/integrations/deepspeed/versions.py: what the checkpoint engine is handed by each DeepSpeed release it
runs on (a CheckpointCommitInfo from 0.18, the bare tag before), and the model states' set of sparse-module
names, which a snapshot holds as a list and DeepSpeed gets back as a set. The releases themselves run in
make test-compat; this runs on the installed one and on the tag strings older releases hand over."""
import os

import pytest

from inmem_ft.integrations.deepspeed import versions

checkpoint_engine = pytest.importorskip("deepspeed.runtime.checkpoint_engine.checkpoint_engine")


def test_tag_and_tag_dir_from_a_commit_info_or_the_bare_tag(tmp_path):
    info = checkpoint_engine.CheckpointCommitInfo(tag="global_step4", save_dir=str(tmp_path), save_latest=True)
    for given in (info, "global_step4"):
        assert versions.tag(given) == "global_step4"
        assert versions.is_tag_dir(given, os.path.join(tmp_path, "global_step4") + os.sep)
        assert not versions.is_tag_dir(given, str(tmp_path))
    assert not versions.is_tag_dir(info, "/elsewhere/global_step4")  # the release said where: only there


def test_sparse_module_names_travel_as_a_list_and_load_as_a_set():
    saved = {"module": {}, "sparse_tensor_module_names": {"b.weight", "a.weight"}}
    held = versions.plain(saved)
    assert held["sparse_tensor_module_names"] == ["a.weight", "b.weight"]
    restored = versions.loaded(held)
    assert restored == {"module": {}, "sparse_tensor_module_names": {"a.weight", "b.weight"}}
    assert restored is not held and held["sparse_tensor_module_names"] == ["a.weight", "b.weight"]
    assert versions.loaded({"module": {}}) == {"module": {}}  # 0.19 saves no such key
