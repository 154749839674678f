"""Stand-alone, imports only torch (never inmem_ft): load two DCP checkpoint directories with stock
FileSystemReader into tensors shaped from the first's metadata, and write which differ, plus the second's
`step` byte item.

    python tests/dcp_stock_compare.py --stock DIR --exported DIR --result out.json
"""
import argparse
import json
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def tensors(path: str, like: dict) -> dict:
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in like.items()}
    dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    return state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stock", required=True)
    p.add_argument("--exported", required=True)
    p.add_argument("--result", required=True)
    args = p.parse_args()
    like = {k: m for k, m in FileSystemReader(args.stock).read_metadata().state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}
    stock, exported = tensors(args.stock, like), tensors(args.exported, like)
    step = {"step": -1}
    dcp.load(step, storage_reader=FileSystemReader(args.exported), no_dist=True)
    with open(args.result, "w") as f:
        json.dump({"keys": sorted(like), "mismatched": sorted(k for k in like if not torch.equal(stock[k], exported[k])),
                   "step": step["step"], "imported_inmem_ft": any(m.split(".")[0] == "inmem_ft" for m in sys.modules)},
                  f)


if __name__ == "__main__":
    main()
