"""Issue 40, part 1: the check after a restore. Unit tests of the check itself, and one plain-Snapshotter run against
a real SMP: a restored state that goes bad marks its step bad (kept across an SMP restart, shown in status), the
next restore comes from the older good step, and a second trip in a row stops the job naming both steps."""
import math

import pytest
import torch

from inmem_ft.capture import sentinel
from inmem_ft.capture.sentinel import Sentinel
from inmem_ft.capture.snapshotter import Snapshotter
from inmem_ft.config import InmemFTBlock, SnapshotConfig
from inmem_ft.errors import ConfigError, RestoredStateBad
from inmem_ft.smp import control


def test_nan_inf_and_a_spike_trip_within_the_window_only():
    s = Sentinel(steps=3)
    s.arm(10, [2.0, 1.9, 1.8, 1.85, 1.7])
    assert s.observe(11, 1.75) is None
    trip = s.observe(12, float("nan"))
    assert (trip.step, trip.restored, trip.why) == (12, 10, "loss nan")
    assert not s.armed and s.observe(13, float("inf")) is None  # tripped once: the Snapshotter acts on it
    s.arm(10, [2.0, 1.9, 1.8, 1.85])
    assert "gradient norm inf" == s.observe(11, 1.8, torch.tensor(float("inf"))).why
    s.arm(10, [2.0, 1.9, 1.8, 1.85])
    spike = s.observe(11, torch.tensor(9.0))
    assert spike is not None and spike.why.startswith("loss 9 above the bound")
    s.arm(10, [2.0, 1.9, 1.8, 1.85])
    for step in (11, 12, 13):
        assert s.observe(step, 1.8) is None
    assert not s.armed and s.observe(14, 9.0) is None  # past the window: not screened


def test_the_bound_needs_enough_history_and_tolerates_a_flat_curve():
    assert sentinel.bound([1.0, 2.0]) is None  # too short: only NaN/Inf trip
    assert sentinel.bound([1.0] * 8) == pytest.approx(1.0 + sentinel.FLOOR)
    assert sentinel.bound([1.0, math.nan, 1.0, 1.0, 1.0]) == pytest.approx(1.25)
    s = Sentinel(steps=20)
    for x in range(40):
        s.observe(x, torch.tensor(float(x)))
    assert s.recorded() == [float(x) for x in range(40 - sentinel.HISTORY, 40)]


@pytest.mark.parametrize("key", ["sentinel_steps", "fingerprint_every"])
@pytest.mark.parametrize("value", [-1, 1.5, True, "20"])
def test_trust_settings_are_validated_at_the_edge(key, value):
    with pytest.raises(ConfigError, match=f"'{key}' = .*must be an integer >= 0"):
        SnapshotConfig(**{key: value})
    with pytest.raises(ConfigError, match=f"'{key}'"):
        InmemFTBlock.from_dict({key: value})
    assert getattr(InmemFTBlock.from_dict({key: 0}).snapshot_config(), key) == 0


def _train(snap, weights, start, end, losses):
    for step in range(start, end + 1):
        weights += 1.0
        snap.observe(step, torch.tensor(losses(step)))
        snap.maybe_save(step, lambda: {"w": weights.clone()})
        snap.wait()


def test_a_restored_step_that_goes_bad_is_never_restored_again(smp, job):
    socket_path, _ = smp
    config = SnapshotConfig(job=job, interval=2, sentinel_steps=5)
    with Snapshotter(config) as snap:
        _train(snap, torch.zeros(4), 1, 6, lambda s: 3.0 - 0.1 * s)
    # Restored from step 6 (its snapshot recorded the five losses before it): NaN at the second step after.
    with Snapshotter(config) as snap:
        state = snap.restore()
        assert snap.last_restore.step == 6 and torch.equal(state["w"], torch.full((4,), 6.0))
        assert snap.last_restore.losses == pytest.approx([3.0 - 0.1 * s for s in range(1, 7)])
        snap.observe(7, torch.tensor(2.3))
        with pytest.raises(RestoredStateBad, match=r"step 8 after the restore from step 6: loss nan: step 6 is marked "
                                                   r"bad on every SMP") as e:
            snap.observe(8, torch.tensor(float("nan")))
        assert not e.value.fatal
    status = control.call(socket_path, "status")
    assert status["bad_steps"] == [6] and status["counters"]["sentinel_trips"] == 1
    # The record survives the SMP's restart; the next restore takes step 4, whose loss spikes: the job stops.
    control.stop(socket_path)
    control.start(job, 0, 64 << 20)
    assert control.call(socket_path, "status")["bad_steps"] == [6]
    with Snapshotter(config) as snap:
        state = snap.restore()
        assert snap.last_restore.step == 4 and torch.equal(state["w"], torch.full((4,), 4.0))
        with pytest.raises(RestoredStateBad, match=r"the state restored from step 6 and then the one from step 4 both "
                                                   r"went bad \(step 5 after the restore from step 4: loss 50 above "
                                                   r"the bound") as e:
            snap.observe(5, torch.tensor(50.0))
        assert e.value.fatal
    assert control.call(socket_path, "status")["bad_steps"] == [4, 6]
