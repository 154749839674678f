"""A restore that hands out views of shared memory (the fast path the adapters use) leaves the framework
holding none of them: what torch's optimizer keeps is copied into the moments it already had."""
import pytest
import torch

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
