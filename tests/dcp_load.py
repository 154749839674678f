"""Stand-alone: load a torch.distributed.checkpoint directory into tensors shaped from its own metadata and
compare each with a ground-truth file. Imports only torch, never inmem_ft.

    python tests/dcp_load.py --dir DIR --truth full.pt --result out.json
"""
import argparse
import json
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--truth", required=True)
    p.add_argument("--result", required=True)
    args = p.parse_args()
    meta = FileSystemReader(args.dir).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata)}
    state.update(step=-1, topology="")
    dcp.load(state, checkpoint_id=args.dir)
    truth = torch.load(args.truth, weights_only=True)
    with open(args.result, "w") as f:
        json.dump({"keys": sorted(k for k in state if k not in ("step", "topology")),
                   "mismatched": sorted(k for k, v in truth.items() if k not in state or not torch.equal(state[k], v)),
                   "step": state["step"], "topology": json.loads(state["topology"]),
                   "imported_inmem_ft": any(m.split(".")[0] == "inmem_ft" for m in sys.modules)}, f)


if __name__ == "__main__":
    main()
