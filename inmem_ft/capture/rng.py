"""Random-number-generator states a bit-identical resume needs; frameworks save none of them (DeepSpeed)
or only some, so inmem_ft carries them itself."""
from __future__ import annotations

import random

import numpy as np
import torch

from .. import device


def capture_rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    state.update(device.rng_states())
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    # Restored tensors may be views into one restore buffer; set_rng_state crashes (torch 2.13, SIGSEGV) on
    # a view with a storage offset, so it gets a compact copy of these few bytes.
    torch.set_rng_state(state["torch"].clone())
    device.set_rng_states(state)
