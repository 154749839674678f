"""A committed snapshot -> DeepSpeed's stock checkpoint layout on disk (`<dir>/global_step<N>/<names>`),
plus this rank's own state (RNG, data position) beside it in the snapshot file format (no pickle)."""
from __future__ import annotations

import glob
import os

from ...errors import InmemFTError
from ...persist.atomic import atomic_write
from ...persist.statefile import read_state, write_state


def tag_of(step: int) -> str:
    return f"global_step{step}"


def step_of(tag: str | None) -> int | None:
    if tag and tag.startswith("global_step") and tag[len("global_step"):].isdigit():
        return int(tag[len("global_step"):])
    return None


def rank_state_path(directory: str, tag: str, rank: int) -> str:
    return os.path.join(directory, tag, f"inmem_ft_rank{rank}.state")


def write_files(directory: str, step: int, state: dict, *, rank: int, writes) -> None:
    """This rank's share of stock step `step`: each file `writes(name)` accepts, then its own state file."""
    import torch

    tag_dir = os.path.join(directory, tag_of(step))
    os.makedirs(tag_dir, exist_ok=True)
    for name, sd in state["files"].items():
        if writes(name):
            atomic_write(os.path.join(tag_dir, name),
                         lambda f, sd=sd: torch.save(sd, f, _use_new_zipfile_serialization=True))
    write_state(rank_state_path(directory, tag_of(step), rank), state["rank"], step)


def read_rank_state(directory: str, tag: str, rank: int):
    return read_state(rank_state_path(directory, tag, rank))


def model_and_optimizer(files: dict, what: str) -> tuple[dict, dict, dict]:
    """(model states, optimizer states, the torch optimizer's state dict inside them) of one ZeRO-1/2/3 rank's
    files ({name: state dict}, as save_checkpoint hands them over); `what` names them for errors."""
    model = next((sd for name, sd in files.items() if name.endswith("model_states.pt")), None)
    optim = next((sd for name, sd in files.items() if name.endswith("optim_states.pt")), None)
    if model is None or optim is None:
        raise InmemFTError(f"{what} lacks DeepSpeed's model or optimizer states (files: {sorted(files)}): not a "
                           f"ZeRO-1/2/3 snapshot")
    osd = optim["optimizer_state_dict"]
    return model, osd, osd.get("base_optimizer_state") or osd["optimizer_state_dict"]  # ZeRO-1/2, ZeRO-3


def model_states_path(directory: str, tag: str) -> str:
    """DP rank 0's model-states file of step `tag` (ZeRO-0/1/2 write one for all, ZeRO-3 one per rank)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if os.path.exists(os.path.join(directory, tag, name)):
            return os.path.join(directory, tag, name)
    raise InmemFTError(f"{os.path.join(directory, tag)} holds no model states of DP rank 0: not a checkpoint of the "
                       f"disk tier")


def files_on_disk(directory: str, tag: str) -> dict[int, dict]:
    """DP rank -> the stock files of step `tag` that rank wrote ({name: state dict}), memory-mapped: a loader
    touches only the pages it reads."""
    tag_dir = os.path.join(directory, tag)
    ranks = sorted(int(os.path.basename(p)[len("zero_pp_rank_"):].split("_")[0]) for p in
                   glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_mp_rank_00_optim_states.pt")))
    if not ranks:
        raise InmemFTError(f"{tag_dir} holds no ZeRO optimizer states (zero_pp_rank_*_mp_rank_00_optim_states.pt): "
                           f"not a ZeRO-1/2/3 checkpoint of the disk tier")
    names = {r: [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
                 *(["mp_rank_00_model_states.pt"] if r == 0 else [])] for r in ranks}
    return {r: {name: load_mapped(os.path.join(tag_dir, name)) for name in names[r]
                if os.path.exists(os.path.join(tag_dir, name))} for r in ranks}


def load_mapped(path: str) -> dict:
    import torch

    from .types import safe_load_context

    with safe_load_context():
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
