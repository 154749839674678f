"""`dlrover-run` with the one adapter DLRover 0.6.1 needs on torch 2.13.

    python benchmarks/peers/dlrover_run.py --standalone --nproc_per_node 2 --max-restarts 1 train.py ...
"""
import functools
import sys

from torch.distributed.elastic.multiprocessing.api import SubprocessHandler

from dlrover.trainer.torch import elastic_run

# Its standalone mode starts its local master with SubprocessHandler(cmd, args, env, stdout, stderr, rank),
# written for torch < 2.10; torch 2.13 added a required `numa_options` (TypeError: missing 'numa_options').
elastic_run.SubprocessHandler = functools.partial(SubprocessHandler, numa_options=None)

if __name__ == "__main__":
    sys.exit(elastic_run.main())
