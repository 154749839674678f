"""The launch scripts and example configs shipped inside the package, by the names the CLI offers
(`inmem-ft launch-script`, `inmem-ft example-config`): an installed inmem_ft has no repository beside it. In the
repository they live in launch/ and configs/; inmem_ft/launch_scripts and inmem_ft/configs link there, and the
wheel holds the files themselves at those places (pyproject.toml)."""
from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH_SCRIPTS = {"torchrun": "torchrun_inmem.sh", "slurm": "slurm_inmem.sbatch"}
EXAMPLE_CONFIGS = {"deepspeed": "deepspeed_zero2.json", "deepspeed-zero1": "deepspeed_zero1.json",
                   "deepspeed-zero2": "deepspeed_zero2.json", "deepspeed-zero3": "deepspeed_zero3.json",
                   "megatron": "megatron_gpt.json"}


def launch_script(name: str) -> str:
    """The installed path of a launch script (the SLURM script runs the torchrun one from there)."""
    return os.path.join(_HERE, "launch_scripts", LAUNCH_SCRIPTS[name])


def example_config(name: str) -> str:
    return os.path.join(_HERE, "configs", EXAMPLE_CONFIGS[name])
