"""What a replica fingerprint costs per snapshot, against the snapshot's own copy, side by side.

    python benchmarks/fingerprint_cost.py --quick --json out/fingerprint.json

One process holds the state benchmarks/snapshot_stall.py uses (Linear blocks with Adam, ~100M parameters,
--quick: ~8M), marked Replicated and laid out as data-parallel rank 0 of `--replicas` (each replica stores its
share of it: snapshot/layout.py). Timed in the same run, on the same state:
  copy_s         the snapshot's copy of this rank's share into host memory (what a save blocks on, on a CPU)
  held_s         the digests of the other replicas' shares from the state (before the fence: blocking without
                 overlap, behind forward/backward with it): xxh3 of host tensors, the torch digest of device ones
  own_s          the digests of this rank's share: host pieces from the stored bytes (the commit thread, off the
                 training path), device pieces from the state beside held_s
  torch_digest_s the torch digest (capture/fingerprint.chunk_sums) of the other shares where the state lives: on
                 a GPU what held_s is made of, on a CPU what xxh3 spares the host
`--device cuda` (the default where CUDA is available) keeps the state in accelerator memory. Medians. fingerprint_per_copy is (held_s + own_s) / copy_s: what one compared snapshot adds to a snapshot's cost;
divided by fingerprint_every (default 10) it is the cost spread over every snapshot.
"""
from __future__ import annotations

import argparse

import torch

import report  # benchmarks/report.py (the script's own folder is on sys.path)
from snapshot_stall import build_state, timed

from inmem_ft.capture import fingerprint
from inmem_ft.config import SnapshotConfig
from inmem_ft.snapshot import Replicated, layout, pack
from inmem_ft.snapshot.tree import flatten


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a ~8M-parameter model and fewer repeats")
    p.add_argument("--replicas", type=int, default=2, help="data-parallel replicas the state is split over")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the state lives (default: cuda where available, else cpu)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    hidden, layers, repeats = (1024, 2, 5) if args.quick else (2048, 6, 5)
    model, opt, params = build_state(hidden, layers, torch.device(args.device))
    flat = flatten(Replicated({"model": model.state_dict(), "optimizer": opt.state_dict()}))
    plan = layout.plan(flat, step=1, rank=0, world_size=args.replicas, dp_rank=0, dp_size=args.replicas)
    data = torch.empty(plan.data_len, dtype=torch.uint8)
    shares = fingerprint.shares(plan.manifest["leaves"], plan.manifest["replicated"])
    stored = memoryview(data.numpy())[plan.manifest["replicated"]["o"]:]

    copy_s = timed(lambda: pack.write(flat.values, plan.copies, plan.batches, data), repeats)
    held_s = timed(lambda: [fingerprint.of_state(flat.values, s) for s in shares[1:]], repeats)
    own_s = timed(lambda: fingerprint.of_slot(stored, shares[0], flat.values,
                                              fingerprint.of_state(flat.values, shares[0], device_only=True)), repeats)
    torch_s = timed(lambda: [fingerprint.chunk_sums(pack.source_bytes(flat.values[p.leaf], p.lo, p.hi)).cpu()
                             for s in shares[1:] for p in s], repeats)
    every = SnapshotConfig.fingerprint_every
    results = {"quick": args.quick, "device": args.device, "params": params, "replicas": args.replicas,
               "share_bytes": plan.data_len, "copy_s": copy_s, "held_s": held_s, "own_s": own_s,
               "torch_digest_s": torch_s,
               "fingerprint_per_copy": (held_s + own_s) / copy_s, "fingerprint_every": every,
               "fingerprint_per_snapshot": (held_s + own_s) / copy_s / every}
    print(f"{params / 1e6:.0f}M parameters over {args.replicas} replicas: copy of a share "
          f"{copy_s * 1e3:.1f} ms; fingerprint: other shares {held_s * 1e3:.1f} ms, own share {own_s * 1e3:.1f} ms "
          f"({results['fingerprint_per_copy']:.2f} of the copy; every {every}th snapshot: "
          f"{results['fingerprint_per_snapshot']:.3f} per snapshot); the torch digest of the other shares on "
          f"{args.device}: {torch_s * 1e3:.1f} ms")
    report.write(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
