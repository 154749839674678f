"""Issue 26 item 4: the wheel built from this checkout is a working install on its own, away from the
repository: its version, the `inmem-ft` command, the launch scripts and example configs it prints, py.typed
(the scripts and configs live once, in the repository's launch/ and configs/, linked into the package).
The wheel is built without build isolation (the venv's setuptools) and installed without dependencies into a
folder of its own, on the venv's python (whose dependencies it uses), from a directory with no checkout."""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

import inmem_ft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = ["inmem_ft/py.typed", "inmem_ft/launch_scripts/torchrun_inmem.sh",
           "inmem_ft/launch_scripts/slurm_inmem.sbatch", "inmem_ft/configs/deepspeed_zero2.json",
           "inmem_ft/configs/megatron_gpt.json"]


def run(*argv, cwd, env=None):
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_wheel_installs_and_works_without_the_checkout():
    # Not under tmp_path, which conftest scans for crash marks: the sources quote them (capture/agreement.py).
    with tempfile.TemporaryDirectory(prefix="inmem_ft-install-") as tmp:
        check_install(pathlib.Path(tmp))


def check_install(tmp_path):
    # A copy: setuptools writes build/ and *.egg-info beside the sources it builds.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    # The links inside the package (inmem_ft/launch_scripts -> ../launch, inmem_ft/configs -> ../configs) stay
    # links, so that what is checked is setuptools resolving them into the wheel.
    for name in ("inmem_ft", "launch", "configs"):
        shutil.copytree(os.path.join(ROOT, name), src / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    assert (src / "inmem_ft" / "launch_scripts").is_symlink() and (src / "inmem_ft" / "configs").is_symlink()
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
        str(src), cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("inmem_ft-*.whl")
    assert wheel.name.startswith(f"inmem_ft-{inmem_ft.__version__}-")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert set(SHIPPED) <= names, set(SHIPPED) - names
        assert not any(n.startswith("tests/") for n in names)
        mode = z.getinfo("inmem_ft/launch_scripts/torchrun_inmem.sh").external_attr >> 16
        assert mode & 0o100, oct(mode)

    site = tmp_path / "site"
    run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel), cwd=tmp_path)
    away = tmp_path / "away"
    away.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = run(sys.executable, "-c", "import inmem_ft, importlib.metadata as m; "
                "print(inmem_ft.__file__, inmem_ft.__version__, m.version('inmem_ft'))", cwd=away, env=env).split()
    assert where[0].startswith(str(site)) and where[1:] == [inmem_ft.__version__] * 2
    assert run(str(site / "bin" / "inmem-ft"), "--version", cwd=away, env=env) == f"inmem-ft {inmem_ft.__version__}\n"
    script = run(str(site / "bin" / "inmem-ft"), "launch-script", "slurm", cwd=away, env=env)
    assert script.startswith("#!/usr/bin/env bash") and "#SBATCH" in script
    torchrun = run(sys.executable, "-m", "inmem_ft", "launch-script", "--path", "torchrun", cwd=away, env=env).strip()
    assert torchrun.startswith(str(site)) and os.access(torchrun, os.X_OK)
    assert '"inmem_ft"' in run(sys.executable, "-m", "inmem_ft", "example-config", "deepspeed", cwd=away, env=env)
