"""The pretrain arguments (`--inmem-ft ...`) and the config block they resolve to.

Values are checked while Megatron parses its command line, so a bad one stops the job before any process
group exists, with argparse's "argument --inmem-ft-...: ..." message naming it.
The parse also fits --global-batch-size to the data-parallel size the job starts on (a shrink or grow changed
it), before Megatron validates it (batch.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from ... import argtypes
from ...config import InmemFTBlock
from ...errors import ConfigError
from ...globalbatch import ON_SHRINK
from .batch import keep_global_batch


_interval = argtypes.bounded(int, "{text!r}: must be an integer number of iterations >= 1", minimum=1)
_sentinel_steps = argtypes.bounded(int, "{text!r}: must be an integer number of iterations >= 0 (0: off)", minimum=0)
_fingerprint_every = argtypes.bounded(int, "{text!r}: must be an integer number of snapshots >= 0 (0: off)", minimum=0)
_job = argtypes.job_id


def _config_file(path: str) -> str:
    # Kept as the path (args are stored in every Megatron checkpoint): only checked here.
    try:
        read_block(path)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return path


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's `extra_args_provider`: parse_and_validate_args(extra_args_provider=add_args)."""
    g = parser.add_argument_group("inmem_ft", "in-memory, erasure-coded snapshots (inmem_ft)")
    g.add_argument("--inmem-ft", action="store_true",
                   help="snapshot the training state into the node's SMP and restore from it on start")
    g.add_argument("--inmem-ft-interval", type=_interval, default=None, metavar="N",
                   help="snapshot every N iterations (default: the config's interval, else 100)")
    g.add_argument("--inmem-ft-sentinel-steps", type=_sentinel_steps, default=None, metavar="N",
                   help="iterations after a restore whose loss is screened for NaN/Inf or a spike (default: the "
                        "config's sentinel_steps, else 20; 0: off)")
    g.add_argument("--inmem-ft-fingerprint-every", type=_fingerprint_every, default=None, metavar="N",
                   help="every N snapshots the data-parallel replicas compare fingerprints of their replicated "
                        "weights (default: the config's fingerprint_every, else 10; 0: off)")
    g.add_argument("--inmem-ft-on-shrink", choices=ON_SHRINK, default=None,
                   help="the data-parallel size changed and --global-batch-size does not divide by micro batch x "
                        "DP: 'keep' trains with the nearest number of micro-batches (and says the new global "
                        "batch), 'refuse' waits for a node to join under inmem-ft run (default: the config's on_shrink, else keep)")
    g.add_argument("--inmem-ft-job", type=_job, default=None, metavar="NAME",
                   help="job id naming the SMP (default: the config's, else $INMEM_FT_JOB)")
    g.add_argument("--inmem-ft-config", type=_config_file, default=None, metavar="FILE",
                   help="JSON file with an \"inmem_ft\" block, the same as in a DeepSpeed config")
    fit_when_parsed(parser)
    return parser


def read_block(path: str) -> InmemFTBlock:
    with open(path) as f:
        try:
            config = json.load(f)
        except ValueError as e:
            raise ConfigError(f"{path}: not JSON: {e}") from None
    if not isinstance(config, dict) or "inmem_ft" not in config:
        raise ConfigError(f"{path}: no \"inmem_ft\" block at the top level (see `inmem-ft example-config megatron`)")
    return InmemFTBlock.from_framework_config(config)


def block_from_args(args) -> InmemFTBlock:
    """The block of --inmem-ft-config with the command line's interval and job over it."""
    block = read_block(args.inmem_ft_config) if args.inmem_ft_config else InmemFTBlock()
    overrides = {k: v for k, v in (("interval", args.inmem_ft_interval), ("job", args.inmem_ft_job),
                                   ("sentinel_steps", getattr(args, "inmem_ft_sentinel_steps", None)),
                                   ("fingerprint_every", getattr(args, "inmem_ft_fingerprint_every", None)),
                                   ("on_shrink", getattr(args, "inmem_ft_on_shrink", None)))
                 if v is not None}
    return dataclasses.replace(block, **overrides, enabled=True)


def fit_when_parsed(parser: argparse.ArgumentParser) -> None:
    """Make `parser`'s parse (parse_args goes through parse_known_args) fit the global batch of an --inmem-ft run
    to the data-parallel size the job starts on, before Megatron validates it. The size is Megatron's own
    reckoning, from the same $WORLD_SIZE its parse_args reads: world / (TP x PP x CP)."""
    parse = parser.parse_known_args

    def parse_and_fit(*args, **kwargs):
        parsed, rest = parse(*args, **kwargs)
        if getattr(parsed, "inmem_ft", False) and getattr(parsed, "global_batch_size", None) is not None:
            model = parsed.tensor_model_parallel_size * parsed.pipeline_model_parallel_size * \
                parsed.context_parallel_size
            world = int(os.environ.get("WORLD_SIZE", "1"))
            if world % model == 0:  # else Megatron's own check says what does not divide
                keep_global_batch(parsed, block_from_args(parsed).on_shrink, world // model)
        return parsed, rest

    parser.parse_known_args = parse_and_fit
