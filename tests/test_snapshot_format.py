"""The snapshot format: any training state round-trips exactly through manifest + raw bytes, no pickle."""
import json
import random

import numpy as np
import pytest
import torch

from inmem_ft import Replicated, ShardSpec, Sharded, SnapshotCorrupt, UnsafeType, capture_rng_state, register_safe_class
from inmem_ft.snapshot import flatten, plan, shard_specs, unpack
from inmem_ft.snapshot import segment as seg
from inmem_ft.snapshot.layout import Pieces


def roundtrip(state, dp_rank=0, dp_size=1):
    p = plan(flatten(state), step=3, rank=0, world_size=1, dp_rank=dp_rank, dp_size=dp_size)
    flat = flatten(state)
    data = torch.zeros(p.data_len, dtype=torch.uint8)
    from inmem_ft.capture.copier import Copier

    Copier(None).copy(flat.values, p, data)
    seg.region_hashes(data.numpy(), p.manifest)
    manifest = json.loads(seg.encode_manifest(p.manifest))  # through JSON, as in shared memory
    replicated = None
    if manifest["replicated"]:
        rep = manifest["replicated"]
        replicated = Pieces([(0, data[rep["o"]: rep["o"] + rep["hi"] - rep["lo"]])])
    return unpack(manifest, data, replicated), manifest


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


def test_training_state_roundtrips_exactly():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    random.seed(5)
    state = {
        "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": capture_rng_state(),
        "scalars": [1, -2**70, 0.1, float("inf"), float("nan"), True, None, "s", b"\x00\xff"],
        "tuple": (1, (2, 3)), "np": np.arange(6, dtype=np.int16).reshape(2, 3), "npf": np.float32(1.5),
        "bf16": torch.randn(5, 7).to(torch.bfloat16), "noncontig": torch.randn(4, 6).t(),
        "scalar_t": torch.tensor(3.0), "empty": torch.empty(0, 5), "bool": torch.tensor([True, False]),
        "size": torch.Size([2, 3]), "dtype": torch.float16, "int_keys": {0: "a", 1: {"x": 2}},
    }
    back, _ = roundtrip(state)
    expected = dict(state, noncontig=state["noncontig"].contiguous())
    assert_same(back, expected)
    assert back["model"]._metadata == state["model"]._metadata  # load_state_dict's version info survives
    torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).load_state_dict(back["model"])


def test_tied_tensors_are_stored_once():
    w = torch.randn(100)
    flat = flatten({"a": w, "b": w})
    assert len(flat.leaves) == 1
    # Also inside containers long enough for the bulk path, and across containers.
    big = {f"l{i}": torch.randn(3) for i in range(20)}
    big["l7"] = big["l2"]
    state = {"w": w, "big": big, "again": [w, big["l5"]]}
    assert len(flatten(state).values) == 20
    back, _ = roundtrip(state)
    assert_same(back, state)
    assert back["big"]["l7"] is back["big"]["l2"] and back["again"][0] is back["w"]


@pytest.mark.parametrize("dp_size", [2, 3])
def test_batched_replicated_region_reassembles_from_every_share(dp_size):
    from inmem_ft.capture.copier import Copier

    rep = {f"w{i}": torch.randn(5, 3) for i in range(30)}
    state = {"own": [torch.randn(7) for _ in range(10)],
             "rep": Replicated({**rep, "s": torch.tensor(2.0), "t": torch.tensor(3.0), "b": torch.randn(11)})}
    region = None
    for r in range(dp_size):
        flat = flatten(state)
        p = plan(flat, step=1, rank=r, world_size=dp_size, dp_rank=r, dp_size=dp_size)
        assert p.batches  # runs of same-shape tensors are one copy, also where a share boundary cuts them
        data = torch.zeros(p.data_len, dtype=torch.uint8)
        Copier(None).copy(flat.values, p, data)
        share = p.manifest["replicated"]
        region = torch.zeros(share["total"], dtype=torch.uint8) if region is None else region
        region[share["lo"]: share["hi"]] = data[share["o"]: share["o"] + share["hi"] - share["lo"]]
    back = unpack(json.loads(seg.encode_manifest(p.manifest)), data, Pieces([(0, region)]))
    assert_same(back, {**state, "rep": state["rep"].tree})
    assert all(back["rep"][k].untyped_storage().data_ptr() == region.untyped_storage().data_ptr() for k in rep)


def test_shard_specs_are_recorded():
    shard = torch.arange(6.0).view(2, 3)
    spec = ShardSpec("w", (4, 3), offset=(2, 0), shape=(2, 3), replica=(0, 1), main=False, axis_fragmentations=(2, 1))
    flat = torch.arange(10.0)  # one flat buffer holding pieces of two keys
    pieces = [ShardSpec("a", (3, 2), flat=(2, 6), at=0), ShardSpec("b", (8,), offset=(4,), shape=(4,), at=4)]
    back, manifest = roundtrip({"w": Sharded(shard, spec), "buf": Sharded(flat, pieces)})
    assert torch.equal(back["w"], shard) and torch.equal(back["buf"], flat)
    assert shard_specs(manifest) == {0: [spec], 1: pieces}
    assert manifest["topology"]["framework"] == "pytorch"


@pytest.mark.parametrize("bad", [
    dict(key="w", global_shape=(4,), offset=(2,), shape=(3,)),  # box leaves the tensor
    dict(key="w", global_shape=(4, 2), offset=(0,), shape=(4, 2)),  # ranks differ
    dict(key="w", global_shape=(4,), flat=(2, 9)),  # flat range leaves the box
    dict(key="", global_shape=(4,)),
])
def test_bad_shard_specs_are_refused(bad):
    with pytest.raises(ValueError, match="shard spec"):
        ShardSpec(**bad)


def test_shard_spec_past_the_stored_tensor_is_refused():
    with pytest.raises(ValueError, match="covers elements"):
        Sharded(torch.zeros(4), ShardSpec("w", (8,), offset=(0,), shape=(8,)))


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_replicated_subtree_is_split_evenly(dp_size):
    state = {"own": torch.randn(10), "rep": Replicated({"w": torch.randn(33), "b": torch.randn(7).double()})}
    shares = []
    for r in range(dp_size):
        p = plan(flatten(state), step=1, rank=r, world_size=dp_size, dp_rank=r, dp_size=dp_size)
        rep = p.manifest["replicated"]
        shares.append(rep["hi"] - rep["lo"])
    assert sum(shares) == p.manifest["replicated"]["total"]
    assert max(shares) - min(shares) <= 64


class Plain:
    def __init__(self):
        self.scale, self.history = 2.0, [1, 2]


def test_unregistered_objects_are_refused_and_registered_ones_roundtrip():
    with pytest.raises(UnsafeType, match="register_safe_class"):
        flatten({"x": Plain()})
    register_safe_class(Plain)
    back, _ = roundtrip({"x": Plain()})
    assert vars(back["x"]) == {"scale": 2.0, "history": [1, 2]}


def test_corruption_is_detected_at_every_level():
    state = {"w": torch.randn(1000)}
    p = plan(flatten(state), step=7, rank=0, world_size=1)
    raw = seg.encode_manifest(p.manifest)
    buf = bytearray(seg.slot_size(len(raw), p.data_len))
    header = seg.Header(seg.WRITING, 7, len(raw), seg.data_offset(len(raw)), p.data_len)
    header.write(buf)
    data = torch.frombuffer(buf, dtype=torch.uint8)[header.data_off: header.data_off + p.data_len]
    from inmem_ft.capture.copier import Copier

    Copier(None).copy(flatten(state).values, p, data)
    seg.region_hashes(memoryview(buf)[header.data_off:], p.manifest)
    raw = seg.encode_manifest(p.manifest)
    buf[seg.HEADER_SIZE: seg.HEADER_SIZE + len(raw)] = raw
    with pytest.raises(seg.SnapshotCorrupt, match="never committed"):
        seg.verify(memoryview(buf), "slot")
    header.state, header.manifest_hash = seg.COMMITTED, seg.checksum(raw)
    header.write(buf)
    seg.verify(memoryview(buf), "slot")
    for offset, what in [(header.data_off + 17, "fails its checksum"), (seg.HEADER_SIZE + 3, "manifest"),
                         (10, "header")]:
        bad = bytearray(buf)
        bad[offset] ^= 0x01
        with pytest.raises(seg.SnapshotCorrupt, match=what):
            seg.verify(memoryview(bad), "slot")


def _slot_bytes(manifest: dict, version: int = seg.VERSION) -> bytearray:
    raw = seg.encode_manifest(manifest)
    buf = bytearray(seg.slot_size(len(raw), 0))
    buf[seg.HEADER_SIZE: seg.HEADER_SIZE + len(raw)] = raw
    header = seg.Header(seg.COMMITTED, 3, len(raw), seg.data_offset(len(raw)), 0, seg.checksum(raw))
    body = seg._FIELDS.pack(seg.MAGIC, version, header.state, header.step, seg.HEADER_SIZE, header.manifest_len,
                            header.data_off, header.data_len, header.manifest_hash)
    buf[: len(body) + 8] = body + seg._HASH.pack(seg.checksum(body))
    return buf


def test_unknown_format_versions_are_refused_with_a_clear_error():
    from inmem_ft import UnknownFormat

    manifest = plan(flatten({"w": torch.zeros(2)}), step=3, rank=0, world_size=1).manifest
    seg.read_committed(_slot_bytes(manifest), "slot")  # the current format reads
    with pytest.raises(UnknownFormat, match=r"manifest format 'inmem_ft/9', this inmem_ft reads 'inmem_ft/2'"):
        seg.read_committed(_slot_bytes({**manifest, "format": "inmem_ft/9"}), "slot")
    with pytest.raises(UnknownFormat, match="slot header version 7, this inmem_ft reads version 1"):
        seg.read_committed(_slot_bytes(manifest, version=7), "slot")


@pytest.mark.parametrize("workers", [1, 3])
def test_copy_verified_copies_every_region_and_names_a_corrupted_one(workers):
    from inmem_ft.capture.copier import Copier

    state = {"own": [torch.randn(n) for n in (0, 5, 3_000_000, 70_000, 1)],
             "rep": Replicated({"w": torch.randn(10_000)})}
    p = plan(flatten(state), step=4, rank=1, world_size=2, dp_rank=1, dp_size=2)
    data = torch.zeros(p.data_len, dtype=torch.uint8)
    Copier(None).copy(flatten(state).values, p, data)
    seg.region_hashes(data.numpy(), p.manifest)
    out = seg.copy_verified(data, p.manifest, "slot", 4, workers=workers)
    for start, end, _, _ in seg.regions(p.manifest):
        assert torch.equal(out[start:end], data[start:end])
    leaf = p.manifest["leaves"][3]  # the 70,000-float tensor, whichever worker copies it
    data[leaf["o"] + 4 * 12345] ^= 0x10
    with pytest.raises(SnapshotCorrupt, match=r"step 4 tensor #3 \(float32\[70000\]\) fails its checksum"):
        seg.copy_verified(data, p.manifest, "slot", 4, workers=workers)


def test_transformer_engine_extra_state_roundtrips_as_bytes():
    """TE's `_extra_state` is a uint8 tensor in current releases and an io.BytesIO of torch.save'd FP8 metadata
    in older ones: both come back with the same bytes, the BytesIO at position 0 for TE's own torch.load, and
    nothing of it is unpickled by us."""
    import io

    meta = io.BytesIO()
    torch.save({"scale_fwd": torch.ones(2), "amax_history_fwd": torch.zeros(1, 2)}, meta)
    state = {"layer.self_attention.linear_qkv._extra_state": meta,
             "layer.mlp.linear_fc1._extra_state": torch.arange(16, dtype=torch.uint8)}
    back, _ = roundtrip(state)
    got = back["layer.self_attention.linear_qkv._extra_state"]
    assert type(got) is io.BytesIO and got.tell() == 0 and got.getvalue() == meta.getvalue()
    assert torch.equal(torch.load(got)["scale_fwd"], torch.ones(2))
    assert torch.equal(back["layer.mlp.linear_fc1._extra_state"], torch.arange(16, dtype=torch.uint8))


def test_generators_roundtrip_as_their_state():
    """A torch.Generator (Transformer Engine's graph-safe RNG tracker holds them) is stored as its state tensor
    and comes back a Generator of the same device, in the same state; one met twice is one again."""
    gen = torch.Generator().manual_seed(1234)
    torch.randn(7, generator=gen)  # not at its seed: the state itself travels
    tracker = {"model-parallel-rng": gen, "data-parallel-rng": torch.Generator().manual_seed(5)}
    state = {"pad": torch.ones(3), "rng_tracker_states": tracker, "again": gen}  # leaves inside one buffer
    back, _ = roundtrip(state)
    got = back["rng_tracker_states"]
    assert all(isinstance(g, torch.Generator) and g.device == torch.device("cpu") for g in got.values())
    assert got["model-parallel-rng"] is back["again"]
    for name, original in tracker.items():
        assert torch.equal(torch.randn(5, generator=got[name]), torch.randn(5, generator=original)), name


def test_precision_aware_optimizer_state_roundtrips_bit_exact():
    """Megatron's use_precision_aware_optimizer (Transformer Engine's FusedAdam, absent on CPU: its state as
    megatron-core 0.19.2's distributed optimizer lays it out) keeps exp_avg/exp_avg_sq in bf16, fp16 or fp8
    (uint8 bytes), and with bf16 and store_param_remainders the master weights as int16 remainders beside the
    bf16 parameters. Each comes back in its dtype with every bit (NaN and subnormal patterns included), mixed
    dtypes side by side in one slot."""
    g = torch.Generator().manual_seed(3)

    def bits(n, dtype):  # any bit pattern of `dtype`, not only the values a float draw gives
        return torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)

    bucket = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.bfloat16).bucket_idx_0"
    state = {"model": {"decoder.layers.self_attention.linear_qkv.weight": bits(4096, torch.bfloat16)},
             "optimizer": {f"{bucket}.param": bits(4096, torch.int16),
                           f"{bucket}.exp_avg": bits(4096, torch.bfloat16),
                           f"{bucket}.exp_avg_sq": bits(4096, torch.bfloat16),
                           "fp8_bucket.exp_avg": bits(1000, torch.uint8),
                           "fp16_bucket.exp_avg_sq": bits(999, torch.float16),
                           "step": torch.tensor(7)}}
    back, _ = roundtrip(state)
    for part in ("model", "optimizer"):
        for key, want in state[part].items():
            got = back[part][key]
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), key
