"""The job-wide catalog of one step: where every fragment of every global tensor lives, and whether the `main`
fragments cover each global tensor exactly.

Built from the slot listings every SMP gives for its own slots (`SMPClient.catalog()`), so no node is a single
point of failure. One row per stored fragment piece, as an Arrow table:

    key, dtype, itemsize, global_shape        the global tensor
    offset, shape                             the box this fragment covers
    flat_lo, flat_hi                          the elements of the box it holds, in row-major box order
    main, replica                             the copy a loader reads; this copy's replica coordinates
    node, rank, step, segment, source         the slot holding the bytes (source: memory | parity)
    slot_offset, nbytes, frag_byte_lo         bytes [slot_offset, slot_offset+nbytes) of that slot are bytes
                                              [frag_byte_lo, frag_byte_lo+nbytes) of the fragment's elements
                                              (flat_lo..flat_hi, row-major, dtype-sized)
    leaf                                      the leaf index in the rank's manifest

A fragment of a rank's own tensor is one row. A fragment of a replicated tensor (stored once per data-parallel
group, each replica keeping a share of the bytes, layout.share_bounds) is one row per share it touches, and
a share boundary may cut an element in two: `frag_byte_lo` says exactly which bytes each row holds.
A leaf without a shard spec is catalogued as a whole tensor under a synthetic key: `_rank<R>.leaf<i>` for a
rank's own, `_replicated[.<coords>].leaf<i>` for a replicated one (coords: the rank's non-dp coordinates).
"""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from ..errors import CatalogHole, StepIncomplete
from .layout import share_bounds

_INTS = pa.list_(pa.int64())
SCHEMA = pa.schema([
    ("key", pa.string()), ("dtype", pa.string()), ("itemsize", pa.int64()), ("global_shape", _INTS),
    ("offset", _INTS), ("shape", _INTS),
    ("flat_lo", pa.int64()), ("flat_hi", pa.int64()), ("main", pa.bool_()), ("replica", _INTS),
    ("node", pa.int64()), ("rank", pa.int64()), ("step", pa.int64()), ("segment", pa.string()),
    ("source", pa.string()), ("slot_offset", pa.int64()), ("nbytes", pa.int64()), ("frag_byte_lo", pa.int64()),
    ("leaf", pa.int64()),
])


def complete_step(entries: list[dict], step: int | None = None) -> int:
    """`step` if every rank of the job holds it (in memory or parity), else the newest such step; raises
    StepIncomplete saying which ranks each step lacks. Each step is judged against its own world size: a job
    that came back on another layout holds steps of both until the old ones are overwritten."""
    if not entries:
        raise StepIncomplete("no node holds any committed snapshot of this job")
    held: dict[int, set] = {}
    worlds: dict[int, set] = {}
    for e in entries:
        held.setdefault(e["step"], set()).add(e["rank"])
        worlds.setdefault(e["step"], set()).add(e["manifest"]["world_size"])
    mixed = {s: sorted(w) for s, w in worlds.items() if len(w) > 1}
    if mixed:
        s = max(mixed)
        raise StepIncomplete(f"the slots of step {s} disagree on the world size ({mixed[s]}): snapshots of two jobs "
                             f"under one job id; clean the stale ones (inmem-ft smp stop --wipe on their nodes)")
    missing = {s: sorted(set(range(worlds[s].pop())) - ranks) for s, ranks in held.items()}
    if step is not None:
        if step not in missing:
            raise StepIncomplete(f"step {step} is not held for every rank: no rank has a slot of it on any reachable "
                                 f"node (held: {_describe(missing)})")
        if missing[step]:
            raise StepIncomplete(f"step {step} is not held for every rank: ranks {_short(missing[step])} of "
                                 f"{len(missing[step]) + len(held[step])} have no slot of it on any reachable node "
                                 f"(held: {_describe(missing)})")
        return step
    done = [s for s, lack in missing.items() if not lack]
    if not done:
        raise StepIncomplete(f"no step is held for all its ranks on the reachable nodes: {_describe(missing)}")
    return max(done)


def fragments(entries: list[dict], step: int, prefer_node: int | None = None) -> pa.Table:
    """The rows of `step` (see the module docstring), from the listings of every node. When a rank's slot is
    listed twice (a moved rank's old and new node, or memory and parity), the memory copy is used, the one
    on `prefer_node` (the reader's own node) first."""
    chosen: dict[int, dict] = {}
    for e in sorted(select(entries, step, prefer_node), key=lambda e: e["rank"]):
        chosen.setdefault(e["rank"], e)
    rows = []
    for rank in sorted(chosen):
        rows += _slot_rows(chosen[rank])
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def select(entries: list[dict], step: int, prefer_node: int | None = None) -> list[dict]:
    """The listed slots of `step`, best copy first per rank (see fragments)."""
    return sorted((e for e in entries if e["step"] == step),
                  key=lambda e: (e["source"] != "memory", e["node"] != prefer_node, e["node"]))


def _slot_rows(entry: dict) -> list[dict]:
    man = entry["manifest"]
    rep = man.get("replicated")
    if rep:
        lo, hi, _ = share_bounds(rep["total"], rep["dp_rank"], rep["dp_size"])
        if (lo, hi) != (rep["lo"], rep["hi"]):
            raise StepIncomplete(f"node {entry['node']} rank {entry['rank']} step {entry['step']}: the manifest's "
                                 f"replicated share [{rep['lo']}, {rep['hi']}) is not the layout's [{lo}, {hi})")
    where = {"node": entry["node"], "rank": entry["rank"], "step": entry["step"], "segment": entry["segment"],
             "source": entry["source"]}
    rows = []
    for i, leaf in enumerate(man["leaves"]):
        numel = math.prod(leaf["sh"])
        if not numel:
            continue
        itemsize = leaf["n"] // numel
        specs = leaf.get("shards") or [{"key": leaf_key(man, i), "global_shape": leaf["sh"],
                                        "offset": [0] * len(leaf["sh"]), "shape": leaf["sh"], "main": True}]
        for spec in specs:
            box = math.prod(spec["shape"])
            flat = spec.get("flat") or [0, box]
            start = spec.get("at", 0) * itemsize
            size = (flat[1] - flat[0]) * itemsize
            frag = {"key": spec["key"], "dtype": leaf["dt"], "itemsize": itemsize, "global_shape": spec["global_shape"],
                    "offset": spec["offset"], "shape": spec["shape"], "flat_lo": flat[0], "flat_hi": flat[1],
                    "main": spec["main"], "replica": spec.get("replica", []), "leaf": i, **where}
            if "o" in leaf:
                rows.append({**frag, "slot_offset": entry["data_off"] + leaf["o"] + start, "nbytes": size,
                             "frag_byte_lo": 0})
                continue
            a, b = max(rep["lo"], leaf["ro"] + start), min(rep["hi"], leaf["ro"] + start + size)
            if a < b:  # this replica's share holds part of the fragment
                rows.append({**frag, "slot_offset": entry["data_off"] + rep["o"] + a - rep["lo"], "nbytes": b - a,
                             "frag_byte_lo": a - leaf["ro"] - start})
    return rows


def leaf_key(manifest: dict, i: int) -> str:
    """The synthetic key under which leaf `i` of this manifest, which carries no shard spec, is catalogued."""
    if "ro" not in manifest["leaves"][i]:
        return f"_rank{manifest['rank']}.leaf{i}"
    coords = manifest.get("topology", {}).get("coords", {})
    group = "".join(f".{k}{v}" for k, v in sorted(coords.items()) if k != "dp")
    return f"_replicated{group}.leaf{i}"


def coverage(table: pa.Table | dict, runs=None) -> list[dict]:
    """Per key: {key, dtype, global_shape, numel, main_rows, rows, hole}; `hole` says which elements the main
    fragments miss or hold twice (None when they cover the tensor exactly). `table`: a catalog table or its
    columns (Table.to_pydict); `runs(i)`: byte_runs of row i, from a reader that keeps them for its reads."""
    cols = table.to_pydict() if isinstance(table, pa.Table) else table
    runs = runs or (lambda i: byte_runs(cols, i))
    by_key: dict[str, list[int]] = {}
    for i, key in enumerate(cols["key"]):
        by_key.setdefault(key, []).append(i)
    out = []
    for key in sorted(by_key):
        idx = by_key[key]
        shapes = {tuple(cols["global_shape"][i]) for i in idx}
        dtypes = {cols["dtype"][i] for i in idx}
        gs = shapes.pop() if len(shapes) == 1 else None
        main = [i for i in idx if cols["main"][i]]
        info = {"key": key, "dtype": ",".join(sorted(dtypes)), "global_shape": list(gs) if gs is not None else None,
                "numel": math.prod(gs) if gs is not None else None, "main_rows": len(main), "rows": len(idx)}
        if gs is None or len(dtypes) > 1:
            info["hole"] = f"fragments disagree on the global shape or dtype ({sorted(shapes)}, {sorted(dtypes)})"
        else:
            info["hole"] = _hole(gs, [runs(i) + (i,) for i in main], cols)
        out.append(info)
    return out


def check(table: pa.Table | dict, runs=None) -> list[dict]:
    """coverage(), raising CatalogHole for the first global tensor the main fragments do not cover exactly."""
    info = coverage(table, runs)
    bad = [c for c in info if c["hole"]]
    if bad:
        more = f" (and {len(bad) - 1} more keys)" if len(bad) > 1 else ""
        raise CatalogHole(f"global tensor {bad[0]['key']!r}: {bad[0]['hole']}{more}; a loader cannot assemble it "
                          f"from this step: restore another step or tier")
    return info


def byte_runs(cols: dict, i: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) in the global tensor's row-major bytes that row `i` holds."""
    gs, off, shape = cols["global_shape"][i], cols["offset"][i], cols["shape"][i]
    flo, fhi = cols["flat_lo"][i], cols["flat_hi"][i]
    itemsize = cols["itemsize"][i]
    starts, lens = element_runs(gs, off, shape, flo, fhi)
    bstarts, blens = starts * itemsize, lens * itemsize
    # This row holds fragment bytes [p, q): cut the fragment's runs (laid end to end) to that window.
    p = cols["frag_byte_lo"][i]
    q = p + cols["nbytes"][i]
    first = np.concatenate(([0], np.cumsum(blens)[:-1]))
    lo, hi = np.maximum(first, p), np.minimum(first + blens, q)
    keep = lo < hi
    return bstarts[keep] + (lo - first)[keep], bstarts[keep] + (hi - first)[keep]


def element_runs(gs, off, shape, flo: int, fhi: int) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous runs (global element start, length) of elements [flo, fhi) of a box, in box order."""
    nd = len(gs)
    if fhi <= flo:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if nd == 0:
        return np.zeros(1, np.int64), np.ones(1, np.int64)
    t = nd - 1
    while t > 0 and shape[t] == gs[t]:  # trailing full dims: a box row spans them contiguously
        t -= 1
    run = shape[t] * math.prod(gs[t + 1:])
    strides = [math.prod(gs[j + 1:]) for j in range(nd)]
    base = sum(o * s for o, s in zip(off, strides))
    rs = np.arange(flo // run, (fhi - 1) // run + 1, dtype=np.int64)
    starts = np.full(len(rs), base, dtype=np.int64)
    if t > 0:
        for j, ix in enumerate(np.unravel_index(rs, shape[:t])):
            starts += ix.astype(np.int64) * strides[j]
    lens = np.full(len(rs), run, dtype=np.int64)
    cut = flo - rs[0] * run
    starts[0] += cut
    lens[0] -= cut
    lens[-1] -= (rs[-1] + 1) * run - fhi
    return starts, lens


def _hole(gs, runs: list, cols: dict) -> str | None:
    numel = math.prod(gs)
    if not runs or not sum(len(r[0]) for r in runs):
        return f"no main fragment holds any of its {numel} elements"
    itemsize = cols["itemsize"][runs[0][2]]
    starts = np.concatenate([r[0] for r in runs])
    ends = np.concatenate([r[1] for r in runs])
    owner = np.concatenate([np.full(len(r[0]), r[2]) for r in runs])
    order = np.argsort(starts, kind="stable")
    starts, ends, owner = starts[order], ends[order], owner[order]
    total = numel * itemsize
    reach = np.maximum.accumulate(ends)
    if starts[0] > 0:
        return _region("missing", 0, starts[0], gs, itemsize)
    gaps = np.nonzero(starts[1:] > reach[:-1])[0]
    overlaps = np.nonzero(starts[1:] < reach[:-1])[0]
    if len(overlaps) and (not len(gaps) or overlaps[0] < gaps[0]):
        j = overlaps[0]
        a, b = starts[j + 1], min(reach[j], ends[j + 1])
        first = owner[:j + 1][np.nonzero(ends[:j + 1] > a)[0][0]]
        return _region(f"held by two main fragments (ranks {cols['rank'][first]} and {cols['rank'][owner[j + 1]]})",
                       a, b, gs, itemsize)
    if len(gaps):
        j = gaps[0]
        return _region("missing", reach[j], starts[j + 1], gs, itemsize)
    if reach[-1] < total:
        return _region("missing", reach[-1], total, gs, itemsize)
    return None


def _region(what: str, a: int, b: int, gs, itemsize: int) -> str:
    ea, eb = int(a) // itemsize, -(-int(b) // itemsize)
    first = tuple(int(x) for x in np.unravel_index(ea, gs)) if gs else ()
    last = tuple(int(x) for x in np.unravel_index(eb - 1, gs)) if gs else ()
    return f"elements [{ea}, {eb}) of shape {tuple(gs)} (index {first} to {last}) are {what}"


def _short(ranks) -> str:
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= 8 else f"{ranks[:8]}... ({len(ranks)})"


def _describe(missing: dict) -> str:
    return "; ".join(f"step {s} lacks ranks {_short(lack)}" if lack else f"step {s} complete"
                     for s, lack in sorted(missing.items(), reverse=True)) or "none"
