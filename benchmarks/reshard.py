"""Resume on another layout: inmem_ft's reshard from memory vs DeepSpeed's stock route, side by side.

    python benchmarks/reshard.py --quick --json out/reshard.json --plot out/reshard.png

A job trains with ZeRO-1 on 2 ranks (gloo, CPU, DS_ACCELERATOR=cpu) and comes back on 1 rank with ZeRO-2,
then with ZeRO-3, on the same state (an MLP of `--layers` x (hidden x 2*hidden + 2*hidden x hidden), AdamW):
  inmem_reshard_s     install() in a fresh engine of the new layout: agree, open the catalog, read this rank's
                      pieces from the SMP's memory and put them into the engine (`restore ... source=
                      memory_resharded`); the snapshot itself was taken during training (its stall is
                      benchmarks/deepspeed_save.py's subject)
  stock_save_s        engine.save_checkpoint(local_dir) on the old layout (DeepSpeed's default engine)
  ds_to_universal_s   python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state (a process, as
                      users run it)
  stock_load_s        engine.load_checkpoint with "checkpoint": {"load_universal": true} on the new layout
  stock_route_s       the three above; ratio = inmem_reshard_s / stock_route_s (goal <= 0.1)
Each new layout's state is digested (every fp32 master and Adam moment, gathered by DeepSpeed): `identical`
says whether ours equals the stock route's. A stock step that fails is reported with its error, as it is.

The Megatron row (`--megatron`, or `--only megatron`): a GPT (Megatron-Core 0.19.2's pretrain(),
inmem_ft/examples/megatron_gpt.py, on CPU through the test shim) trained on TP2 x PP2 x DP1 comes back on
TP1 x PP1 x DP4 (4 ranks, one node):
  megatron_inmem_load_s    Megatron's load_checkpoint on the new layout (barrier to barrier, slowest rank),
                           served by inmem_ft from the old layout's snapshots in memory (distributed optimizer;
                           `restore ... source=memory_resharded`)
  megatron_stock_save_s    Megatron's own torch_dist save_checkpoint on the old layout
  megatron_stock_load_s    load_checkpoint of it on the new layout: dist_checkpointing reshards it
  megatron_ratio           megatron_inmem_load_s / (stock save + stock load) (goal <= 0.1)
The stock route runs without the distributed optimizer: in 0.19.2 its only TP/PP-reshardable format
(fully_reshardable) fails to load without Apex/TE (FINDINGS.md); the state is the same (fp32 weights, which
are the masters, and two Adam moments).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

import report  # benchmarks/report.py (the script's own folder is on sys.path)
from deepspeed_save import setup_worker, slowest  # the same gloo/CPU worker setup and slowest-rank figure

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_STAGE, TARGET_STAGES = 1, (2, 3)
MICRO_BATCH = 4
TAG = "source"


# ---------------------------------------------------------------------------------------------------------
# Worker side (one rank process)
# ---------------------------------------------------------------------------------------------------------

def ds_config(stage: int, inmem: bool, universal: bool = False) -> dict:
    conf = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            # torch_adam: DeepSpeed's FusedAdam would JIT-compile a C++ op on CPU.
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    if inmem:
        conf["inmem_ft"] = {"enabled": True, "interval": 10**9}
    if universal:
        conf["checkpoint"] = {"load_universal": True}
    return conf


def build_engine(args, stage: int, inmem: bool, universal: bool = False):
    import torch
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(args.hidden, 2 * args.hidden),
                                                      torch.nn.Linear(2 * args.hidden, args.hidden))
                                  for _ in range(args.layers)])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(stage, inmem, universal))
    return engine


def train(engine, args) -> None:
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        x = torch.randn(MICRO_BATCH, args.hidden, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()


def digest(engine) -> str:
    """sha256 of every fp32 master and Adam moment, gathered the way DeepSpeed does (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    h = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        h.update(name.encode())
        for t in (safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg"),
                  safe_get_full_optimizer_state(p, "exp_avg_sq")):
            h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def phase_stock_source(args) -> dict:
    import torch.distributed as dist
    engine = build_engine(args, SOURCE_STAGE, inmem=False)
    train(engine, args)
    dist.barrier()
    t0 = time.perf_counter()
    engine.save_checkpoint(args.disk_dir, tag=TAG)
    out = {"stock_save_s": slowest(time.perf_counter() - t0),
           "params": sum(p.numel() for p in engine.module.parameters())}
    if dist.get_rank() == 0:
        out["checkpoint_bytes"] = sum(os.path.getsize(os.path.join(d, f))
                                      for d, _, fs in os.walk(os.path.join(args.disk_dir, TAG)) for f in fs)
    return out


def phase_inmem_source(args) -> dict:
    from inmem_ft.integrations.deepspeed import install
    engine = build_engine(args, SOURCE_STAGE, inmem=True)
    handle = install(engine)
    train(engine, args)
    handle.snapshot()  # what an `interval` of the job's steps would have taken
    handle.close()
    return {"snapshot_step": engine.global_steps}


def phase_stock_load(args) -> dict:
    engine = build_engine(args, args.stage, inmem=False, universal=True)
    t0 = time.perf_counter()
    try:
        path, _ = engine.load_checkpoint(args.disk_dir, tag=f"{TAG}_universal")
        assert path is not None, "load_checkpoint loaded nothing"
    except Exception as e:  # MEGATRON.md: stock ZeRO-3 fails on ds_to_universal's output here
        traceback.print_exc()
        where = traceback.extract_tb(e.__traceback__)[-1]
        return {"stock_load_error": f"{type(e).__name__} at {os.path.basename(where.filename)}:{where.lineno} "
                                    f"({where.line}): {str(e).splitlines()[0][:300] if str(e) else ''}"}
    return {"stock_load_s": slowest(time.perf_counter() - t0), "stock_digest": digest(engine),
            "stock_step": engine.global_steps}


def phase_inmem_load(args) -> dict:
    from inmem_ft.integrations.deepspeed import install
    engine = build_engine(args, args.stage, inmem=True)
    t0 = time.perf_counter()
    handle = install(engine)
    wall = time.perf_counter() - t0
    restored = handle.restored
    out = {"inmem_reshard_s": slowest(wall), "inmem_tier": restored.tier if restored else None,
           "inmem_restore_reported_s": slowest(restored.seconds if restored else None),
           "inmem_phases": restored.phases if restored else {}, "inmem_bytes": (restored.resharded or {})
           if restored else {}, "inmem_digest": digest(engine), "inmem_step": engine.global_steps}
    handle.close()
    return out


def megatron_worker(out: str, argv: list[str]) -> None:
    """One rank of a Megatron launch: the example, with load_checkpoint and save_checkpoint timed."""
    sys.path.insert(0, os.path.dirname(HERE))
    from inmem_ft.examples import megatron_gpt as example

    _, cfg, handle, _ = example.prepare(argv)
    import torch.distributed as dist
    from megatron.training import training

    result = {}

    def timed(name, call):
        def run(*a, **kw):
            dist.barrier()
            t0 = time.perf_counter()
            got = call(*a, **kw)
            dist.barrier()
            result.setdefault(name, []).append(time.perf_counter() - t0)
            return got
        return run

    training.load_checkpoint = timed("load_s", training.load_checkpoint)  # after install() wrapped it
    training.save_checkpoint = timed("save_s", training.save_checkpoint)
    example.run(cfg)
    if handle is not None:
        result["tier"] = handle.restored.tier if handle.restored else None
        result["phases"] = (handle.restored.phases or {}) if handle.restored else {}
        handle.close()
    with open(f"{out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)


def worker(args) -> None:
    setup_worker()
    import torch.distributed as dist
    phases = {"stock_source": phase_stock_source, "inmem_source": phase_inmem_source,
              "stock_load": phase_stock_load, "inmem_load": phase_inmem_load}
    res = phases[args.phase](args)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(res, f)


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------

def convert(disk_dir: str, env: dict) -> dict:
    """ds_to_universal as users run it: a process of its own."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
           os.path.join(disk_dir, TAG), "--output_folder", os.path.join(disk_dir, f"{TAG}_universal"),
           "--inject_missing_state"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if proc.returncode:
        return {"ds_to_universal_error": (proc.stderr or proc.stdout).strip().splitlines()[-1][:400]}
    return {"ds_to_universal_s": seconds}


def megatron_row(tmp: str, quick: bool, steps: int) -> dict:
    """TP2 x PP2 x DP1 -> TP1 x PP1 x DP4: ours from memory vs Megatron's torch_dist save + load (4 launches)."""
    from inmem_ft.launcher.simulated import SimulatedCluster

    layers, hidden = (2, 256) if quick else (4, 512)
    model = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", "8",
             "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "1024",
             "--make-vocab-size-divisible-by", "32", "--micro-batch-size", "1", "--global-batch-size", "4"]
    # Both layouts run to `steps` + 1 (Megatron's scheduler refuses a changed --train-iters, its sampler a
    # start with no samples left): the new one loads iteration `steps` (stock: --ckpt-step) and trains one.
    model += ["--train-iters", str(steps + 1)]
    old, new = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], []
    ours = ["--use-distributed-optimizer", "--inmem-ft", "--inmem-ft-interval", str(steps)]
    ckpt = os.path.join(tmp, "megatron_ckpt")
    stock_save = ["--save", ckpt, "--save-interval", str(steps)]
    out = {"layers": layers, "hidden": hidden, "from": "tp2.pp2.dp1", "to": "tp1.pp1.dp4"}
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(HERE)}
    with SimulatedCluster(1, 4, "reshardmegatron", 8 << 30, os.path.join(tmp, "mlogs"), env=env) as cluster:
        def launch(name: str, what: str, argv: list[str]) -> dict:
            result = os.path.join(tmp, name)
            with report.phase(what):
                attempt = cluster.run([os.path.abspath(__file__), "--megatron-worker", result, *model, *argv],
                                      timeout_s=3600)
            if not attempt.ok or not all(os.path.exists(f"{result}.rank{r}.json") for r in range(cluster.world_size)):
                bad = attempt.first_failure or 0
                raise RuntimeError(f"{what} failed:\n{cluster.rank_log(attempt.number, bad)[-4000:]}")
            per_rank = []
            for rank in range(cluster.world_size):
                with open(f"{result}.rank{rank}.json") as f:
                    per_rank.append(json.load(f))
            # the first call of each (the stock old layout saves again at its last iteration)
            return {**{name: max(r[name][0] for r in per_rank) for name in ("load_s", "save_s")
                       if name in per_rank[0]}, "tier": per_rank[0].get("tier"),
                    "phases": {k: max(r.get("phases", {}).get(k, 0.0) for r in per_rank)
                               for k in per_rank[0].get("phases", {})}}

        launch("m_inmem_source", "Megatron TP2xPP2: train, inmem_ft snapshot", old + ours)
        got = launch("m_inmem_load", "Megatron TP1xDP4: inmem_ft reshard from memory", new + ours)
        out.update(megatron_inmem_load_s=got["load_s"], megatron_inmem_tier=got["tier"],
                   megatron_inmem_phases=got["phases"])
        out["megatron_stock_save_s"] = launch("m_stock_source", "Megatron TP2xPP2: train, torch_dist save",
                                              old + stock_save)["save_s"]
        out["megatron_stock_load_s"] = launch("m_stock_load", "Megatron TP1xDP4: torch_dist load (resharded)",
                                              new + ["--load", ckpt, "--ckpt-step", str(steps)])["load_s"]
    out["megatron_stock_route_s"] = out["megatron_stock_save_s"] + out["megatron_stock_load_s"]
    out["megatron_ratio"] = out["megatron_inmem_load_s"] / out["megatron_stock_route_s"]
    out["megatron_ratio_vs_load"] = out["megatron_inmem_load_s"] / out["megatron_stock_load_s"]
    shutil.rmtree(ckpt, ignore_errors=True)
    return out


def print_megatron(m: dict) -> None:
    print(f"Megatron GPT {m['layers']}x{m['hidden']}, {m['from']} -> {m['to']} (4 ranks, gloo, CPU)")
    print(f"  inmem_ft reshard from memory (load_checkpoint)  {m['megatron_inmem_load_s']:.3f} s  "
          f"[{m['megatron_inmem_tier']}]")
    print("    of which (slowest rank): " + ", ".join(f"{k} {v:.3f} s" for k, v in m["megatron_inmem_phases"].items())
          + "; the rest is Megatron's own load_checkpoint work and agreeing on the step")
    print(f"  stock torch_dist save (old layout)              {m['megatron_stock_save_s']:.3f} s")
    print(f"  stock torch_dist load (new layout, resharded)   {m['megatron_stock_load_s']:.3f} s")
    print(f"  ratio ours / (stock save + load)                {m['megatron_ratio']:.3f}   "
          f"(ours / stock load alone {m['megatron_ratio_vs_load']:.3f})")


def print_table(results: dict) -> None:
    print(f"{results['params'] / 1e6:.1f}M params fp32 + AdamW; ZeRO-{SOURCE_STAGE} on 2 ranks -> 1 rank (gloo, CPU)"
          + (" [--quick]" if results["quick"] else ""))
    print(f"  stock save_checkpoint (old layout)        {results['stock_save_s']:.3f} s")
    conv = results.get("ds_to_universal_s")
    print(f"  ds_to_universal                           "
          + (f"{conv:.3f} s" if conv is not None else f"failed: {results.get('ds_to_universal_error')}"))
    print(f"  {'new layout':<12} {'inmem reshard':>14} {'stock load':>12} {'stock route':>12} {'ratio':>8}  "
          f"identical  restore says")
    for stage, r in results["targets"].items():
        load = f"{r['stock_load_s']:.3f} s" if r.get("stock_load_s") is not None else "failed"
        route = f"{r['stock_route_s']:.3f} s" if r.get("stock_route_s") is not None else "-"
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") is not None else "-"
        print(f"  {'ZeRO-' + stage + ' DP1':<12} {r['inmem_reshard_s']:>12.3f} s {load:>12} {route:>12} {ratio:>8}  "
              f"{str(r.get('identical', '-')):<9}  {r.get('inmem_tier')}")
        if r.get("stock_load_error"):
            print(f"    stock load on ZeRO-{stage} failed: {r['stock_load_error']}")
        print(f"    inmem: install() {r['inmem_reshard_s']:.3f} s, of which the restore it logs "
              f"{r['inmem_restore_reported_s']:.3f} s: " + ", ".join(f"{k} {v:.3f} s" for k, v in
                                                                  r.get("inmem_phases", {}).items())
              + f"; {r.get('inmem_bytes', {})}")


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(results.get("targets", {}))
    fig, ax = plt.subplots(figsize=(8 + 2 * ("megatron" in results), 4))
    for i, stage in enumerate(stages):
        r = results["targets"][stage]
        ax.bar(i - 0.2, r["inmem_reshard_s"], 0.35, color="#2a7",
               label="inmem_ft reshard from memory" if i == 0 else None)
        parts = [("stock_save_s", "#c55", "stock save_checkpoint"), ("ds_to_universal_s", "#e93", "ds_to_universal"),
                 ("stock_load_s", "#59c", "load_universal")]
        bottom = 0.0
        for key, color, label in parts:
            v = r.get(key) if key == "stock_load_s" else results.get(key)
            if v is None:
                continue
            ax.bar(i + 0.2, v, 0.35, bottom=bottom, color=color, label=label if i == 0 else None)
            bottom += v
        note = f"x{r['ratio']:.3f}" if r.get("ratio") is not None else "stock load failed"
        ax.text(i + 0.2, bottom, note, ha="center", va="bottom", fontsize=8)
    names = [f"ZeRO-{SOURCE_STAGE} DP2 -> ZeRO-{s} DP1" for s in stages]
    m = results.get("megatron")
    if m:
        i = len(stages)
        ax.bar(i - 0.2, m["megatron_inmem_load_s"], 0.35, color="#2a7",
               label=None if stages else "inmem_ft reshard from memory")
        ax.bar(i + 0.2, m["megatron_stock_save_s"], 0.35, color="#c55", label="Megatron torch_dist save")
        ax.bar(i + 0.2, m["megatron_stock_load_s"], 0.35, bottom=m["megatron_stock_save_s"], color="#96c",
               label="Megatron torch_dist load (reshards)")
        ax.text(i + 0.2, m["megatron_stock_route_s"], f"x{m['megatron_ratio']:.3f}", ha="center", va="bottom",
                fontsize=8)
        names.append(f"Megatron {m['from']} -> {m['to']}")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("Resume on another layout (CPU): inmem_ft from memory vs the stock route")
    ax.legend(fontsize=8, loc="center")  # between the two groups of bars
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--megatron-worker":
        megatron_worker(sys.argv[2], sys.argv[3:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a 16.8M-parameter model (hidden 1024, 4 layers)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="draw a PNG here")
    p.add_argument("--hidden", type=int, default=None, help="default 2048 (1024 with --quick)")
    p.add_argument("--layers", type=int, default=None, help="default 6: 100.7M parameters (4 with --quick)")
    p.add_argument("--steps", type=int, default=3, help="training steps before the snapshot / save")
    p.add_argument("--disk-dir", default=None, help="where the stock route writes (default: a temp dir)")
    p.add_argument("--only", choices=("deepspeed", "megatron"), default=None,
                   help="run only the DeepSpeed rows or only the Megatron row (default: both)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0

    sys.path.insert(0, os.path.dirname(HERE))
    from inmem_ft.launcher.simulated import SimulatedCluster

    hidden = args.hidden or (1024 if args.quick else 2048)
    layers = args.layers or (4 if args.quick else 6)
    results = {"quick": args.quick, "targets": {}}
    if args.only != "megatron":  # the DeepSpeed rows' model (the Megatron row records its own)
        results.update(hidden=hidden, layers=layers)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        disk_dir = args.disk_dir or os.path.join(tmp, "disk")
        os.environ.setdefault("INMEM_FT_RUNTIME_DIR", os.path.join(tmp, "run"))
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(HERE), "DS_ACCELERATOR": "cpu"}
        if args.only != "megatron":
            with SimulatedCluster(1, 2, "reshardbench", 8 << 30, os.path.join(tmp, "logs"), env=env) as cluster:
                def phase(name: str, what: str, stage: int | None = None) -> dict | None:
                    result = os.path.join(tmp, f"{name}{stage or ''}.json")
                    argv = [os.path.abspath(__file__), "--worker", "--phase", name, "--result", result, "--hidden",
                            str(hidden), "--layers", str(layers), "--steps", str(args.steps), "--disk-dir", disk_dir]
                    argv += ["--stage", str(stage)] if stage else []
                    with report.phase(what):
                        attempt = cluster.run(argv, timeout_s=3600, poll=report.echo_worker(cluster, name))
                    if not attempt.ok:
                        print(cluster.rank_log(attempt.number, attempt.first_failure or 0)[-4000:], file=sys.stderr)
                        return None
                    with open(result) as f:
                        return json.load(f)

                got = phase("stock_source", f"ZeRO-{SOURCE_STAGE} on 2 ranks: train, stock save_checkpoint")
                if got is None:
                    return 1
                results.update(got)
                with report.phase("ds_to_universal"):
                    results.update(convert(disk_dir, env))
                if phase("inmem_source", f"ZeRO-{SOURCE_STAGE} on 2 ranks: train, inmem_ft snapshot") is None:
                    return 1
                cluster.reshape(1, 1)
                for stage in TARGET_STAGES:
                    r = {}
                    for name, what in (("stock_load", "stock load_universal"), ("inmem_load", "inmem_ft reshard")):
                        got = phase(name, f"ZeRO-{stage} on 1 rank: {what}", stage)
                        if got is None:
                            return 1
                        r.update(got)
                    if r.get("stock_load_s") is not None and results.get("ds_to_universal_s") is not None:
                        r["stock_route_s"] = results["stock_save_s"] + results["ds_to_universal_s"] + r["stock_load_s"]
                        r["ratio"] = r["inmem_reshard_s"] / r["stock_route_s"]
                        r["ratio_vs_convert_and_load"] = r["inmem_reshard_s"] / (results["ds_to_universal_s"] +
                                                                                 r["stock_load_s"])
                        r["identical"] = r.pop("stock_digest") == r["inmem_digest"]
                    results["targets"][str(stage)] = r
        if args.only != "deepspeed":
            results["megatron"] = megatron_row(tmp, args.quick, args.steps)
        shutil.rmtree(disk_dir, ignore_errors=True)
    results["wall_s"] = time.monotonic() - t_start
    if results["targets"]:
        print_table(results)
    if "megatron" in results:
        print_megatron(results["megatron"])
    print(f"  total wall time {results['wall_s']:.0f} s")
    report.write(results, args.json, plot, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
