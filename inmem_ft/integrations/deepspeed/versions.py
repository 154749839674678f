"""What differs between the DeepSpeed releases the adapter runs on, in one place: the tested 0.16, 0.17, 0.18 and
0.19 series (inmem_ft.compat.TESTED) save and resume through the same code with these (what the compatibility matrix
found on each: docs/compatibility.md).

- What CheckpointEngine.create() and commit() are handed: from 0.18 a CheckpointCommitInfo (tag, save_dir,
  save_latest) to both; 0.17's save_checkpoint hands it to create() but the bare tag string to commit(); 0.16
  has no CheckpointCommitInfo and hands the tag to both. The adapter reads the tag and the directory through
  tag() and is_tag_dir(), whichever it got.
- preserves_storage_sharing(): asked from 0.18, where False spares DeepSpeed its clone of each tensor before
  save(); 0.16/0.17 never ask and always clone, which costs a copy but hands save() the same values.
- 0.16-0.18 keep the names of the modules with sparse gradients in the model states as a set
  (`sparse_tensor_module_names`; 0.19 dropped the key). A snapshot holds plain data, so plain() stores it as a
  sorted list and loaded() makes it a set again before DeepSpeed loads it.
- 0.18's ZeRO-1/2 step cannot finish on gloo: gloo_all_gather_without_autograd()."""
from __future__ import annotations

import os


def tag(info) -> str:
    """The checkpoint's tag, from a CheckpointCommitInfo or the tag itself."""
    return str(getattr(info, "tag", info))


def is_tag_dir(info, path: str) -> bool:
    """Whether `path` is the checkpoint's tag directory: save_dir/tag where the release says save_dir (a
    CheckpointCommitInfo), else any directory named as the tag."""
    where = getattr(info, "save_dir", None)
    if where is None:
        return os.path.basename(os.path.normpath(path)) == tag(info)
    return os.path.normpath(path) == os.path.normpath(os.path.join(where, tag(info)))


_SETS = ("sparse_tensor_module_names",)


def plain(state_dict: dict) -> dict:
    """A file's state dict as a snapshot can hold it: its sets (above) as sorted lists, in place."""
    for key in _SETS:
        if isinstance(state_dict.get(key), set):
            state_dict[key] = sorted(state_dict[key])
    return state_dict


def loaded(state_dict: dict) -> dict:
    """A copy of a restored file's state dict as DeepSpeed saved it: plain()'s lists as sets again."""
    return {**state_dict, **{k: set(state_dict[k]) for k in _SETS if isinstance(state_dict.get(k), list)}}


def gloo_all_gather_without_autograd() -> None:
    """0.18's ZeRO-1/2 flat parameter buffers keep the autograd history of the torch.cat that built them (0.16 and
    0.17 build them from copies of the parameters' data; 0.19 detaches them). Each step ends with an all-gather into
    views of those buffers: NCCL writes the buffer itself, but gloo writes through the outputs of a split, which
    autograd refuses in grad mode ("Output 0 of Split is a view and is being modified inplace", plain DeepSpeed
    0.18.9 on gloo: tests/compat/plain_zero_step.py). On 0.18, runs that all-gather without autograd, which is
    what 0.19's detached buffers amount to."""
    import deepspeed
    import deepspeed.runtime.utils as ds_utils
    import torch
    from packaging.version import Version

    gather = ds_utils.all_gather_into_tensor_dp_groups
    if Version(deepspeed.__version__).release[:2] != (0, 18) or getattr(gather, "_inmem_ft_no_grad", False):
        return
    gather = torch.no_grad()(gather)
    gather._inmem_ft_no_grad = True
    ds_utils.all_gather_into_tensor_dp_groups = gather  # all_gather_dp_groups looks it up in the module
