"""A restore that hands out views of shared memory (the fast path the adapters use) leaves the framework
holding none of them: what torch's optimizer keeps is copied into the moments it already had."""
import pytest
import torch

from conftest import flip_in_largest_region

from inmem_ft import SnapshotConfig, Snapshotter
from inmem_ft.capture.views import PrivateAfterLoad


def trained(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 64)).pow(2).mean().backward()
        opt.step()
    return model, opt


def saved(job) -> list[torch.Tensor]:
    """Snapshot a trained model and optimizer as step 1; their tensors, for comparison after a restore."""
    model, opt = trained(0)
    with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
        snap.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})
        snap.wait()
    return [t.clone() for t in tensors(model, opt)]


def tensors(model, opt):
    return [*model.parameters(), *model.buffers(),
            *(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))]


@pytest.mark.parametrize("fresh_optimizer", [False, True], ids=["moments-exist", "no-moments-yet"])
def test_views_are_copied_out_of_shared_memory_after_the_load(job, smp, fresh_optimizer):
    expected = saved(job)

    model2, opt2 = trained(1)
    if fresh_optimizer:
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    moments = [v for s in opt2.state.values() for v in s.values()]
    with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
        state = snap.restore(views=True)
        bases = snap.mapped_storages()
        assert state["model"]["0.weight"].untyped_storage().data_ptr() in bases  # really a view: no copy made
        with PrivateAfterLoad(snap, [opt2], [model2]) as guard:
            model2.load_state_dict(state["model"])
            opt2.load_state_dict(state["optim"])
        assert guard.copied > 0
        got = tensors(model2, opt2)
        assert not [t for t in got if t.untyped_storage().data_ptr() in bases]
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        if not fresh_optimizer:  # copied into the moments it had, not into fresh memory
            after = [v for s in opt2.state.values() for v in s.values()]
            assert all(a is b for a, b in zip(after, moments))


def test_deferred_copy_out_waits_for_the_fence(job, smp):
    """With defer, the optimizer keeps its views until the next fence (before its first step), then holds
    private copies with the snapshot's values; a snapshot taken before any step fences first."""
    expected = saved(job)

    model2, _ = trained(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
        state = snap.restore(views=True)
        bases = snap.mapped_storages()
        with PrivateAfterLoad(snap, [opt2], [model2], defer=True) as guard:
            model2.load_state_dict(state["model"])
            opt2.load_state_dict(state["optim"])
        assert guard.copied > 0
        moments = [v for s in opt2.state.values() for v in s.values() if v.numel() > 1]
        assert all(v.untyped_storage().data_ptr() in bases for v in moments)  # still views: copy in background
        snap.save(2, {"model": model2.state_dict(), "optim": opt2.state_dict()})  # fences before it copies
        got = tensors(model2, opt2)
        assert not [t for t in got if t.untyped_storage().data_ptr() in bases]
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        snap.wait()


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
