"""Every INMEM_FT_* variable the package or its launch scripts use is in the one registry the reference is
rendered from (inmem_ft/envvars.py), and the registry lists none the code no longer uses."""
import re
from pathlib import Path

from inmem_ft.envvars import VARIABLES

PACKAGE = Path(__file__).resolve().parent.parent / "inmem_ft"
NAME = re.compile(r"\bINMEM_FT_[A-Z0-9_]*[A-Z0-9]")


def used_in_code() -> dict[str, set[str]]:
    used: dict[str, set[str]] = {}
    # The launch scripts live in the repository's launch/ (inmem_ft/launch_scripts links there; rglob skips links).
    for path in [*PACKAGE.rglob("*"), *(PACKAGE.parent / "launch").rglob("*")]:
        if path.suffix in (".py", ".sh", ".sbatch") and path.name != "envvars.py":
            for name in NAME.findall(path.read_text()):
                used.setdefault(name, set()).add(str(path.relative_to(PACKAGE.parent)))
    return used


def test_every_variable_the_code_uses_is_documented():
    documented = {v.name for v in VARIABLES}
    missing = {name: sorted(files) for name, files in used_in_code().items() if name not in documented}
    assert not missing, f"add these to inmem_ft/envvars.py (used in: {missing})"


def test_the_registry_lists_only_variables_in_use_once_each():
    names = [v.name for v in VARIABLES]
    assert len(names) == len(set(names)), "a variable is listed twice in inmem_ft/envvars.py"
    stale = set(names) - set(used_in_code())
    assert not stale, f"inmem_ft/envvars.py lists variables no code uses: {sorted(stale)}"
    assert all(v.text and v.default and v.unit and v.read_by for v in VARIABLES)
