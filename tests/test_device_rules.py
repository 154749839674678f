"""Issue 36, item 5, as rules on the package's source (AST, no imports): on a GPU the default process group is
NCCL, which takes no host tensor, and .numpy() raises on a device tensor.

- A collective names its group (`group=`, not None): inmem_ft's own run on its gloo groups. The examples' training
  collectives (gradients, losses on the training device; object collectives, which torch moves to the group's
  device) are the training job's, on its default group: listed below, each with why.
- .numpy() only on a value proven on the host: a chain through .cpu(); a tensor made without `device=`; a numpy
  buffer's torch.frombuffer; `x if x.device.type == "cpu" else <host>`; a name whose last assignment before the
  call, in a block that holds the call, is one of those (or a loop over one); a same-module function whose every return is. Views of the
  slot's shared memory are host by construction: the functions taking them are listed below."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "inmem_ft")
COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list",
               "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "reduce", "all_to_all",
               "all_to_all_single", "broadcast_object_list", "batch_isend_irecv"}
COLLECTIVE_MODULES = {"dist", "torch.distributed", "deepspeed.comm", "comm"}
TRAINING_COLLECTIVES = {  # (file, function, collective): why the default group is right
    ("examples/plain_pytorch.py", "main", "all_reduce"): "the model's gradients and loss, on the training device",
    ("examples/deepspeed_gpt.py", "train_step", "all_reduce"): "the loss, on the training device",
    ("examples/fsdp2_dcp.py", "main", "all_reduce"): "the loss, on the training device",
    ("examples/megatron_gpt.py", "training_log", "broadcast"): "the loss, made on the training device",
    ("examples/deepspeed_tp.py", "dump_full", "all_gather_object"): "an object collective",
    ("examples/deepspeed_moe.py", "full_state", "all_gather_object"): "an object collective",
    ("examples/deepspeed_pipe.py", "dump_full", "all_gather_object"): "an object collective",
}
HOST_VIEWS = {  # (file, function): why its .numpy() receivers are host tensors
    ("snapshot/segment.py", "_check_run"): "the slot's shared-memory bytes and the host buffer they go to",
    ("snapshot/layout.py", "_tensor_from"): "a view of the slot's shared memory",
}
FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "arange", "frombuffer", "from_numpy", "as_tensor"}
SAME_DEVICE = {"view", "reshape", "contiguous", "clone", "detach", "flatten", "float", "double", "to_dense",
               "__getitem__", "narrow", "t", "permute", "squeeze", "unsqueeze"}


def _modules():
    for d, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path) as fh:
                    yield os.path.relpath(path, PACKAGE), ast.parse(fh.read(), path)


def _functions(tree):
    """(enclosing function name, node) for every node (module level: '')."""
    out = []

    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            out.append((name, child))
            walk(child, name)

    walk(tree, "")
    return out


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def default_group_collectives(rel: str, tree) -> list[str]:
    bad = []
    for fn, node in _functions(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in COLLECTIVES and _dotted(node.func.value) in COLLECTIVE_MODULES):
            continue
        group = next((k.value for k in node.keywords if k.arg == "group"), None)
        if group is not None and not (isinstance(group, ast.Constant) and group.value is None) \
                and not _dotted(group).endswith("WORLD"):
            continue
        if (rel, fn, node.func.attr) not in TRAINING_COLLECTIVES:
            bad.append(f"inmem_ft/{rel}:{node.lineno} {fn}: {node.func.attr} on the default group")
    return bad


def test_every_collective_names_its_group():
    bad = [line for rel, tree in _modules() for line in default_group_collectives(rel, tree)]
    assert not bad, "collectives without a group of ours (NCCL takes no host tensor):\n" + "\n".join(bad)


class _Host:
    """Which expressions of one function are proven host tensors (see the module docstring)."""

    def __init__(self, fn_node, host_functions: set):
        self.fn, self.host_functions = fn_node, host_functions

    def expr(self, node, before: int) -> bool:
        if isinstance(node, ast.Subscript):
            return self.expr(node.value, before)
        if isinstance(node, ast.IfExp):
            if self._is_cpu_check(node.test, node.body):
                return self.expr(node.orelse, before)
            return self.expr(node.body, before) and self.expr(node.orelse, before)
        if isinstance(node, ast.Name):
            return self.name(node.id, before)
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "cpu":
            return True
        if isinstance(f, ast.Attribute) and _dotted(f.value) == "torch" and f.attr in FACTORIES:
            return all(k.arg != "device" for k in node.keywords)
        if isinstance(f, ast.Attribute) and f.attr in SAME_DEVICE:
            return self.expr(f.value, before)
        return isinstance(f, ast.Name) and f.id in self.host_functions

    def _reaches(self, assign, line: int) -> bool:
        """The assignment's block also holds line `line`: it binds the name on every path there (an assignment
        under `if x is None:` does not bind a parameter that was passed)."""
        for node in ast.walk(self.fn):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if isinstance(block, list) and assign in block:
                    if isinstance(node, ast.With):  # its body always runs: as if in the block around it
                        return self._reaches(node, line)
                    return block[0].lineno <= line <= block[-1].end_lineno
        return False

    @staticmethod
    def _is_cpu_check(test, body) -> bool:
        return (isinstance(test, ast.Compare) and len(test.comparators) == 1 and isinstance(test.ops[0], ast.Eq)
                and _dotted(test.left).endswith(".device.type") and isinstance(test.comparators[0], ast.Constant)
                and test.comparators[0].value == "cpu" and _dotted(test.left).rsplit(".", 2)[0] == _dotted(body))

    def name(self, name: str, before: int) -> bool:
        last = None  # the last assignment (or loop) binding `name` before line `before`
        for node in ast.walk(self.fn):
            line = node.lineno if hasattr(node, "lineno") else getattr(getattr(node, "target", None), "lineno", 0)
            if line > before or (line == before and not isinstance(node, ast.comprehension)):
                continue
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                if not self._reaches(node, before):
                    continue
                cand = node.value
            elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name) \
                    and node.target.id == name:
                cand = node.iter
            else:
                continue
            if last is None or line >= last[0]:
                last = (line, cand)
        return last is not None and self.expr(last[1], last[0])


def _host_functions(tree) -> set:
    out = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            returns = [n.value for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None]
            if returns and all(_Host(node, set()).expr(r, r.lineno) for r in returns):
                out.add(node.name)
    return out


def unproven_numpy(rel: str, tree) -> list[str]:
    bad = []
    host_functions = _host_functions(tree)
    fns = {n: node for n, node in _functions(tree) if isinstance(node, ast.FunctionDef)}
    for fn, node in _functions(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numpy"
                and not node.args) or (rel, fn) in HOST_VIEWS:
            continue
        if fn not in fns or not _Host(fns[fn], host_functions).expr(node.func.value, node.lineno):
            bad.append(f"inmem_ft/{rel}:{node.lineno} {fn}: .numpy() of {ast.unparse(node.func.value)}")
    return bad


def test_numpy_only_on_host_tensors():
    bad = [line for rel, tree in _modules() for line in unproven_numpy(rel, tree)]
    assert not bad, ".numpy() on a value that may be a device tensor (.cpu() it first):\n" + "\n".join(bad)


def test_each_rule_finds_what_it_forbids():
    """So that neither rule passes by matching nothing: a sample module's default-group collectives and
    unproven .numpy() calls are found, its grouped collective and host-proven .numpy() calls are not."""
    sample = ast.parse(
        "def f(x, g):\n"
        "    dist.all_reduce(x)\n"
        "    dist.broadcast(x, 0, group=None)\n"
        "    dist.all_reduce(x, group=g)\n"
        "    x.numpy()\n"
        "    x.cpu().numpy()\n"
        "    y = torch.zeros(3)\n"
        "    y.numpy()\n"
        "    z = x if x.device.type == 'cpu' else x.cpu()\n"
        "    z.numpy()\n")
    assert [line.split(" ")[0] for line in default_group_collectives("sample.py", sample)] == \
        ["inmem_ft/sample.py:2", "inmem_ft/sample.py:3"]
    assert [line.split(" ")[0] for line in unproven_numpy("sample.py", sample)] == ["inmem_ft/sample.py:5"]
