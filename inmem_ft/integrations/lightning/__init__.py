"""Lightning adapter: the `"inmem_ft"` block in the DeepSpeed config and one strategy, over the DeepSpeed adapter
(which keeps all the snapshot and restore logic):

    trainer = lightning.Trainer(strategy=InmemFTStrategy(config=ds_config), ...)   # instead of DeepSpeedStrategy

See docs/lightning.md for what it restores.
"""
from .strategy import InmemFTStrategy

__all__ = ["InmemFTStrategy"]
