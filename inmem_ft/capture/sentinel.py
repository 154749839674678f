"""The check after a restore: the first steps a restored state trains must look like the steps before it.

Checksums prove the bytes restored are the bytes stored, not that the stored state was good (a state saved
after silent data corruption, or one that blows up, is preserved faithfully). So for the first `steps` steps
after a restore every adapter hands this check each step's loss (and the gradient norm where the framework
computes one): a NaN/Inf, or a loss above a bound learned from the last losses the snapshot recorded before
it, trips it. What a trip does (mark the step bad on every SMP, restart from an older one) is the
Snapshotter's; this module only decides.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

log = logging.getLogger("inmem_ft.capture")

HISTORY = 16  # losses a snapshot keeps of the steps before it: what the bound is learned from
MIN_HISTORY = 4  # fewer recorded losses than this: only NaN/Inf trip (a bound from 1-3 points is noise)
SPREAD = 4.0  # how many standard deviations above the recorded maximum a loss may go
FLOOR = 0.25  # and at least this fraction of the recorded mean: a flat curve has no spread to learn from


@dataclass(frozen=True)
class Trip:
    step: int
    """The training step whose loss (or gradient norm) tripped the check."""
    restored: int
    """The snapshot step the run was restored from: the one that is bad."""
    why: str


def recorded_in(manifest: dict) -> list[float]:
    """The losses a snapshot's `manifest` recorded (its "losses": every tier and the resharding loader carry
    them with the snapshot). One that is not a short list of finite numbers is ignored: without it only NaN/Inf
    trip, and nothing restored depends on it."""
    value = manifest.get("losses", [])
    if isinstance(value, list) and len(value) <= HISTORY and \
            all(type(x) in (int, float) and math.isfinite(x) for x in value):
        return [float(x) for x in value]
    log.warning("restore step=%s event=losses_ignored: the snapshot's recorded losses are not a list of at most %d "
                "finite numbers; the steps after the restore are screened for NaN/Inf only", manifest.get("step"),
                HISTORY)
    return []


def bound(history) -> float | None:
    """The highest loss a restored step may show, learned from the recorded `history`; None: too short."""
    finite = [x for x in map(_scalar, history) if math.isfinite(x)]
    if len(finite) < MIN_HISTORY:
        return None
    mean = sum(finite) / len(finite)
    std = math.sqrt(sum((x - mean) ** 2 for x in finite) / len(finite))
    return max(finite) + max(SPREAD * std, FLOOR * abs(mean))


class Sentinel:
    """Screens the steps after a restore; keeps the recent losses a snapshot records, restored or not."""

    def __init__(self, steps: int):
        self.steps = steps  # how many steps after a restore are screened; 0: none
        self.history: deque = deque(maxlen=HISTORY)
        self._restored: int | None = None
        self._left = 0
        self._bound: float | None = None

    @property
    def armed(self) -> bool:
        return self._left > 0

    def arm(self, restored: int, history) -> None:
        """A restore from step `restored`, whose snapshot recorded `history` (its last losses, oldest first)."""
        self.history.clear()
        self.history.extend(float(x) for x in history)
        self._restored, self._left, self._bound = restored, self.steps, bound(self.history)

    def disarm(self) -> None:
        self._left = 0

    def recorded(self) -> list[float]:
        """The recent finite losses, oldest first: what a snapshot taken now keeps."""
        return [x for x in map(_scalar, self.history) if math.isfinite(x)]

    def observe(self, step: int, loss, grad_norm=None) -> Trip | None:
        """One trained step's loss (a float or a 0-d tensor; None on a rank that has none, e.g. off Megatron's
        last pipeline stage) and gradient norm (or None): a Trip if it is bad. Outside the steps after a restore
        a tensor is only kept (no device sync per step)."""
        if self._left <= 0:
            if loss is not None:
                self.history.append(loss.detach() if hasattr(loss, "detach") else loss)
            return None
        loss = None if loss is None else _scalar(loss)
        trip = None
        if self._left > 0:
            self._left -= 1
            if loss is not None and not math.isfinite(loss):
                trip = f"loss {loss}"
            elif grad_norm is not None and not math.isfinite(norm := _scalar(grad_norm)):
                trip = f"gradient norm {norm}"
            elif loss is not None and self._bound is not None and loss > self._bound:
                trip = (f"loss {loss:.6g} above the bound {self._bound:.6g} learned from the {len(self.history)} "
                        f"losses recorded before the snapshot")
        if trip is not None:
            self.disarm()
            return Trip(step, self._restored, trip)
        if loss is not None:
            self.history.append(loss)
        return None


def _scalar(value) -> float:
    return float(value.item() if hasattr(value, "item") else value)
