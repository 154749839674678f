"""The job id rule: a job id goes into socket paths, shared-memory segment names and record files, so it is
checked once, here, below every layer that names something after it (smp/paths.py, config.py, argtypes.py)."""
from __future__ import annotations

import re

_JOB = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_job(job: str) -> str:
    if not _JOB.match(job or ""):
        raise ValueError(f"job id {job!r} must be 1-64 characters of letters, digits, '_' or '-'")
    return job
