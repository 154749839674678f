"""The CUDA capture path: side-stream copies behind an event of the training stream, straight into the slot's
registered mapping; restores back onto the device. Runs only where there is a GPU (CI has none; the device
machine runs it)."""
import pytest
import torch

from inmem_ft import BudgetExceeded, SnapshotConfig, Snapshotter, capture_rng_state
from inmem_ft.smp import control, paths

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def snap(job):
    control.start(job, 0, 2 << 30)
    s = Snapshotter(SnapshotConfig(job=job))
    yield s
    s.close()
    control.stop(paths.default_socket(job, 0), wipe=True)


def test_cuda_state_roundtrips_and_later_kernels_cannot_leak_in(snap):
    torch.manual_seed(0)
    w = torch.randn(32 << 20, device="cuda")  # 128 MiB: the copy takes long enough to race with
    b = torch.randn(1000, device="cuda").to(torch.bfloat16)
    expected_w, expected_b = w.cpu(), b.cpu()
    snap.save(1, {"w": w, "b": b, "host": torch.arange(5), "rng": capture_rng_state()})
    w.mul_(2)  # the next optimizer step, on the training stream, right after save() returned
    b.zero_()
    snap.wait()
    back = snap.restore()
    assert torch.equal(back["w"], expected_w) and torch.equal(back["b"], expected_b)
    assert torch.equal(back["host"], torch.arange(5)) and "cuda" in back["rng"]


def test_overlapped_snapshot_fences_before_the_state_changes(snap):
    torch.manual_seed(1)
    w = torch.randn(64 << 20, device="cuda")  # 256 MiB
    expected = w.cpu()
    snap.save(1, {"w": w}, overlap=True)
    y = (w * 3).sum()  # forward-like reads overlap the copy
    snap.fence()  # what the optimizer-step pre-hook does
    w.add_(y)  # the update, queued behind the copy on the training stream
    snap.wait()
    assert torch.equal(snap.restore()["w"], expected)


def test_staging_budget_too_small_fails_at_first_snapshot(job, snap):
    tight = Snapshotter(SnapshotConfig(job=job, staging_budget="1MiB"))
    with pytest.raises(BudgetExceeded, match="staging_budget"):
        tight.save(1, {"w": torch.randn(1 << 20, device="cuda")})


def test_save_returns_before_the_copy_is_done_and_the_copy_ends_before_the_next_step(snap):
    w = torch.randn(256 << 20, device="cuda")  # 1 GiB: many milliseconds over PCIe or NVLink-C2C
    expected = w.cpu()
    snap.save(1, {"w": w}, overlap=True)
    snap.wait()  # the first snapshot registers its slot; the second is the one timed
    snap.save(2, {"w": w}, overlap=True)
    snap._copied.wait()  # the commit thread queued the copy
    done = list(snap._fence_work.done.values())[0]
    assert not done.query(), "the copy of 1 GiB was already done: save() waited for it"
    snap.fence()
    w.zero_()  # queued behind the copy on the training stream
    snap.wait()
    assert torch.equal(snap.restore()["w"], expected)


def test_many_small_device_tensors_are_gathered_and_restore_onto_the_device_bit_exact(snap):
    torch.manual_seed(2)
    small = {f"t{i}": torch.randn(7 + i % 5, device="cuda").to(torch.bfloat16 if i % 2 else torch.float32)
             for i in range(10_000)}
    expected = {k: v.cpu() for k, v in small.items()}
    snap.save(1, small)
    for v in small.values():
        v.add_(1)  # the next step, right after save() returned
    snap.wait()
    back = snap.restore(to_device=True)
    assert all(back[k].is_cuda and torch.equal(back[k].cpu(), expected[k]) for k in expected)


def test_a_tensor_moved_to_the_device_under_a_reused_layout_is_restored_where_it_now_lives(snap):
    big = torch.randn(1 << 20)  # large: copied alone, so the move cannot make a batched copy raise
    snap.save(1, {"w": big, "i": torch.arange(3)})
    snap.wait()
    moved = big.cuda()
    snap.save(2, {"w": moved, "i": torch.arange(3)})  # the plan of step 1 is tried, then refused at commit
    snap.wait()
    assert snap.metrics.stale == 1
    snap.save(3, {"w": moved, "i": torch.arange(3)})  # laid out afresh: its entry says "on cuda"
    snap.wait()
    back = snap.restore(to_device=True)
    assert back["w"].is_cuda and torch.equal(back["w"].cpu(), big)
