"""Stand-alone: load a torch.distributed.checkpoint directory into tensors shaped from its own metadata and
compare each with a ground truth: a torch.save'd {key: tensor} file, or another DCP directory (a stock
dcp.save). Imports only torch, never inmem_ft.

    python tests/dcp_load.py --dir DIR (--truth full.pt | --truth-dcp DIR) --result out.json
"""
import argparse
import json
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def tensors(path: str) -> dict:
    """Every tensor of the DCP checkpoint at `path`, and its byte items `step` and `topology` where it has them."""
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata)}
    state.update({k: v for k, v in (("step", -1), ("topology", "null")) if k in meta})
    dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    return state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    truth = p.add_mutually_exclusive_group(required=True)
    truth.add_argument("--truth")
    truth.add_argument("--truth-dcp")
    p.add_argument("--result", required=True)
    args = p.parse_args()
    state = tensors(args.dir)
    truth = torch.load(args.truth, weights_only=True) if args.truth else \
        {k: v for k, v in tensors(args.truth_dcp).items() if isinstance(v, torch.Tensor)}
    with open(args.result, "w") as f:
        json.dump({"keys": sorted(k for k in state if k not in ("step", "topology")), "truth_keys": sorted(truth),
                   "mismatched": sorted(k for k, v in truth.items() if k not in state or not torch.equal(state[k], v)),
                   "step": state.get("step"), "topology": json.loads(state.get("topology", "null")),
                   "imported_inmem_ft": any(m.split(".")[0] == "inmem_ft" for m in sys.modules)}, f)


if __name__ == "__main__":
    main()
