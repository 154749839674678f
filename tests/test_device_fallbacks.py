"""What a host without an accelerator (CI) shows of inmem_ft/device.py: host and meta tensors never take the
device path, host memory is not registered, and a snapshot taken on a GPU restores into host memory here (its
leaves are marked with where they lived; `to_device` finds no such device and leaves them on the host)."""
import pytest
import torch

from inmem_ft import device
from inmem_ft.snapshot import layout, pack
from inmem_ft.snapshot.tree import flatten

pytestmark = pytest.mark.skipif(torch.accelerator.is_available(), reason="the host-only fallbacks")


def test_host_and_meta_tensors_are_not_accelerated():
    assert not device.accelerated(torch.zeros(2)) and not device.accelerated(torch.empty(2, device="meta"))
    assert device.kind(torch.zeros(2)) is None and not device.accelerated(3)


def test_without_a_device_nothing_is_registered_and_no_rng_state_is_added():
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    assert device.register(buf.data_ptr(), buf.numel()) is None
    assert device.rng_states() == {}


def test_a_gpu_snapshot_restores_into_host_memory_on_a_host_without_the_gpu():
    state = {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "n": torch.tensor(7)}
    plan = layout.plan(flatten(state), step=1, rank=0, world_size=1)
    assert not any("dv" in e for e in plan.manifest["leaves"])  # host leaves are not marked
    data = torch.zeros(plan.data_len, dtype=torch.uint8)
    pack.write(list(flatten(state).values), plan.copies, plan.batches, data)
    for entry in plan.manifest["leaves"]:
        entry["dv"] = "cuda"  # as a GPU job's manifest says it
    upload = device.Upload()
    back = layout.unpack(plan.manifest, data, owned=True, upload=upload)
    upload.wait()
    assert back["w"].device.type == "cpu" and torch.equal(back["w"], state["w"]) and int(back["n"]) == 7
