"""Trainer-side capture: async copies into the SMP's memory, commit, agreement, restore."""
from .rng import capture_rng_state, restore_rng_state
from .snapshotter import Snapshotter

__all__ = ["Snapshotter", "capture_rng_state", "restore_rng_state"]
