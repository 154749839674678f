"""Snapshots reuse their layout while the state keeps its structure, and never commit bytes laid out for
another one: every kind of structural change is either laid out afresh at once or declines that one
snapshot (and the next is laid out afresh). A real SMP; every committed step restores exactly."""
import numpy as np
import pytest
import torch

from inmem_ft import Replicated, ShardSpec, Sharded, SnapshotConfig, Snapshotter
from inmem_ft.smp import control, paths
from inmem_ft.snapshot import segment as seg

N = 12  # enough tensors of one shape for the bulk paths


def base(step):
    g = torch.Generator().manual_seed(step)
    return {"layers": {f"l{i}.w": torch.randn(6, 4, generator=g) for i in range(N)},
            "bias": [torch.randn(5, generator=g) for _ in range(N)], "steps": torch.tensor(step), "step": step,
            "lr": 0.1 / (step + 1), "np": np.arange(step, step + 3)}


def same(a, b):
    """`a` (restored) equals `b` (the state saved, markers and all) exactly."""
    if isinstance(b, Replicated):
        b = b.tree
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def restored(job):
    with Snapshotter(SnapshotConfig(job=job)) as snap:
        return snap.restore()


@pytest.fixture
def smp(job):
    control.start(job, 0, 64 << 20)
    yield job
    control.stop(paths.default_socket(job, 0), wipe=True)


def test_unchanged_structure_reuses_the_layout_and_every_step_restores_exactly(smp):
    snap = Snapshotter(SnapshotConfig(job=smp, interval=1))
    for step in range(1, 5):
        snap.save(step, base(step), overlap=step % 2 == 0)
        snap.wait()
    snap.close()
    assert snap.metrics.planned == 1 and snap.metrics.snapshots == 4 and snap.metrics.stale == 0
    assert same(restored(smp), base(4))


def changes():
    """(name, how the state changes, what the changed snapshot does: 'reused' layout, laid out 'afresh' at
    once, or 'declined' (not committed; the next one is laid out afresh)). A function of overlap."""
    def grown(s):  # a new tensor: another structure
        return {**s, "extra": torch.ones(3)}

    def reshaped(s):  # same count, a trailing shape differs: the batched copy refuses it
        s["layers"]["l3.w"] = torch.arange(24.0).view(4, 6)
        return s

    def lengthened(s):  # same count, one tensor longer: the batch no longer fits, and the copy says so
        s["layers"]["l3.w"] = torch.arange(32.0).view(8, 4)
        return s

    def shifted(s):  # same count and bytes, rows moved from one tensor to another: caught before commit
        s["layers"]["l3.w"], s["layers"]["l4.w"] = torch.arange(20.0).view(5, 4), torch.arange(28.0).view(7, 4)
        return s

    def retyped(s):  # same count and shape, another dtype: caught before commit
        s["bias"][2] = torch.arange(5, dtype=torch.int32)
        return s

    def moved_marker(s):  # same tensors, some now replicated
        return {**s, "bias": Replicated(s["bias"])}

    def tied(s):  # same dtypes and shapes in the same order, one of the tensors stored under two keys
        s["layers"]["l1.w"] = s["layers"]["l0.w"]
        s["layers"]["l12.w"] = torch.zeros(6, 4)
        return s

    def long_string(s):  # same tensors, a manifest far longer than the room reserved for it
        return {**s, "step": "x" * (200 << 10)}

    return [("grown", grown, lambda overlap: "afresh"),
            ("reshaped", reshaped, lambda overlap: "declined" if overlap else "afresh"),
            ("lengthened", lengthened, lambda overlap: "declined" if overlap else "afresh"),
            ("shifted", shifted, lambda overlap: "declined"), ("retyped", retyped, lambda overlap: "declined"),
            ("moved_marker", moved_marker, lambda overlap: "afresh"), ("tied", tied, lambda overlap: "reused"),
            ("long_string", long_string, lambda overlap: "declined")]


CASES = [(*c, False) for c in changes()] + [(*c, True) for c in changes() if c[0] in ("reshaped", "shifted")]


@pytest.mark.parametrize("name,change,outcome,overlap", CASES,
                         ids=[c[0] + ("-overlap" if c[3] else "") for c in CASES])
def test_a_structural_change_never_commits_a_stale_layout(smp, name, change, outcome, overlap):
    """With overlap the copy runs after save() returned: a change the copy refuses declines the snapshot."""
    outcome = outcome(overlap)
    snap = Snapshotter(SnapshotConfig(job=smp, interval=1))
    snap.save(1, base(1), overlap=overlap)
    snap.wait()
    snap.save(2, change(base(2)), overlap=overlap)
    snap.wait()
    if outcome == "declined":
        # Laid out for the old structure: not committed, and step 1 stays the newest.
        assert snap.metrics.stale == 1 and snap.metrics.failures == 0
        assert same(restored(smp), base(1))
        snap.save(3, change(base(3)), overlap=overlap)
        snap.wait()
    snap.close()
    step = 3 if outcome == "declined" else 2
    assert snap.metrics.planned == (1 if outcome == "reused" else 2)
    assert snap.metrics.stale == (outcome == "declined") and snap.metrics.snapshots == 2
    back = restored(smp)
    assert same(back, change(base(step)))
    if name == "tied":
        assert back["layers"]["l1.w"] is back["layers"]["l0.w"]


def test_new_shard_specs_under_a_reused_layout_are_recorded(smp):
    def state(key):
        t = {f"w{i}": Sharded(torch.full((4,), float(i)), ShardSpec(f"{key}{i}", (8,), offset=(0,), shape=(4,)))
             for i in range(N)}
        return {"model": t}

    snap = Snapshotter(SnapshotConfig(job=smp, interval=1))
    for step, key in ((1, "a"), (2, "a"), (3, "b"), (4, "b")):
        snap.save(step, state(key))
        snap.wait()
    snap.close()
    assert snap.metrics.planned == 1 and snap.metrics.snapshots == 4
    slot = max(control.call(paths.default_socket(smp, 0), "list", rank=0)["slots"], key=lambda s: s["step"])
    from inmem_ft.smp.segments import Segment

    segment = Segment(slot["segment"])
    try:
        _, manifest = seg.read_committed(segment.buf, "slot")
    finally:
        segment.close()
    assert manifest["step"] == 4
    assert [e["shards"][0]["key"] for e in manifest["leaves"]] == [f"b{i}" for i in range(N)]
