"""DeepSpeed's stock checkpoint names and dicts, as save_checkpoint hands them over: its tags, and the model and
optimizer states of one ZeRO rank's files."""
from __future__ import annotations

from ...errors import InmemFTError


def tag_of(step: int) -> str:
    return f"global_step{step}"


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
