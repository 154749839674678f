"""The CUDA capture path: side-stream copies into pinned staging, then shared memory, off the training path.
Runs only where there is a GPU (CI has none; the device machine runs it)."""
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
