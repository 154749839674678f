"""Exceptions a user can act on. Every message says what is wrong and what to do next."""


class InmemFTError(RuntimeError):
    """Base class of every error inmem_ft raises on purpose."""


class ConfigError(InmemFTError, ValueError):
    """A configuration value is invalid."""


class SMPUnavailable(InmemFTError):
    """The node's snapshot management process cannot be reached."""


class BudgetExceeded(InmemFTError):
    """A snapshot does not fit the configured memory budget."""


class SnapshotCorrupt(InmemFTError):
    """A snapshot failed its checksums or is torn; it is never loaded."""


class SnapshotLost(InmemFTError):
    """More nodes of an erasure-coding group were lost than its parity tolerates: the next tier must serve."""


class LayoutMismatch(InmemFTError):
    """The stored snapshot was taken by a job of another shape."""


class LayoutChanged(LayoutMismatch):
    """The newest snapshots in memory were taken on another parallel layout than this job's, and this restore
    does not reshard them (`"reshard": "never"`, or the plain Snapshotter API); `step` is the newest such
    step. Nothing was discarded."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class UnsafeType(InmemFTError, TypeError):
    """A value in the state cannot be stored without pickle."""


class UnknownFormat(InmemFTError):
    """A snapshot was written in a format version this inmem_ft does not read; it is kept, never loaded."""


class StepIncomplete(InmemFTError):
    """No node holds the asked step (or any step) for every rank of the job."""


class CatalogHole(InmemFTError):
    """The main fragments of a global tensor miss some of its elements or hold some twice."""


class ForeignSegment(InmemFTError):
    """A shared-memory file (or the private directory) that this user's SMP did not create: another owner,
    loose permissions, a link. It is refused and left in place, never adopted."""


STOP_EXIT = 65  # a rank's exit code that asks its supervisor not to restart (sysexits' EX_DATAERR: bad data)
# A rank's exit code that asks `inmem-ft run` to restart only once a node joins (sysexits' EX_TEMPFAIL): the job
# cannot go on at this node count (on_shrink "refuse": the global batch does not divide), it can at more.
SPARE_EXIT = 75


class RestoredStateBad(InmemFTError):
    """The steps after a restore went bad (NaN/Inf, or a loss spike): the restored step is marked bad on every
    SMP and never restored again; restart the job (a supervisor does) and it resumes from an older step.
    `fatal`: two trips in a row, the job stops instead: the rank exits with STOP_EXIT, which `inmem-ft run`
    does not restart (a restart would only walk back to a third, older step)."""

    def __init__(self, message: str, step: int, fatal: bool = False):
        super().__init__(message)
        self.step, self.fatal = step, fatal
        self.exit_code = STOP_EXIT if fatal else 1


class ReplicasDisagree(InmemFTError):
    """Data-parallel replicas hold different bytes of what must be the same (capture/fingerprint.py): the
    snapshot `step` is marked bad on every SMP and never restored; restart the job (a supervisor does) and it
    resumes from the newest older good step."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step
