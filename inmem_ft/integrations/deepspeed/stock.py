"""A committed snapshot -> DeepSpeed's stock checkpoint layout on disk (`<dir>/global_step<N>/<names>`),
plus this rank's own state (RNG, data position) beside it in the snapshot file format (no pickle)."""
from __future__ import annotations

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
