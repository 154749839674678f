"""A restore that hands out views (the fast path the adapters use) leaves the framework holding none of the
slots' shared memory: the views are of a copy-on-write mapping, and what torch's optimizer keeps gets pages
of its own."""
import types
import weakref

import pytest
import torch

from conftest import flip_in_largest_region

from inmem_ft import SnapshotConfig, Snapshotter
from inmem_ft.capture.views import PrivateAfterLoad


def trained(seed, width=64):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width // 2), torch.nn.Linear(width // 2, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, width)).pow(2).mean().backward()
        opt.step()
    return model, opt


def saved(job, width=64) -> list[torch.Tensor]:
    """Snapshot a trained model and optimizer as step 1; their tensors, for comparison after a restore."""
    model, opt = trained(0, width)
    with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
        snap.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})
        snap.wait()
    return [t.clone() for t in tensors(model, opt)]


def tensors(model, opt):
    return [*model.parameters(), *model.buffers(),
            *(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))]


def slot_path(job, step: int) -> str:
    from inmem_ft.smp import control, paths
    from inmem_ft.smp.segments import path_of

    slots = control.call(paths.default_socket(job, 0), "list", rank=0)["slots"]
    return path_of(next(s["segment"] for s in slots if s["step"] == step))


def slot_bytes(job, step: int = 1) -> bytes:
    """The bytes of rank 0's slot of `step`, read from the file, not from a mapping of this process."""
    with open(slot_path(job, step), "rb") as f:
        return f.read()


def rewrite_slot(job, step: int = 1) -> None:
    """What the SMP does to a slot once a newer step is complete everywhere: write another snapshot into it."""
    from inmem_ft.snapshot import segment as seg

    with open(slot_path(job, step), "r+b") as f:
        header = seg.Header.read(f.read())
        f.seek(header.data_off)
        f.write(b"\x7f" * header.data_len)


@pytest.mark.parametrize("fresh_optimizer,width", [(False, 64), (True, 64), (False, 2048)],
                         ids=["moments-exist", "no-moments-yet", "moved-in-on-huge-pages"])
def test_kept_views_get_pages_of_their_own_after_the_load(job, smp, fresh_optimizer, width, monkeypatch):
    """The state views a copy-on-write mapping of the slot: what the framework keeps stays where it is, its
    pages become the process's own, writing it leaves the snapshot alone, and rewriting the slot later leaves
    it alone; nothing views the slot's shared mapping. At 2048 wide, the moments' whole pages are copied and
    moved in (pages._move_in_copy), not copied by the kernel a page at a time."""
    from inmem_ft import pages

    moved = []
    move = pages._move_in_copy
    monkeypatch.setattr(pages, "_move_in_copy", lambda a, n: moved.append(n) or move(a, n))
    expected = saved(job, width)
    before = slot_bytes(job)

    model2, opt2 = trained(1, width)
    if fresh_optimizer:
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
        state = snap.restore(views=True)
        cow = snap.private_mappings()
        assert state["model"]["0.weight"].untyped_storage().data_ptr() in cow  # really a view: no copy made
        with PrivateAfterLoad(snap, [opt2], [model2]) as guard:
            model2.load_state_dict(state["model"])
            opt2.load_state_dict(state["optim"])
        assert guard.privatized > 0 and guard.copied == 0  # torch's optimizer keeps the moments it is given
        assert bool(moved) == (width > 64)
        got = tensors(model2, opt2)
        shared = snap.mapped_storages() - cow
        assert not [t for t in got if t.untyped_storage().data_ptr() in shared]
        assert all(torch.equal(a, b) for a, b in zip(got, expected))

        assert slot_bytes(job) == before
        rewrite_slot(job)  # what it kept no longer shares a page with the slot
        assert all(torch.equal(a, b) for a, b in zip(tensors(model2, opt2), expected))
        rewritten = slot_bytes(job)
        for t in got:  # the optimizer's in-place updates do not reach the slot
            t.data.add_(1.0)
        assert slot_bytes(job) == rewritten


def test_a_second_restore_hands_out_the_snapshot_not_what_the_first_restore_trained(job, smp):
    """Every restore maps the slot afresh: what was written through an earlier restore's views (the optimizer
    stepping in them) is not handed out again as the snapshot."""
    expected = saved(job)
    with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
        model2, opt2 = trained(1)
        state = snap.restore(views=True)
        with PrivateAfterLoad(snap, [opt2], [model2]):
            model2.load_state_dict(state["model"])
            opt2.load_state_dict(state["optim"])
        for t in tensors(model2, opt2):
            t.data.add_(1.0)
        model3, opt3 = trained(2)
        state = snap.restore(views=True)
        with PrivateAfterLoad(snap, [opt3], [model3]):
            model3.load_state_dict(state["model"])
            opt3.load_state_dict(state["optim"])
        assert all(torch.equal(a, b) for a, b in zip(tensors(model3, opt3), expected))
        assert all(torch.equal(a, b + 1.0) for a, b in zip(tensors(model2, opt2), expected))


def test_a_private_twin_parts_two_tensors_that_shared_one_view(job, smp):
    """An adapter may let two framework tensors share one restored view for the load (the framework's copy of
    one into the other then finds the bytes in place) and give one of them a twin afterwards: the same bytes
    in a fresh copy-on-write mapping. Each gets pages of its own; neither sees the other's writes or the slot
    being rewritten."""
    expected = saved(job)
    with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
        view = snap.restore(views=True)["model"]["0.weight"]
        holder = types.SimpleNamespace(low=view, high=snap.private_twin(view))
        assert holder.high.data_ptr() != view.data_ptr() and torch.equal(holder.high, view)
        with PrivateAfterLoad(snap, holders=[holder]) as guard:
            pass
        assert guard.privatized == 2 * view.numel() * view.element_size()
        rewrite_slot(job)
        holder.high.add_(1.0)
        assert torch.equal(holder.low, expected[0]) and torch.equal(holder.high, expected[0] + 1.0)
        with pytest.raises(ValueError, match="not a contiguous view"):
            snap.private_twin(torch.ones(3))


def test_pages_become_private_where_the_kernel_refuses_populate_write(job, smp, monkeypatch):
    """Before Linux 5.14 madvise refuses MADV_POPULATE_WRITE: one byte of every page is rewritten instead."""
    from inmem_ft import pages

    expected = saved(job)
    monkeypatch.setattr(pages, "advise", lambda *a: False)
    model2, _ = trained(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
        state = snap.restore(views=True)
        with PrivateAfterLoad(snap, [opt2], [model2]) as guard:
            model2.load_state_dict(state["model"])
            opt2.load_state_dict(state["optim"])
        assert guard.privatized > 0
        rewrite_slot(job)
        assert all(torch.equal(a, b) for a, b in zip(tensors(model2, opt2), expected))


def test_deferred_privatization_waits_for_the_fence(job, smp):
    """With defer, the pages of what the optimizer keeps become its own in the background; the next fence
    (before its first step) waits for that, and a snapshot taken before any step fences first. What the
    adapter displaced (`release`) is let go after that, not during the restore."""
    expected = saved(job)

    model2, _ = trained(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    displaced = torch.ones(1 << 20)
    gone = weakref.ref(displaced)
    with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
        state = snap.restore(views=True)
        with PrivateAfterLoad(snap, [opt2], [model2], defer=True, release=[displaced]) as guard:
            model2.load_state_dict(state["model"])
            opt2.load_state_dict(state["optim"])
        del displaced
        assert guard.privatized > 0
        snap.save(2, {"model": model2.state_dict(), "optim": opt2.state_dict()})  # fences before it copies
        assert gone() is None
        snap.wait()
        rewrite_slot(job, step=1)  # the restored step's slot, as once a newer step is complete everywhere
        got = tensors(model2, opt2)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_deferred_checks_stop_every_later_fence_on_a_flipped_byte(job, smp):
    """With defer_checks the large regions are checked behind the load: a byte flipped in one is not seen by
    the restore, but the next fence raises (and every one after it, and a snapshot never copies that state);
    the SMP discards the slot, so a restart restores the older step."""
    from inmem_ft.capture.verdict import SMALL, RestoreCorrupt
    from inmem_ft.smp import control, paths

    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)  # 256 KiB of weights: checked in the background
    states = {}
    with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
        for step in (1, 2):
            model.weight.data.add_(1.0)
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
            snap.save(step, {"model": model.state_dict()})
        snap.wait()
    newest = control.call(paths.default_socket(job, 0), "list", rank=0)["slots"][0]
    assert newest["step"] == 2
    assert flip_in_largest_region(newest["segment"]) >= SMALL

    with pytest.raises(RestoreCorrupt, match=r"step 2, restored from memory, failed its checksums.*Nothing was lost"):
        with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
            state = snap.restore(views=True, defer_checks=True)
            assert snap.last_restore.step == 2  # handed over before the large regions were checked
            target = torch.nn.Linear(256, 256)
            with PrivateAfterLoad(snap, [], [target], defer=True):
                target.load_state_dict(state["model"])
            with pytest.raises(RestoreCorrupt):
                snap.fence()
            snap.save(3, {"model": target.state_dict()})  # raises again: never a snapshot of unverified state
    assert [s["step"] for s in control.call(paths.default_socket(job, 0), "list", rank=0)["slots"]] == [1]

    with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:  # the restart
        state = snap.restore(views=True, defer_checks=True)
        assert snap.last_restore.step == 1
        target = torch.nn.Linear(256, 256)
        with PrivateAfterLoad(snap, [], [target], defer=True):
            target.load_state_dict(state["model"])
        snap.fence()
        assert snap.last_restore.phases["verify_background"] >= 0
        assert all(torch.equal(a, states[1][k]) for k, a in target.state_dict().items())
