"""The global batch across a change of the data-parallel size (a shrink onto fewer nodes, a grow back).

global batch = micro batch x gradient accumulation (GA) x DP. The micro batch is what a device holds, so it
stays; GA covers the data-parallel ranks that came or went. Where the global batch does not divide by micro x DP,
the job's `on_shrink` says what to do: "keep" trains with the nearest GA there is (the global batch changes, and
the line says to what), "refuse" waits for a node to join instead, for runs whose global batch must not change:
the rank exits with SPARE_EXIT, on which `inmem-ft run` restarts the ranks only once a node (the lost one back,
or a spare) waits to join, saying so every SPARE_SAY_S (agent/sparewait.py); under another supervisor it is a
failed rank.

Framework-free; the adapters put the result into their framework's config (integrations/deepspeed/batch.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import SPARE_EXIT, ConfigError

ON_SHRINK = ("keep", "refuse")


class GlobalBatchRefused(ConfigError):
    """on_shrink is "refuse" and the global batch does not divide by micro x DP: the job waits for a node."""

    exit_code = SPARE_EXIT


@dataclass(frozen=True)
class Batch:
    micro: int
    accumulation: int
    dp: int
    asked: int  # the global batch the job was given
    on_shrink: str = "keep"

    @property
    def size(self) -> int:
        return self.micro * self.accumulation * self.dp

    @property
    def kept(self) -> bool:
        return self.size == self.asked

    def note(self) -> str:
        """One line for a global batch that could not be kept; empty when it was."""
        if self.kept:
            return ""
        return (f"inmem_ft: global batch {self.asked} does not divide by micro batch {self.micro} x {self.dp} "
                f"data-parallel ranks: on_shrink \"keep\" trains with the nearest gradient accumulation, "
                f"{self.accumulation}, a global batch of {self.size} (set on_shrink \"refuse\" to stop instead)")


def for_dp(global_batch: int, micro: int, dp: int, on_shrink: str = "keep") -> Batch:
    """The gradient accumulation that keeps `global_batch` on `dp` data-parallel ranks of `micro` each, else what
    `on_shrink` says (module docstring). Raises GlobalBatchRefused, or ConfigError for sizes that are no counts."""
    for name, value in (("global batch", global_batch), ("micro batch", micro), ("data-parallel size", dp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"inmem_ft: the {name} {value!r} must be a whole number >= 1")
    if on_shrink not in ON_SHRINK:
        raise ConfigError(f"inmem_ft config: 'on_shrink' = {on_shrink!r}: must be one of {ON_SHRINK}")
    per_step = micro * dp
    if global_batch % per_step == 0:
        return Batch(micro, global_batch // per_step, dp, global_batch, on_shrink)
    if on_shrink == "refuse":
        raise GlobalBatchRefused(
            f"inmem_ft: global batch {global_batch} does not divide by micro batch {micro} x {dp} data-parallel "
            f"ranks, and on_shrink is \"refuse\": the job waits for a node to join rather than train on another "
            f"global batch (inmem-ft run restarts it once one does; set on_shrink \"keep\" to go on instead)")
    return Batch(micro, max(1, round(global_batch / per_step)), dp, global_batch, on_shrink)
