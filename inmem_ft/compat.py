"""The framework releases each adapter was tested against, in one place: the adapters check the installed
release against it at start, and docs render it. An adapter hooks a framework's checkpoint internals (file
sets, state-dict layouts, partitioning), which change between minor releases, so an untested release is refused
rather than risked as a silently wrong restore; patch releases and local builds of a tested one are accepted."""
from __future__ import annotations

import logging
import os

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .errors import ConfigError

# Distribution name -> the releases tested, one range per minor series: from the release make test-compat passed
# (tests/compat/matrix.toml, docs/compatibility.md; tests/test_compat.py keeps them equal to its results) to the
# next minor. The patch releases between two series' tested ones (0.18.0 to 0.18.8, say) were not run: refused.
TESTED = {
    "deepspeed": (">=0.16.9,<0.17", ">=0.17.6,<0.18", ">=0.18.9,<0.19", ">=0.19.8,<0.20"),
    "megatron-core": (">=0.17.1,<0.18", ">=0.18.2,<0.19", ">=0.19.2,<0.20"),
    # The Hugging Face Trainer integration wraps two of the Trainer's private methods (huggingface/trainer.py),
    # which 5.x refactors between minors: one tested minor each (tests/test_huggingface.py).
    "transformers": (">=5.24.0,<5.25",),
    "accelerate": (">=1.15.0,<1.16",),
    # InmemFTStrategy reads two private parts of the Lightning Trainer (lightning/strategy.py): one tested minor
    "lightning": (">=2.6.6,<2.7",),
}
ALLOW_ENV = "INMEM_FT_ALLOW_UNTESTED"
_ALLOW_KEY = '"allow_untested": true in the inmem_ft block'

log = logging.getLogger("inmem_ft.compat")


def is_tested(framework: str, version: str) -> bool:
    """Whether `version` of `framework` is in its tested range. A local label ('0.19.8+abc1234', a source
    build) is the release it was built from; pre-releases and unparsable versions are untested."""
    try:
        public = Version(version).public
    except InvalidVersion:
        return False
    return any(SpecifierSet(series).contains(public) for series in TESTED[framework])


def tested(framework: str) -> str:
    """The tested releases as one line: 'deepspeed>=0.18.9,<0.19 or >=0.19.8,<0.20'."""
    return framework + " or ".join(TESTED[framework])


def requirement(framework: str) -> str:
    """One requirement that holds every tested series (a package's extras cannot say 'or'): from the oldest
    series' floor to the newest's ceiling. The adapters' check is the narrower TESTED."""
    bounds = [s for series in TESTED[framework] for s in SpecifierSet(series)]
    floor = min((s for s in bounds if s.operator == ">="), key=lambda s: Version(s.version))
    ceiling = max((s for s in bounds if s.operator == "<"), key=lambda s: Version(s.version))
    return f"{framework}{floor},{ceiling}"


def allowed_by_env() -> bool:
    return os.environ.get(ALLOW_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def check(framework: str, version: str, allow_untested: bool = False, without: str = "") -> str:
    """Return `version` if tested; otherwise raise ConfigError, one line naming the tested range and the
    opt-in, or, opted in (`allow_untested` or $INMEM_FT_ALLOW_UNTESTED=1), log one warning line and return it.
    `without`: how to train without inmem_ft instead, appended to the error."""
    if is_tested(framework, version):
        return version
    if allow_untested or allowed_by_env():
        log.warning("inmem_ft: %s %s is untested (tested: %s); running anyway because %s is set: check that "
                    "a restore resumes the loss curve", framework, version, tested(framework),
                    _ALLOW_KEY if allow_untested else f"{ALLOW_ENV}=1")
        return version
    newest = f"{framework}{TESTED[framework][-1]}"
    raise ConfigError(f"inmem_ft: {framework} {version} is not supported (tested: {tested(framework)}); install a "
                      f"tested release (pip install '{newest}'), or set {ALLOW_ENV}=1 (or {_ALLOW_KEY}) to run it "
                      f"untested{f', or {without}' if without else ''}")
