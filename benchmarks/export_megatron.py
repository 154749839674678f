"""`inmem-ft export --format megatron-dist` from memory (the SMP) and from the SMP's disk spill (`--from`),
side by side in one run.

    python benchmarks/export_megatron.py --quick --json out/export_megatron.json [--plot out/export_megatron.png]

One GPT (Megatron-Core 0.19.2's pretrain loop, inmem_ft/examples/megatron_gpt.py; on CPU through the test
shim) trains on 2 ranks at TP=2 until its snapshot at `--iters`; an SMP then spills it (SIGTERM) and the next
one serves it again. Then, alternating for `repeats` rounds, the CLI exports that step from
memory and from the spill, each in a fresh process:
  export_s          the export's own time (read every global tensor, write it), as the CLI reports it
  peak_extra_mib    the exporter's peak RSS above its RSS once everything is imported: what the export
                    itself holds at most (one global tensor at a time), beside the largest global tensor
                    and the whole state
Medians over the rounds; ratio spill/memory.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import report  # noqa: E402

# The exporter: Megatron imports behind the test shim where there is no CUDA (no triton); the baseline RSS is
# taken once all imports are done, so the peak above it is the export's own.
EXPORTER = """
import resource, sys, torch
if not torch.cuda.is_available():
    sys.path.insert(0, {tests!r}); import megatron_cpu_shim; megatron_cpu_shim.install()
import megatron.core.enums, inmem_ft.integrations.megatron.dist_export, inmem_ft.universal.diskslots, inmem_ft.cli
import torch.distributed.checkpoint
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rc = inmem_ft.cli.main(sys.argv[1:])
print("PEAK_EXTRA_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
sys.exit(rc)
"""
DONE = re.compile(r"exported step (\d+) .*: (\d+) global tensors, .*, ([\d.]+) s")


def model_argv(opts) -> list[str]:
    return ["--tensor-model-parallel-size", "2", "--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden),
            "--num-attention-heads", "8", "--seq-length", "64", "--max-position-embeddings", "64",
            "--vocab-size", "1024", "--train-iters", str(opts.iters), "--inmem-ft", "--inmem-ft-interval",
            str(opts.iters)]


def export(argv: list[str], out: str) -> dict:
    code = EXPORTER.format(tests=os.path.join(ROOT, "tests"))
    proc = subprocess.run([sys.executable, "-c", code, "export", *argv, "--format", "megatron-dist", "--out", out,
                           "--quiet"], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    m = DONE.search(proc.stdout)
    extra = int(proc.stdout.split("PEAK_EXTRA_KIB")[1].split()[0])
    shutil.rmtree(out)
    return {"step": int(m[1]), "tensors": int(m[2]), "export_s": float(m[3]), "peak_extra_mib": extra / 1024}


def orchestrate(opts) -> dict:
    import torch

    from inmem_ft.launcher.simulated import SimulatedCluster
    from inmem_ft.smp import control
    from inmem_ft.smp.segments import names_with_prefix, unlink
    from inmem_ft.universal.source import MemorySource

    work = tempfile.mkdtemp(prefix="export_megatron_")
    os.environ["INMEM_FT_RUNTIME_DIR"] = os.path.join(work, "run")
    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    job, spill = f"xbench{uuid.uuid4().hex[:8]}", os.path.join(work, "spill")
    rounds: dict[str, list[dict]] = {"memory": [], "spill": []}
    try:
        with SimulatedCluster(1, 2, job, 4 << 30, os.path.join(work, "logs")) as cluster:
            report.say(f"training {opts.layers}x{opts.hidden} at TP=2 to iteration {opts.iters} ...")
            attempt = cluster.run(["-m", "inmem_ft.examples.megatron_gpt", *model_argv(opts)])
            if not attempt.ok:
                raise RuntimeError(cluster.rank_log(attempt.number, attempt.first_failure or 0)[-3000:])
            with MemorySource(cluster.socket_path(0)) as src:
                shapes = {k: src.fragments.shape(k) for k in src.keys()}
                sizes = [torch.Size(s).numel() * src.fragments.dtype(k).itemsize for k, s in shapes.items()]
            # An SMP with a spill directory takes the slots over from shared memory, spills them on SIGTERM, and
            # the next one serves them again.
            cluster.kill_smp(0)

            def smp():
                return control.start(job, 0, cluster.memory_budget, cluster.socket_path(0), cluster.smp_log(0),
                                     extra_args=["--peers", cluster.peers, "--persist-dir", spill], env=cluster.env)

            spiller = smp()
            spiller.send_signal(signal.SIGTERM)
            spiller.wait(timeout=300)
            cluster.smps[0] = smp()
            for r in range(opts.repeats):
                with report.phase(f"round {r + 1}/{opts.repeats}"):
                    rounds["memory"].append(export(["--job", job, "--socket", cluster.socket_path(0)],
                                                   os.path.join(work, "out")))
                    rounds["spill"].append(export(["--from", spill], os.path.join(work, "out")))
    finally:
        for seg in names_with_prefix(f"inmemft.{job}."):
            unlink(seg)
        shutil.rmtree(work, ignore_errors=True)
    med = {src: {k: statistics.median(r[k] for r in runs) for k in ("export_s", "peak_extra_mib")}
           for src, runs in rounds.items()}
    return {"model": {"layers": opts.layers, "hidden": opts.hidden, "tp": 2, "ranks": 2},
            "repeats": opts.repeats, "step": rounds["memory"][0]["step"], "tensors": rounds["memory"][0]["tensors"],
            "state_mib": sum(sizes) / 2**20, "largest_tensor_mib": max(sizes) / 2**20, "median": med,
            "spill_vs_memory_s": med["spill"]["export_s"] / med["memory"]["export_s"], "rounds": rounds}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    med = results["median"]
    a.bar(["from memory", "from spill"], [med["memory"]["export_s"], med["spill"]["export_s"]], color=["#2a7", "#58c"])
    a.set_ylabel("export seconds (median)")
    a.set_title(f"megatron-dist export, {results['model']['layers']}x{results['model']['hidden']}, TP=2")
    b.bar(["peak extra\n(memory)", "peak extra\n(spill)", "largest\ntensor", "whole\nstate"],
          [med["memory"]["peak_extra_mib"], med["spill"]["peak_extra_mib"], results["largest_tensor_mib"],
           results["state_mib"]], color=["#2a7", "#58c", "#999", "#c55"])
    b.set_ylabel("MiB")
    b.set_title("exporter memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smaller model and fewer rounds")
    p.add_argument("--layers", type=int, default=None, help="default 8 (4 with --quick)")
    p.add_argument("--hidden", type=int, default=None, help="default 1024 (512 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (2 with --quick)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    opts = p.parse_args()
    opts.layers = opts.layers or (4 if opts.quick else 8)
    opts.hidden = opts.hidden or (512 if opts.quick else 1024)
    opts.repeats = opts.repeats or (2 if opts.quick else 3)
    opts.iters = 2
    results = orchestrate(opts)
    med = results["median"]
    print(f"step {results['step']}: {results['tensors']} global tensors, state {results['state_mib']:.1f} MiB, "
          f"largest tensor {results['largest_tensor_mib']:.1f} MiB")
    for src in ("memory", "spill"):
        print(f"from {src:7} export {med[src]['export_s']:8.2f} s   "
              f"peak extra RSS {med[src]['peak_extra_mib']:8.1f} MiB")
    print(f"spill / memory export time: {results['spill_vs_memory_s']:.2f}")
    print(json.dumps({k: v for k, v in results.items() if k != "rounds"}))
    report.write(results, opts.json, plot, opts.plot)


if __name__ == "__main__":
    main()
