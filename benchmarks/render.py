"""Renders the benchmark figures of the docs and the README from the result files in benchmarks/results/, so
that no figure is typed by hand and each says where, when, on which commit and by which command it was measured
(the `meta` every benchmark's JSON carries, report.meta).

    python benchmarks/render.py            # the docs' benchmark page, as markdown, on stdout
    python benchmarks/render.py --readme   # rewrite README.md's block between the benchmark-figures markers
    python benchmarks/render.py --check    # exit 1 when README.md's block is not what the results say

The docs build calls render_page() through scripts/mkdocs_hooks.py."""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE.parent / "README.md"
# README.md's blocks this script writes: <!-- BEGIN name --> ... <!-- END name -->.
FIGURES, HEADLINE = "benchmark-figures", "benchmark-headline"
VERSUS_DCP, VERSUS_DLROVER = "benchmark-vs-dcp", "benchmark-vs-dlrover"


def load() -> dict[str, dict]:
    """{result file's name without .json: results} of every result file that carries its meta (one benchmark
    may keep several, e.g. scaling.py's sections run apart)."""
    out = {}
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if "meta" in data:
            out[path.stem] = {**data, "_file": f"benchmarks/results/{path.name}"}
    return out


def where(data: dict, link: bool = False) -> str:
    m = data["meta"]
    machine = m["machine"]
    load_avg = machine["load_average"]
    box = f"{machine['cores']}-core {machine['cpu']} CPU, {machine['memory_gib']} GiB"
    if machine.get("gpu"):
        box += f", {machine['gpu']}"
    return (f"{box}; load average {load_avg[0]} at the start, {load_avg[1]} at the end; {m['date'][:10]}, "
            f"commit `{m['commit']}`; `{m['command']}`; "
            + (f"[result file]({data['_file']})" if link else f"result file `{data['_file']}`"))


def _is_bytes(key: str) -> bool:
    name = key.rsplit(".", 1)[-1]
    return ("bytes" in name or name.startswith(("peak_", "idle_"))) and "_over_" not in name


def _fmt(value: object, key: str = "") -> str:
    if isinstance(value, bool) or value is None:
        return {None: "—", True: "yes", False: "no"}[value]
    if isinstance(value, int) and _is_bytes(key) and value >= 2**20:
        return f"{value / 2**20:.1f} MiB"
    if isinstance(value, float):
        if key.endswith("_s"):
            return f"{value:.3f} s" if value >= 0.001 else f"{value * 1e6:.0f} µs"
        return f"{value:.3g}"
    return str(value)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
                     + ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows])


# Keys that are bookkeeping, not figures.
SKIP = {"meta", "_file", "args", "runs", "rounds", "config", "machine", "skipped", "restore_runs", "disk_load_runs",
        "dlrover_losses_after", "torch_engine_tag"}


def _walk(data: dict, prefix: str = ""):
    """(dotted key, value) of every figure under `data`, depth first: numbers, flags, short strings and short
    lists of them as values, lists of uniform records (one row per configuration) as tables."""
    for key, value in data.items():
        if key in SKIP or key.endswith("digest"):  # a digest says "same state", which its own flag says
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _walk(value, name + ".")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            yield name, value
        elif isinstance(value, list) and 0 < len(value) <= 8 and all(isinstance(v, (int, float)) for v in value):
            yield name, ", ".join(_fmt(v, key) for v in value)
        elif isinstance(value, (int, float, bool)) or (isinstance(value, str) and len(value) < 80):
            yield name, value


def generic(data: dict) -> str:
    parts, rows = [], []
    for key, value in _walk(data):
        if isinstance(value, list):
            columns = [k for k, v in value[0].items() if isinstance(v, (int, float, str, bool)) or v is None]
            parts.append(f"`{key}`:\n\n" + _table(columns, [[_fmt(r.get(c), c) for c in columns] for r in value]))
        else:
            rows.append([f"`{key}`", _fmt(value, key)])
    if rows:
        parts.insert(0, _table(["figure", "value"], rows))
    return "\n\n".join(parts)


def deepspeed_save(data: dict) -> str:
    """One column per ZeRO stage, the rows and labels the benchmark itself prints (its ROWS)."""
    rows_spec = _module_constant(HERE / "deepspeed_save.py", "ROWS")
    stages = list(data["stages"])
    rows = []
    for key, label in rows_spec:
        values = [data["stages"][s].get(key) for s in stages]
        if all(v is None for v in values):
            continue
        # --quick amortises the every-step cost instead of timing a 10-step window: say so beside the figure.
        rows.append([label.strip(), *(_fmt(v, key) + (" (estimated)" if data["stages"][s].get(f"{key}_estimated")
                                                       else "") for v, s in zip(values, stages))])
    skipped = sorted({why for s in stages for why in data["stages"][s].get("skipped", {}).values()})
    notes = "".join(f"\n\nNot measured in this run: {why}" for why in skipped)
    return (f"{data['params'] / 1e6:.1f}M parameters fp32 + AdamW, {data['ranks']} ranks, medians of "
            f"{data['repeats']}, slowest rank.\n\n" + _table(["", *(f"ZeRO-{s}" for s in stages)], rows) + notes)


def deepspeed_pipe_save(data: dict) -> str:
    """A pipeline's blocking time against the stock engine's save, with the rows and labels the benchmark itself
    prints (its ROWS)."""
    rows = [[label.strip(), _fmt(data.get(key), key)] for key, label in
            _module_constant(HERE / "deepspeed_pipe_save.py", "ROWS") if data.get(key) is not None]
    return (f"{data['params'] / 1e6:.1f}M parameters fp32 + AdamW, ZeRO-1, PP{data['pp']} x DP{data['dp']} "
            f"({data['ranks']} ranks), medians of {data['repeats']}, slowest rank.\n\n"
            + _table(["", f"PP{data['pp']} x DP{data['dp']}"], rows))


def _module_constant(path: Path, name: str):
    """A literal constant of a benchmark script, read without importing it (it imports torch)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(f"{path.name} has no constant {name}")


# ---- docs/planning.md: what `inmem-ft plan` projects (plan_projection.json) and the costs it starts from ----

def _projection() -> dict:
    return load()["plan_projection"]


def _pct(share: float) -> str:
    return f"{share:.2%}"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _strategies(plan: dict) -> str:
    """The strategies of one plan side by side."""
    ours = _gib(plan["memory"]["shm"])
    shm = {0: ours, 1: "-", 2: _gib(plan["memory"]["replication"]), 3: ours}  # 3: shrink, the same snapshots
    rows = []
    for i, s in enumerate(plan["strategies"]):
        rest = sorted(((v, k) for k, v in s["accounts"].items() if k != "useful" and v > 0), reverse=True)[:4]
        rows.append([s["strategy"], f"**{_pct(s['effective'])}**" if i == 0 else _pct(s["effective"]),
                     f"{_pct(s['low'])}-{_pct(s['high'])}", f"{s['interval_s']:.0f} s",
                     f"{s['lost_per_failure_s']:.0f} s", shm[i], ", ".join(f"{k} {_pct(v)}" for v, k in rest)])
    return _table(["strategy", "effective training time", "5th-95th percentile", "interval", "lost per failure",
                   "`/dev/shm` per node", "where most of the rest went"], rows)


def plan_llama3() -> str:
    """The recommendation for Llama 3 405B on 16,384 GPUs, why, and what it buys."""
    data = _projection()
    p, inp = data["llama3"], data["llama3"]["inputs"]
    costs, mem, job = p["costs_s"], p["memory"], inp["job"]
    node = job["bytes_per_rank"] * inp["cluster"]["gpus_per_node"]
    g, m = p["group_size"], p["parity"]
    young_daly = (2 * p["strategies"][0]["blocking_s"] * p["job_mtbf_s"]) ** 0.5
    persist = p["persist_every_steps"] // p["interval_steps"]
    lines = [
        f"`{p['command']}` ({job['bytes_per_rank'] / 1e9:.2f} GB per rank, {node / 1e9:.1f} GB per node; "
        f"{data['seeds']} seeded runs of {job['duration_days']} days per strategy):",
        "",
        f"- interval {p['interval_steps']} steps ({p['interval_s']:.1f} s): Young/Daly gives {young_daly:.0f} s for "
        f"a blocking copy of {costs['blocking']:.3f} s and a job MTBF of {p['job_mtbf_s']:,.0f} s; protecting a "
        f"snapshot takes {costs['protect']:.1f} s at this size; the interval is the first whole number of steps "
        f"above the longer of the two;",
        f"- G={g}, m={m} (parity {m / (g - m):.0%} of a node's snapshot); more than m lost nodes in a group "
        f"expected {p['beyond_m_per_run']:.2g} times in the run; a rebuild takes {costs['rebuild']:.0f} s against "
        f"a {p['restart_s']:g}-s restart;",
        f"- persist_every_steps {p['persist_every_steps']} ({persist} snapshots, "
        f"{persist * p['interval_s'] / 60:.0f} min); all nodes flush in {costs['flush']:.1f} s at "
        f"{inp['cluster']['storage_gbps'] / 1000:g} TB/s;",
        f"- memory per node: {_gib(mem['shm'])} of `/dev/shm` ({_gib(mem['slots'])} of slots + {_gib(mem['parity'])} "
        f"of parity), `memory_budget` {p['inmem_ft']['memory_budget']}; a GPU job locks its {_gib(mem['locked'])} of slots.",
        "", _strategies(p), "", f"Projected on: {where(data)}."]
    return "\n".join(lines)


def plan_sensitivity() -> str:
    """Effective training time of the three strategies as the restart time of the job moves."""
    data = _projection()
    rows = [[f"{r['restart_s']} s", f"{r['group_size']}, {r['parity']}", *map(_pct, r["effective"].values())]
            for r in data["restart_sensitivity"]]
    names = list(data["restart_sensitivity"][0]["effective"])
    return (_table(["restart R", "G, m chosen", *names], rows)
            + f"\n\nProjected on: {where(data)}.")


def plan_per_replica() -> str:
    """The plan when every data-parallel replica snapshots its own copy of the weights."""
    data = _projection()
    p, gpus = data["weights_per_replica"], data["llama3"]["inputs"]["cluster"]["gpus_per_node"]
    ours, disk = p["strategies"][0], p["strategies"][1]
    return (f"`{p['command']}`: {p['bytes_per_rank'] / 1e9:.2f} GB per rank, {p['bytes_per_rank'] * gpus / 1e9:.0f} GB "
            f"per node; protecting a snapshot takes {p['costs_s']['protect']:.0f} s at the measured rate, and the "
            f"plan gives {_pct(ours['effective'])} for in-memory snapshots (G={p['group_size']}, m={p['parity']}) "
            f"against {_pct(disk['effective'])} for disk checkpoints. Projected on: {where(data)}.")


def plan_inputs() -> str:
    """The built-in inputs of `inmem-ft plan` and where each comes from, as the projection used them."""
    data = _projection()
    inp = data["llama3"]["inputs"]
    rows = [[f"`{name}`", f"{c['value']:.4g}", c["source"]] for name, c in inp["costs"].items()]
    model = inp["model"]
    rows += [["storage bandwidth", f"{inp['cluster']['storage_gbps']:,.0f} GB/s", "Llama 3: Tectonic, \"2 TB/s sustained\""],
             ["Llama 3 405B layout and step", f"TP {model['tp']}, PP {model['pp']}, DP {model['dp']}; "
              f"{model['step_s']} s", "Llama 3 Table 4; 6 x 405e9 x 16M tokens / (16,384 x 400 TFLOPs)"]]
    return _table(["input", "default", "source"], rows) + f"\n\nAs used by: {where(data)}."


def scaling_nodes() -> str:
    """benchmarks/scaling.py's nodes section: the per-node costs the planner's defaults come from."""
    data = load()["scaling_nodes"]
    keys = ("commit_s", "protect_s", "restore_s", "rebuild_s", "commit_cpu_s", "protect_cpu_s", "restore_cpu_s")
    rows = [[r["nodes"], *(f"{r[k]:.3f}" for k in keys)] for r in data["nodes"]]
    slope = data["nodes_slope"]
    return (f"EC groups of 2 (m=1), {data['nodes'][0]['node_bytes'] // 2**20} MiB per node, one measurement per node "
            "count:\n\n" + _table(["nodes", "commit s", "protect s", "restore s", "rebuild s", "SMP CPU s: commit",
                                    "protect", "restore"], rows)
            + "\n\nSMP CPU seconds added per node (least squares): "
            + ", ".join(f"{k.split('_')[0]} {slope[f'{k}_per_node'] * 1000:+.2f} ms" for k in keys[4:])
            + f".\n\nMeasured on: {where(data)}.")


def plan_projection(data: dict) -> str:
    """The benchmarks page's section: the plan's three strategies and the restart sweep."""
    return _strategies(data["llama3"]) + "\n\n" + plan_sensitivity().split("\n\nProjected on:")[0]


RENDERERS = {"deepspeed_save": deepspeed_save, "deepspeed_pipe_save": deepspeed_pipe_save,
             "plan_projection": plan_projection}


def _purpose(name: str) -> str:
    """The first paragraph of the benchmark script's docstring: what it measures, in its own words."""
    doc = ast.get_docstring(ast.parse((HERE / f"{name}.py").read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


PLOTS = "benchmarks"  # the folder of the docs site the plots are generated into (scripts/mkdocs_hooks.py)


def plots() -> dict[str, bytes]:
    """{docs path: PNG} of every result file, drawn by its benchmark's own plot() from the result alone."""
    sys.path.insert(0, str(HERE))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in load().items():
            module = importlib.import_module(data["meta"]["benchmark"])
            png = Path(tmp) / f"{name}.png"
            module.plot({k: v for k, v in data.items() if k != "_file"}, str(png))
            out[f"{PLOTS}/{name}.png"] = png.read_bytes()
    return out


def render_page(with_plots: bool = True) -> str:
    results = load()
    if not results:
        return "No result files in `benchmarks/results/` yet."
    parts = []
    for name, data in results.items():
        body = RENDERERS.get(name, generic)(data)
        picture = f"![{name}]({PLOTS}/{name}.png)\n\n" if with_plots else ""
        parts.append(f"## `{name}`\n\n{_purpose(data['meta']['benchmark'])}\n\nMeasured on: {where(data)}.\n\n"
                     f"{picture}{body}")
    return "\n\n".join(parts)


def readme_block() -> str:
    """The headline figures for the README, each with the machine it was measured on."""
    results = load()
    lines = []
    ds = results.get("deepspeed_save")
    if ds:
        for s, st in ds["stages"].items():
            if st.get("inmem_blocking_s") is not None and st.get("torch_engine_s") is not None:
                line = (f"- DeepSpeed ZeRO-{s}, {ds['params'] / 1e6:.0f}M parameters + AdamW, {ds['ranks']} ranks: "
                        f"training blocked {_fmt(st['inmem_blocking_s'], '_s')} per snapshot, against "
                        f"{_fmt(st['torch_engine_s'], '_s')} for `save_checkpoint` to local disk")
                if st.get("dcp_async_save_s") is not None:
                    line += f" and {_fmt(st['dcp_async_save_s'], '_s')} for DCP `async_save`"
                if st.get("restore_s") is not None and st.get("disk_load_s") is not None:
                    line += (f"; restore {_fmt(st['restore_s'], '_s')} against "
                             f"{_fmt(st['disk_load_s'], '_s')} for `load_checkpoint`")
                lines.append(line + " ¹")
    mg = results.get("megatron_save")
    if mg:
        model = mg.get("model", {})
        lines.append(f"- Megatron-Core, TP={model.get('tp')}, {model.get('layers')} layers x {model.get('hidden')}: "
                     f"training blocked {_fmt(mg['inmem_blocking_s'], '_s')} per snapshot "
                     f"against {_fmt(mg['torch_dist_sync_s'], '_s')} for a sync `torch_dist` save; restore "
                     f"{_fmt(mg['restore_s'], '_s')} against {_fmt(mg['disk_load_s'], '_s')} from disk ²")
    pipe = results.get("deepspeed_pipe_save")
    if pipe:
        lines.append(f"- DeepSpeed pipeline PP{pipe['pp']} x DP{pipe['dp']}, ZeRO-{pipe['zero_stage']}, "
                     f"{pipe['params'] / 1e6:.0f}M parameters + AdamW, {pipe['ranks']} ranks: training blocked "
                     f"{_fmt(pipe['inmem_blocking_s'], '_s')} per snapshot, against "
                     f"{_fmt(pipe['torch_engine_s'], '_s')} for `save_checkpoint` to local disk "
                     f"(ratio {pipe['ratio_vs_torch_engine']:.3f}) ³")
    lost = results.get("time_lost")
    if lost:
        cases = lost["cases"]
        lines.append(f"- Time lost per failure through `{lost['launcher'].split()[0]}`, {lost['nodes']} nodes x "
                     f"{lost['ranks_per_node']} ranks, DeepSpeed demo model: a killed rank "
                     f"{_fmt(cases['agent']['lost_s'], '_s')} with `inmem-ft run`'s warm standbys against "
                     f"{_fmt(cases['torchrun']['lost_s'], '_s')} for torchrun's cold restart; a hung rank "
                     f"{_fmt(cases['agent, hang']['lost_s'], '_s')} with a {lost['hang_timeout_s']:g} s hang timeout ⁴")
    notes = [(n, results[n]) for n in ("deepspeed_save", "megatron_save", "deepspeed_pipe_save", "time_lost")
             if n in results]
    lines += [""] + [f"{'¹²³⁴'[i]} {where(d, link=True)}." for i, (_, d) in enumerate(notes)]
    return "\n".join(lines).strip()


def readme_headline() -> str:
    """One line for the README's first screen: the DeepSpeed snapshot and restore of the highest ZeRO stage
    measured, and where."""
    ds = load().get("deepspeed_save")
    if not ds:
        return "not measured yet"
    stage, st = list(ds["stages"].items())[-1]
    m = ds["meta"]["machine"]
    parts = [f"training blocked {_fmt(st['inmem_blocking_s'], '_s')} per snapshot"]
    if st.get("torch_engine_s") is not None:
        parts[0] += f" (DeepSpeed `save_checkpoint`: {_fmt(st['torch_engine_s'], '_s')})"
    if st.get("restore_s") is not None and st.get("disk_load_s") is not None:
        parts.append(f"restore {_fmt(st['restore_s'], '_s')} (`load_checkpoint`: {_fmt(st['disk_load_s'], '_s')})")
    return (", ".join(parts) + f"; ZeRO-{stage}, {ds['params'] / 1e6:.0f}M parameters, {m['cores']}-core CPU, "
            f"measured {ds['meta']['date'][:10]} ([details](#what-it-costs))")


def readme_versus_dcp() -> str:
    """The comparison table's DCP cell: our blocking time over DCP async_save's, per stage, side by side in one
    run."""
    ds = load().get("deepspeed_save")
    ratios = [(s, st["inmem_blocking_s"] / st["dcp_async_save_s"]) for s, st in (ds or {}).get("stages", {}).items()
              if st.get("inmem_blocking_s") is not None and st.get("dcp_async_save_s")]
    if not ratios:
        return "not measured yet"
    return ("training blocked per snapshot " + ", ".join(f"{r:.3f}× its `async_save` call (ZeRO-{s})" for s, r in ratios)
            + f", {ds['meta']['machine']['cores']}-core CPU")


def readme_versus_dlrover() -> str:
    """The comparison table's DLRover cell: our restore and blocking time over DLRover Flash Checkpoint's, per
    stage, measured side by side in one run of deepspeed_save (with DLRover installed)."""
    ds = load().get("deepspeed_save")
    stages = [(s, st) for s, st in (ds or {}).get("stages", {}).items() if st.get("restore_vs_dlrover") is not None]
    if not stages:
        return "not in the kept result files"
    version = stages[0][1].get("dlrover_version", "")
    restore = ", ".join(f"{st['restore_vs_dlrover']:.2f}× (ZeRO-{s})" for s, st in stages)
    blocked = ", ".join(f"{st['ratio_vs_dlrover_memory']:.2f}× (ZeRO-{s})" for s, st in stages
                        if st.get("ratio_vs_dlrover_memory") is not None)
    return (f"DLRover {version}: restore {restore} its restore from memory; training blocked per snapshot "
            f"{blocked} its memory save; {ds['meta']['machine']['cores']}-core CPU")


def _replace(text: str, name: str, body: str, sep: str) -> str:
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}{sep}{body}{sep}{end}{tail}"


def rewrite_readme(text: str) -> str:
    text = _replace(text, HEADLINE, readme_headline(), "")
    text = _replace(text, VERSUS_DCP, readme_versus_dcp(), "")
    text = _replace(text, VERSUS_DLROVER, readme_versus_dlrover(), "")
    return _replace(text, FIGURES, readme_block(), "\n")


def time_lost() -> str:
    """Time lost per failure through the launch script: torchrun's cold restart, `inmem-ft run` with standbys off
    and on, a hang; and the agent's own split of each of its cases."""
    data = load()["time_lost"]
    rows = [[case, ", ".join(f"{r['lost_s']:.2f}" for r in data["runs"][case]), f"{s['lost_s']:.2f}"]
            for case, s in data["cases"].items()]
    agent = {case: s for case, s in data["cases"].items() if s.get("parts")}
    parts = list(next(iter(agent.values()))["parts"]) if agent else []
    split = [[case, f"{s['total_s']:.2f}", *(("-" if s["parts"][p] is None else f"{s['parts'][p]:.3f}") for p in parts)]
             for case, s in agent.items()]
    rss = [mib for r in data["runs"]["agent"] for mib in r.get("standby_rss_mib", [])]
    held = f"{min(rss)}" if rss and min(rss) == max(rss) else f"{min(rss, default=0)}-{max(rss, default=0)}"
    memory = f"\n\nEach warm standby held {held} MiB resident (VmRSS, shared library pages included)." if rss else ""
    goals = data["goals"]
    met = {True: "met", False: "not met"}
    memory += (f"\n\nGoals on this run: a killed rank back within {goals['rank_kill_s']:g} s: "
               f"{met[goals['rank_kill_met']]} ({data['cases']['agent']['lost_s']:.2f} s); a hang within the timeout "
               f"+ 3 s ({goals['hang_s']:g} s): {met[goals['hang_met']]} ({data['cases']['agent, hang']['lost_s']:.2f} s).")
    return (_table(["case", f"{data['repeat']} runs (s lost)", "median (s)"], rows)
            + "\n\nThe agent's own split of the time lost on the failed rank's node (medians, s):\n\n"
            + _table(["case", "total", *parts], split) + memory
            + f"\n\nLauncher: {data['launcher']}; model: {data['model']}, {data['nodes']} nodes x "
              f"{data['ranks_per_node']} ranks; hang timeout {data['hang_timeout_s']:g} s. Measured on: {where(data)}.")


def pipe_save_figures() -> str:
    """docs/deepspeed-pipeline.md's figures: benchmarks/deepspeed_pipe_save.py's table and where it ran."""
    data = load()["deepspeed_pipe_save"]
    return deepspeed_pipe_save(data) + f"\n\nMeasured on: {where(data)}."


GENERATORS = {"benchmarks": render_page, "deepspeed-pipe-save": pipe_save_figures, "plan-llama3": plan_llama3,
              "plan-sensitivity": plan_sensitivity,
              "plan-per-replica": plan_per_replica, "plan-inputs": plan_inputs, "scaling-nodes": scaling_nodes,
              "time-lost": time_lost}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--readme", action="store_true", help="rewrite README.md's benchmark-figures block")
    p.add_argument("--check", action="store_true", help="exit 1 if README.md's block is out of date")
    args = p.parse_args()
    if args.readme or args.check:
        text = README.read_text()
        new = rewrite_readme(text)
        if args.check:
            if new != text:
                print("README.md's benchmark figures differ from benchmarks/results/: run "
                      "python benchmarks/render.py --readme", file=sys.stderr)
                return 1
            return 0
        README.write_text(new)
        return 0
    print(render_page(with_plots=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
