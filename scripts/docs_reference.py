"""The configuration reference, generated from the code at docs build time so that it cannot drift: the keys
of the `inmem_ft` config block (inmem_ft/config.py), the Megatron arguments, every `inmem-ft` command's
options, `python -m inmem_ft.smp`'s options, the environment variables (inmem_ft/envvars.py) and the log
events the code emits. scripts/mkdocs_hooks.py puts each table where a page says `<!-- gen:NAME -->`;
`python scripts/docs_reference.py NAME` prints one."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _cell(text: object) -> str:
    """One table cell: one line, pipes escaped, and `<job>` outside code spans kept as text, not an HTML tag."""
    parts = re.split(r"(`[^`]*`)", " ".join(str(text).split()))
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;")
                   for p in parts).replace("|", "\\|")


def _table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


@contextmanager
def _clean_env():
    """CLI defaults read INMEM_FT_* at parser build time: the reference shows the defaults of an empty
    environment, not the builder's."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("INMEM_FT_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def field_docs(path: Path, class_name: str) -> dict[str, str]:
    """The attribute docstrings (a string right after a field) of a dataclass, read from its source."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    docs, body = {}, cls.body
    for node, after in zip(body, body[1:] + [None]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = after.value.value
    return docs


def config_block() -> str:
    from inmem_ft.config import InmemFTBlock, SnapshotConfig

    config_py = REPO / "inmem_ft" / "config.py"
    # A key the block passes through to SnapshotConfig is documented once, there.
    docs = {**field_docs(config_py, "SnapshotConfig"), **field_docs(config_py, "InmemFTBlock")}
    snapshot_fields = {f.name for f in dataclasses.fields(SnapshotConfig)}
    rows = []
    for f in dataclasses.fields(InmemFTBlock):
        side = "SMP" if docs.get(f.name, "").startswith("SMP-side: ") else "trainer"
        text = docs.get(f.name, "").removeprefix("SMP-side: ")
        if f.name in snapshot_fields and f.name not in field_docs(config_py, "InmemFTBlock"):
            text += " (see `SnapshotConfig`)" if not text else ""
        rows.append([f"`{f.name}`", _unit(f.name, str(f.type)), f"`{_json(f.default)}`", side, text])
    return _table(["key", "value (unit)", "default", "read by", "meaning"], rows)


def _unit(name: str, annotation: str) -> str:
    """What a key's value is, from its name, its type and the choices config.py validates against."""
    from inmem_ft import config

    choices = {"on_error": config.ON_ERROR, "reshard": config.RESHARD}
    if name in choices:
        return " | ".join(f"`{c}`" for c in choices[name])
    if name.endswith("_s"):
        return "number (seconds)"
    if "bool" in annotation:
        return "`true` | `false`"
    if annotation.startswith("dict"):
        return "object or `null`"
    if "int | str" in annotation:
        return "size (bytes, or a string such as `64GiB`)"
    kind = "integer" if annotation.startswith("int") else "string"
    return kind + (" or `null`" if "None" in annotation else "")


def _json(value: object) -> str:
    return {None: "null", True: "true", False: "false"}.get(value, value) if not isinstance(value, (int, float)) \
        or isinstance(value, bool) else str(value)


# What a value of each argparse `type` is, in the words of the help texts.
TYPE_NAMES = {"job_id": "NAME", "node_id": "INDEX", "argparse_size": "SIZE", "argparse_duration": "AGE",
              "int": "INT", "float": "NUMBER", "port": "PORT"}


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "flag"
    if action.choices:
        return " | ".join(f"`{c}`" for c in action.choices)
    if action.metavar:
        return f"`{action.metavar}`"
    kind = getattr(action.type, "__name__", None)
    return f"`{TYPE_NAMES.get(kind, 'VALUE')}`"


def _options(parser: argparse.ArgumentParser, actions: list[argparse.Action] | None = None) -> str:
    rows = []
    for action in actions or parser._actions:  # argparse offers no public walk of a parser's options
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}` (positional)"
        text = (action.help or "") % {"default": action.default} if action.help else ""
        if isinstance(action, argparse._VersionAction):
            text = "print the installed version"
        rows.append([names, _value(action), text])
    return _table(["option", "value", "meaning (default)"], rows)


def _subcommands(parser: argparse.ArgumentParser, prefix: str):
    """(command line, help, parser) of every leaf command, depth first."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix, parser
        return
    for name, child in subs[0].choices.items():
        yield from _subcommands(child, f"{prefix} {name}")


def cli() -> str:
    with _clean_env():
        from inmem_ft import cli as cli_mod

        root = cli_mod.build_parser()
    helps = {}
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                helps[f"inmem-ft {choice.dest}"] = choice.help
    out = []
    for command, parser in _subcommands(root, "inmem-ft"):
        description = helps.get(command) or _nested_help(root, command)
        if command == "inmem-ft run":
            out += [f"### `{command}`", "", _cell(description or ""), "", _agent_options(), ""]
            continue
        out += [f"### `{command}`", "", _cell(description or ""), "", _options(parser), ""]
    return "\n".join(out)


def _agent_options() -> str:
    """`inmem-ft run` parses torchrun's own arguments (torch.distributed.run) plus a group of ours: list ours."""
    with _clean_env():
        from inmem_ft.agent import run

        parser = run.parser()
    [ours] = [g for g in parser._action_groups if g.title == "inmem_ft"]
    return ("Every `torchrun` option, as the installed torch defines it, and:\n\n"
            + _options(parser, ours._group_actions))


def _nested_help(root: argparse.ArgumentParser, command: str) -> str | None:
    parser = root
    for word in command.split()[1:]:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        helps = {c.dest: c.help for c in sub._choices_actions}
        if word in helps and command.endswith(word):
            return helps[word]
        parser = sub.choices[word]
    return None


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def smp_module() -> str:
    """`python -m inmem_ft.smp` builds its parser inside main(): stop it at parse_args and take the parser."""
    with _clean_env():
        from inmem_ft import cli as cli_mod
        from inmem_ft.smp import __main__ as smp_main

        def capture(self, *args, **kwargs):
            raise _Parsed(self)

        original = cli_mod.Parser.parse_args
        cli_mod.Parser.parse_args = capture
        try:
            smp_main.main([])
        except _Parsed as got:
            return _options(got.parser)
        finally:
            cli_mod.Parser.parse_args = original
    raise RuntimeError("python -m inmem_ft.smp built no parser")


def megatron_args() -> str:
    from inmem_ft.integrations.megatron.args import add_args

    return _options(add_args(argparse.ArgumentParser(add_help=False)))


def env_vars() -> str:
    from inmem_ft.envvars import VARIABLES

    rows = [[f"`{v.name}`", v.read_by, v.default, v.unit, v.text + (" *Set by inmem_ft; not for users.*"
                                                                     if v.internal else "")]
            for v in VARIABLES]
    return _table(["variable", "read by", "default", "unit", "meaning"], rows)


EVENT = re.compile(r"event=([a-z][a-z_]+)")
SCRIPT_EVENT = re.compile(r'\blog "([a-z][a-z_]+)')  # the launch scripts' log(): `log "smp_started pid=..."`


def events() -> str:
    """Every `event=NAME` the code logs, with the modules that log it."""
    seen: dict[str, set[str]] = {}
    # The launch scripts live in launch/ (inmem_ft/launch_scripts links there; rglob keeps out of links).
    for path in sorted([*(REPO / "inmem_ft").rglob("*"), *(REPO / "launch").rglob("*")]):
        if path.suffix not in (".py", ".sh", ".sbatch") or path.name == "envvars.py":
            continue
        text = path.read_text()
        for name in EVENT.findall(text) + (SCRIPT_EVENT.findall(text) if path.suffix != ".py" else []):
            seen.setdefault(name, set()).add(str(path.relative_to(REPO)))
    rows = [[f"`event={name}`", ", ".join(f"`{m}`" for m in sorted(mods))] for name, mods in sorted(seen.items())]
    return _table(["event", "logged by"], rows)


def compat() -> str:
    """The framework releases the adapters accept (inmem_ft/compat.py) and the extra that installs each."""
    from inmem_ft.compat import TESTED

    names = {"deepspeed": ("DeepSpeed", "deepspeed"), "megatron-core": ("Megatron-Core", "megatron"),
             "transformers": ("transformers (Trainer)", "hf"), "accelerate": ("accelerate", "hf"),
             "lightning": ("Lightning (DeepSpeedStrategy)", "lightning")}
    rows = [[names[d][0], " or ".join(f"`{s}`" for s in series), f"`inmem-ft[{names[d][1]}]`"]
            for d, series in TESTED.items()]
    return _table(["framework", "tested releases", "extra"], rows)


GENERATORS = {"compat": compat, "config-block": config_block, "megatron-args": megatron_args, "cli": cli, "smp-module": smp_module,
              "env-vars": env_vars, "events": events}


if __name__ == "__main__":
    for name in sys.argv[1:] or GENERATORS:
        print(GENERATORS[name]())
