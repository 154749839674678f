"""The device data path's rules, read from the package's source (issue 36): copies in capture/ and snapshot/
say whether they may run behind the host (a device copy without non_blocking stalls the training thread until
every queued kernel and byte is done); torch.cuda is named only in inmem_ft/device.py (every other
accelerator takes the same path); nothing on the save() path pins memory (torch's pinned allocator rounds up to
a power of two, counted in no budget, and pinning on the training thread costs ~0.1 s per GB)."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "inmem_ft"
DEVICE_MODULE = PACKAGE / "device.py"
# The examples are user training scripts: what they say of torch.cuda is the user's code, not the library's.
USER_SCRIPTS = PACKAGE / "examples"
COPY_DIRS = (PACKAGE / "capture", PACKAGE / "snapshot")
SAVE_PATH = [PACKAGE / p for p in ("capture/snapshotter.py", "capture/copier.py", "capture/plans.py",
                                   "snapshot/pack.py", "snapshot/layout.py", "snapshot/tree.py", "device.py")]


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def unmarked_copies(tree) -> list[int]:
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "copy_" and not any(k.arg == "non_blocking" for k in n.keywords)]


def cuda_names(tree) -> list[int]:
    """torch.cuda named as an attribute, or imported (import torch.cuda, from torch import cuda)."""
    return [n.lineno for n in ast.walk(tree) if (isinstance(n, ast.Attribute) and _dotted(n) == "torch.cuda")
            or (isinstance(n, ast.Import) and any(a.name.startswith("torch.cuda") for a in n.names))
            or (isinstance(n, ast.ImportFrom) and ((n.module or "").startswith("torch.cuda") or (
                n.module == "torch" and any(a.name == "cuda" for a in n.names))))]


def pinning(tree) -> list[int]:
    return [n.lineno for n in ast.walk(tree)
            if (isinstance(n, ast.Attribute) and n.attr == "pin_memory")
            or (isinstance(n, ast.Call) and any(k.arg == "pin_memory" for k in n.keywords))]


def _found(rule, paths) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in paths
            for line in rule(ast.parse(path.read_text(), str(path)))]


def test_copies_in_capture_and_snapshot_say_non_blocking():
    found = _found(unmarked_copies, [p for d in COPY_DIRS for p in sorted(d.rglob("*.py"))])
    assert not found, f"copy_ without non_blocking (True behind the host, False where the host reads it next): {found}"


def test_torch_cuda_only_in_the_device_module():
    paths = [p for p in sorted(PACKAGE.rglob("*.py")) if p != DEVICE_MODULE and USER_SCRIPTS not in p.parents]
    found = _found(cuda_names, paths)
    assert not found, f"torch.cuda outside inmem_ft/device.py (ask inmem_ft.device): {found}"


def test_nothing_on_the_save_path_pins_memory():
    found = _found(pinning, SAVE_PATH)
    assert not found, f"pin_memory on the save() path (register the slot instead: inmem_ft.device.register): {found}"


def test_each_rule_finds_what_it_forbids():
    """So that no rule passes by matching nothing."""
    sample = ast.parse("torch.cuda.current_stream()\nx.copy_(y)\nx.copy_(y, non_blocking=True)\n"
                       "torch.empty(1, pin_memory=True)\nt.pin_memory()\nfrom torch import cuda\n")
    assert [sorted(rule(sample)) for rule in (cuda_names, unmarked_copies, pinning)] == [[1, 6], [2], [4, 5]]
