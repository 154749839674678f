"""How snapshot costs grow with the job: state size, tensor count, ranks per node, EC group size.

    python benchmarks/scaling.py [--quick] [--json OUT] [--plot PNG] [--only size,tensors,ranks,protect,nodes]

Every figure is a ratio or a slope measured in one run, against a baseline timed beside it:
  size     Snapshotter.save (the plain API, a real SMP, one rank) of 16 tensors of 64 MiB .. 4 GiB in all
           (--quick: up to 1 GiB): blocking and commit time, their slope in s/GiB, and blocking over the
           floor, a torch.cat of the same tensors into a preallocated buffer, timed in the same loop.
  tensors  the same 64 MiB as 10 .. 100,000 tensors, as a flat state dict and as model + Adam state
           (per parameter: weight, exp_avg, exp_avg_sq, a 0-d step; nested as torch optimizers nest it):
           blocking and commit time, and blocking over blocking at 10 tensors (goal: <= 2 at 100,000).
           Every count has its own SMP and the saves of all counts are interleaved, so machine noise hits
           them alike; the floor here is the same torch.cat, whose cost per tensor is torch's own. Also
           the save() call alone with overlap=True (the copy then runs behind forward/backward): what
           training waits when forward/backward is longer than the copy.
  ranks    1 .. 8 ranks of one node sharing one SMP (each its own process, as torchrun starts them), each
           saving its own state at the same moment: the slowest rank's blocking time over one rank's.
  protect  a step's protection (commit to protected on every node: parity pulled over authenticated
           loopback TCP, encoded, sealed) for EC groups of G = 2 .. 8 SMPs with parity m = 1, 2, as
           benchmarks/ec_throughput.py measures it, over the G = 2, m = 1 figure.
  nodes    per-node costs against the number of nodes in the job, 2 .. 8 simulated nodes (--quick: 2, 4) in EC
           groups of G = 2, m = 1, one rank each: commit (the slot filled with random bytes in place, then
           committed), protection (complete -> protected on every node), restore (a rank maps its slot, copies
           it out and verifies its checksum) and rebuild of a lost node, in wall seconds and in the
           CPU seconds each node's SMP spent; the slope per added node is what `inmem-ft plan` extrapolates to a
           large job (CPU seconds: on a shared box every added node takes cores from the others, which wall
           time would charge to the job).
Medians over the repeats; one intra-op thread per process, as torchrun sets for each rank. On a shared
machine absolute times move with the load; the ratios do less.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import report  # benchmarks/report.py (the script's own folder is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # runs from a checkout without installing the package

MIB, GIB = 1 << 20, 1 << 30
SIZE_TENSORS = 16
TENSORS_BYTES = 64 * MIB
RANK_BYTES = 64 * MIB
GOAL_TENSORS = 2.0  # blocking at 100,000 tensors over blocking at 10


# ---- states ----------------------------------------------------------------------------------------------

def flat_state(count: int, nbytes: int):
    import torch

    numel = nbytes // 4 // count
    return {"model": {f"layers.{i}.weight": torch.randn(numel) for i in range(count)}}


def adam_state(count: int, nbytes: int):
    """`count` tensors as a model and its Adam state: per parameter the weight, exp_avg and exp_avg_sq (equal
    shares of `nbytes`) and a 0-d step, nested as torch.optim.Adam.state_dict() nests them."""
    import torch

    params = max(1, count // 4)
    numel = nbytes // 4 // (3 * params)
    return {"model": {f"layers.{i}.weight": torch.randn(numel) for i in range(params)},
            "optimizer": {"state": {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(numel),
                                        "exp_avg_sq": torch.rand(numel)} for i in range(params)},
                          "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                            "params": list(range(params))}]}}


def leaves_of(tree) -> list:
    import torch

    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in leaves_of(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in leaves_of(v)]
    return []


# ---- one process, real SMPs: size and tensor count ----------------------------------------------------

class Subject:
    """One state, its own SMP and Snapshotter, and the floor (a cat of its tensors into a private buffer)."""

    def __init__(self, name: str, state, tmp: str):
        import torch
        import inmem_ft
        from inmem_ft.smp import control

        self.name, self.state = name, state
        self.tensors = [t.reshape(-1) for t in leaves_of(state)]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.job = f"scal{os.getpid()}{name}".replace(".", "")
        budget = 2 * self.nbytes + 2 * (32 * MIB + len(self.tensors) * 400) + 64 * MIB
        self.smp = control.start(self.job, 0, budget, log_path=os.path.join(tmp, f"{self.job}.log"))
        self.snap = inmem_ft.Snapshotter(inmem_ft.SnapshotConfig(job=self.job, interval=1))
        self.floor_buf = torch.empty(sum(t.numel() for t in self.tensors))
        self.floor_buf.fill_(0)  # faulted in, as the SMP's slots are
        self.step = 0
        self.blocking, self.commit, self.floor, self.call = [], [], [], []

    def save(self, record: bool = True) -> None:
        self.step += 1
        self.snap.save(self.step, {**self.state, "step": self.step})
        self.snap.wait()
        if record:
            self.blocking.append(self.snap.metrics.last_stall_s)
            self.commit.append(self.snap.metrics.last_commit_s)

    def save_overlapped(self) -> None:
        """The save() call alone with overlap: what training waits when forward/backward covers the copy."""
        self.step += 1
        t0 = time.perf_counter()
        self.snap.save(self.step, {**self.state, "step": self.step}, overlap=True)
        self.call.append(time.perf_counter() - t0)
        self.snap.wait()

    def copy_floor(self) -> None:
        import torch

        t0 = time.perf_counter()
        torch.cat(self.tensors, out=self.floor_buf)
        self.floor.append(time.perf_counter() - t0)

    def result(self) -> dict:
        m = self.snap.metrics
        out = {"name": self.name, "tensors": len(self.tensors), "bytes": self.nbytes,
               "blocking_s": statistics.median(self.blocking), "commit_s": statistics.median(self.commit),
               "floor_s": statistics.median(self.floor), "planned": m.planned, "stale": m.stale,
               "failures": m.failures}
        if self.call:
            out["overlap_call_s"] = statistics.median(self.call)
        return out

    def close(self) -> None:
        from inmem_ft.smp import control, paths

        self.snap.close()
        control.stop(paths.default_socket(self.job, 0), wipe=True)
        self.smp.wait(timeout=30)
        self.state = self.tensors = self.floor_buf = None


def interleaved(subjects: list[Subject], repeats: int, overlapped: bool = False) -> None:
    for s in subjects:
        s.save(record=False)  # reserves and faults in the slots, lays the state out
        s.save(record=False)  # the first with the layout reused
    for r in range(repeats):
        for s in subjects:
            s.save()
            s.copy_floor()
            if overlapped:
                s.save_overlapped()


def run_sizes(sizes: list[int], repeats: int, tmp: str) -> list[dict]:
    out = []
    for size in sizes:
        with report.phase(f"size {size / GIB:.2f} GiB as {SIZE_TENSORS} tensors, {repeats} saves"):
            s = Subject(f"size{size // MIB}", flat_state(SIZE_TENSORS, size), tmp)
            try:
                interleaved([s], repeats)
                out.append(s.result())
            finally:
                s.close()
    return out


def run_tensors(counts: list[int], repeats: int, tmp: str) -> list[dict]:
    out = []
    for kind, build in (("flat", flat_state), ("adam", adam_state)):
        with report.phase(f"{kind} state of 64 MiB as {counts} tensors, {repeats} interleaved saves each"):
            subjects = []
            try:
                for n in counts:
                    subjects.append(Subject(f"{kind}{n}", build(n, TENSORS_BYTES), tmp))
                interleaved(subjects, repeats, overlapped=True)
                rows = [{**s.result(), "kind": kind} for s in subjects]
            finally:
                for s in subjects:
                    s.close()
        base = rows[0]["blocking_s"]
        for row in rows:
            row["ratio_vs_fewest"] = row["blocking_s"] / base
            row["ratio_vs_floor"] = row["blocking_s"] / row["floor_s"]
        out += rows
    return out


# ---- several ranks sharing one SMP ---------------------------------------------------------------------

def rank_worker(args) -> None:
    import torch
    import torch.distributed as dist

    import inmem_ft

    dist.init_process_group("gloo")
    state = flat_state(64, args.rank_bytes)
    snap = inmem_ft.Snapshotter(inmem_ft.SnapshotConfig.from_env(interval=1))
    stalls, commits = [], []
    for step in range(args.repeats + 2):
        dist.barrier()  # every rank saves at the same moment: they share the cores and the SMP
        snap.save(step, {**state, "step": step})
        snap.wait()
        if step >= 2:
            stalls.append(snap.metrics.last_stall_s)
            commits.append(snap.metrics.last_commit_s)
    got = torch.tensor([statistics.median(stalls), statistics.median(commits)], dtype=torch.float64)
    dist.all_reduce(got, op=dist.ReduceOp.MAX)
    snap.close()
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"blocking_s": got[0].item(), "commit_s": got[1].item()}, f)
    dist.destroy_process_group()


def run_ranks(counts: list[int], repeats: int, rank_bytes: int, tmp: str) -> list[dict]:
    from inmem_ft.launcher.simulated import SimulatedCluster

    out = []
    for ranks in counts:
        result = os.path.join(tmp, f"ranks{ranks}.json")
        budget = ranks * 2 * (rank_bytes + 8 * MIB) + 64 * MIB
        with report.phase(f"{ranks} ranks on one SMP, {rank_bytes // MIB} MiB each, {repeats} saves"), \
                SimulatedCluster(1, ranks, f"scalranks{os.getpid()}r{ranks}", budget,
                                 os.path.join(tmp, f"logs{ranks}"),
                                 env={"PYTHONPATH": os.path.dirname(HERE)}) as cluster:
            attempt = cluster.run([os.path.abspath(__file__), "--worker", "--result", result, "--repeats",
                                   str(repeats), "--rank-bytes", str(rank_bytes)], timeout_s=900)
            if not attempt.ok:
                raise RuntimeError(f"{ranks} ranks: worker failed:\n"
                                   f"{cluster.rank_log(attempt.number, attempt.first_failure or 0)[-3000:]}")
        with open(result) as f:
            out.append({"ranks": ranks, "bytes_per_rank": rank_bytes, **json.load(f)})
    for row in out:
        row["ratio_vs_one_rank"] = row["blocking_s"] / out[0]["blocking_s"]
        row["node_GBps"] = row["ranks"] * rank_bytes / row["blocking_s"] / 1e9
    return out


# ---- erasure-coding groups -------------------------------------------------------------------------------

def run_protect(groups: list[int], parities: list[int], node_bytes: int) -> list[dict]:
    import ec_throughput  # benchmarks/ec_throughput.py: its loopback group and its clock

    out = []
    for g in groups:
        for m in parities:
            if m >= g:
                continue
            with report.phase(f"protect: G={g}, m={m}, {node_bytes // MIB} MiB per node"):
                out.append(ec_throughput.measure_protect(node_bytes, m=m, nodes=g))
    base = next(r["protect_s"] for r in out if r["nodes"] == min(groups) and r["m"] == min(parities))
    for row in out:
        row["ratio_vs_smallest"] = row["protect_s"] / base
        row["parity_bytes_per_node"] = node_bytes * row["m"] // (row["nodes"] - row["m"])
    return out


# ---- per-node costs against the job's node count -----------------------------------------------------

def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_per_node(cluster, nodes) -> float:
    return statistics.fmean(_cpu_s(cluster.smps[n].pid) for n in nodes)


def restore_local(socket_path: str, rank: int, nbytes: int) -> float:
    """Seconds a rank takes to take its newest slot back: map the segment, copy the data out, verify its checksum
    (a restore from the node's own memory)."""
    import numpy as np

    from inmem_ft.smp.client import SMPClient
    from inmem_ft.smp.segments import Segment
    from inmem_ft.snapshot import segment as seg
    from inmem_ft.snapshot.checksum import checksum

    t0 = time.perf_counter()
    client = SMPClient(socket_path)
    try:
        name = client.call("list", rank=rank)["slots"][0]["segment"]
    finally:
        client.close()
    segment = Segment(name)
    header = seg.Header.read(segment.buf)
    data = np.frombuffer(segment.buf, dtype=np.uint8, count=nbytes, offset=header.data_off).copy()
    checksum(data)
    segment.close()
    return time.perf_counter() - t0


def measure_nodes(nodes: int, node_bytes: int) -> dict:
    """One EC job of `nodes` SMPs (G = 2, m = 1, one rank each): commit, protect, restore and rebuild."""
    import rebuild  # benchmarks/rebuild.py: its in-place commit of one slot, its rebuild of a lost node
    from inmem_ft.launcher.simulated import SimulatedCluster
    from inmem_ft.smp import control
    os.environ.setdefault("INMEM_FT_SECRET", "benchmark-secret-" + "0" * 16)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["INMEM_FT_RUNTIME_DIR"] = os.path.join(tmp, "run")
        cluster = SimulatedCluster(nodes, 1, f"scalnodes{os.getpid()}n{nodes}", 4 * node_bytes + 64 * MIB,
                                   os.path.join(tmp, "logs"), parity=1, group_size=2).start()
        try:
            every = range(nodes)
            cpu0, commits = _cpu_per_node(cluster, every), []
            for node in every:
                t0 = time.perf_counter()
                rebuild.commit(cluster.socket_path(node), node, node_bytes, seed=node)
                commits.append(time.perf_counter() - t0)
            cpu1 = _cpu_per_node(cluster, every)
            t0 = time.perf_counter()
            for node in every:
                control.call(cluster.socket_path(node), "complete", step=1)
            while any(control.call(cluster.socket_path(n), "status")["ec"]["protected_step"] != 1 for n in every):
                time.sleep(0.02)  # each status call costs the SMPs CPU: polled gently
            protect = time.perf_counter() - t0
            cpu2 = _cpu_per_node(cluster, every)
            restores = [restore_local(cluster.socket_path(node), node, node_bytes) for node in every]
            cpu3 = _cpu_per_node(cluster, every)
            rebuilt = rebuild.rebuild_once(cluster, node_bytes, f"{nodes} nodes", None)
        finally:
            cluster.stop()
    return {"nodes": nodes, "node_bytes": node_bytes, "commit_s": statistics.median(commits), "protect_s": protect,
            "restore_s": statistics.median(restores), "rebuild_s": rebuilt["rebuild_s"] or rebuilt["wall_s"],
            "commit_cpu_s": cpu1 - cpu0, "protect_cpu_s": cpu2 - cpu1, "restore_cpu_s": cpu3 - cpu2}


def run_nodes(counts: list[int], node_bytes: int) -> list[dict]:
    out = []
    for n in counts:
        with report.phase(f"nodes: {n} SMPs in EC groups of 2 (m=1), {node_bytes // MIB} MiB per node"):
            out.append(measure_nodes(n, node_bytes))
    return out


def nodes_slope(rows: list[dict]) -> dict:
    """Least-squares seconds added per node, for each cost, wall and CPU."""
    xs = [r["nodes"] for r in rows]
    mx = statistics.fmean(xs)

    def fit(key):
        ys = [r[key] for r in rows]
        my = statistics.fmean(ys)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)

    return {f"{key}_s_per_node": fit(f"{key}_s") for key in ("commit", "protect", "restore", "rebuild", "commit_cpu",
                                                             "protect_cpu", "restore_cpu")}


# ---- report --------------------------------------------------------------------------------------------

def slope(rows: list[dict], key: str) -> float:
    """Least-squares seconds per GiB of `key` over the rows' bytes."""
    xs, ys = [r["bytes"] / GIB for r in rows], [r[key] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def format_results(res: dict) -> str:
    lines = [f"machine: {res['machine']['cores']} cores, load average {res['machine']['load_avg_1m']:.1f} at "
             f"start; medians of {res['config']['repeats']}"]
    if res.get("size"):
        rows = [{**r, "gib": r["bytes"] / GIB, "vs_floor": r["blocking_s"] / r["floor_s"]} for r in res["size"]]
        lines += report.table("state size (16 tensors, plain Snapshotter.save, one rank):",
                       [("GiB", "{gib:.2f}"), ("blocking s", "{blocking_s:.4f}"), ("commit s", "{commit_s:.4f}"),
                        ("floor s", "{floor_s:.4f}"), ("blocking/floor", "{vs_floor:.2f}")], rows)
        if len(rows) > 1:
            lines.append("  slope: " + ", ".join(f"{k.removesuffix('_s_per_GiB')} {v:.3f} s/GiB"
                                                 for k, v in res["size_slope"].items()))
    if res.get("tensors"):
        lines += report.table("tensor count (64 MiB in all):",
                       [("state", "{kind}"), ("tensors", "{tensors}"), ("blocking s", "{blocking_s:.4f}"),
                        ("commit s", "{commit_s:.4f}"), ("floor s", "{floor_s:.4f}"),
                        ("vs fewest", "{ratio_vs_fewest:.2f}"), ("vs floor", "{ratio_vs_floor:.2f}"),
                        ("overlap call s", "{overlap_call_s:.4f}")], res["tensors"])
        flat = [r for r in res["tensors"] if r["kind"] == "flat"]
        lines.append(f"  goal: blocking at {flat[-1]['tensors']} tensors <= {GOAL_TENSORS:g}x blocking at "
                     f"{flat[0]['tensors']}: {flat[-1]['ratio_vs_fewest']:.2f}x "
                     f"({'met' if flat[-1]['ratio_vs_fewest'] <= GOAL_TENSORS else 'NOT met'})")
    if res.get("ranks"):
        lines += report.table("ranks per node (one SMP, each rank saving its own state at the same moment):",
                       [("ranks", "{ranks}"), ("blocking s", "{blocking_s:.4f}"), ("commit s", "{commit_s:.4f}"),
                        ("vs 1 rank", "{ratio_vs_one_rank:.2f}"), ("node GB/s", "{node_GBps:.2f}")], res["ranks"])
    if res.get("protect"):
        rows = [{**r, "mib": r["node_bytes"] // MIB, "parity_mib": r["parity_bytes_per_node"] / MIB}
                for r in res["protect"]]
        lines += report.table("protection (commit -> protected on every node, loopback):",
                       [("G", "{nodes}"), ("m", "{m}"), ("MiB/node", "{mib}"), ("parity MiB", "{parity_mib:.1f}"),
                        ("protect s", "{protect_s:.3f}"), ("vs smallest", "{ratio_vs_smallest:.2f}")], rows)
    if res.get("nodes"):
        rows = [{**r, "mib": r["node_bytes"] // MIB} for r in res["nodes"]]
        lines += report.table("per-node costs vs nodes in the job (EC groups of 2, m=1; wall s, and the SMP's CPU s):",
                       [("nodes", "{nodes}"), ("MiB/node", "{mib}"), ("commit s", "{commit_s:.4f}"),
                        ("protect s", "{protect_s:.3f}"), ("restore s", "{restore_s:.4f}"),
                        ("rebuild s", "{rebuild_s:.3f}"), ("commit cpu", "{commit_cpu_s:.3f}"),
                        ("protect cpu", "{protect_cpu_s:.3f}"), ("restore cpu", "{restore_cpu_s:.3f}")], rows)
        if res.get("nodes_slope"):
            lines.append("  slope per added node: " + ", ".join(f"{k} {v:+.4f} s" for k, v in res["nodes_slope"].items()))
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One panel per section the run measured (--only runs some).
    sections = [name for name in ("size", "tensors", "ranks", "protect", "nodes") if res.get(name)]
    rows = 1 if len(sections) <= 2 else 2
    cols = -(-len(sections) // rows)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax in list(axes.flat)[len(sections):]:
        ax.set_visible(False)
    panel = dict(zip(sections, axes.flat))
    if "size" in panel:
        ax = panel["size"]
        x = [r["bytes"] / GIB for r in res["size"]]
        for key, label in (("blocking_s", "blocking"), ("commit_s", "commit"), ("floor_s", "floor (torch.cat)")):
            ax.plot(x, [r[key] for r in res["size"]], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("state per rank (GiB, 16 tensors)")
        ax.set_ylabel("seconds per snapshot")
        ax.set_title("state size")
        ax.legend()
    if "tensors" in panel:
        ax = panel["tensors"]
        for kind, style in (("flat", "-"), ("adam", "--")):
            rows = [r for r in res["tensors"] if r["kind"] == kind]
            x = [r["tensors"] for r in rows]
            ax.plot(x, [r["blocking_s"] for r in rows], style, marker="o", label=f"blocking ({kind})")
            ax.plot(x, [r["commit_s"] for r in rows], style, marker="s", label=f"commit ({kind})")
            ax.plot(x, [r["overlap_call_s"] for r in rows], style, marker="^", label=f"save() call, overlap ({kind})")
        rows = [r for r in res["tensors"] if r["kind"] == "flat"]
        ax.plot([r["tensors"] for r in rows], [r["floor_s"] for r in rows], ":", color="gray", label="floor")
        ax.axhline(GOAL_TENSORS * rows[0]["blocking_s"], color="red", lw=0.8, label="goal (2x at 10 tensors)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tensors (64 MiB in all)")
        ax.set_title("tensor count")
        ax.legend(fontsize=7)
    if "ranks" in panel:
        ax = panel["ranks"]
        x = [r["ranks"] for r in res["ranks"]]
        ax.plot(x, [r["blocking_s"] for r in res["ranks"]], marker="o", label="blocking (slowest rank)")
        ax.plot(x, [r["commit_s"] for r in res["ranks"]], marker="s", label="commit (slowest rank)")
        ax.set_xlabel(f"ranks sharing one SMP ({res['ranks'][0]['bytes_per_rank'] // MIB} MiB each, "
                      f"{res['machine']['cores']} cores)")
        ax.set_ylabel("seconds per snapshot")
        ax.set_title("ranks per node")
        ax.legend()
    if "protect" in panel:
        ax = panel["protect"]
        for m in sorted({r["m"] for r in res["protect"]}):
            rows = [r for r in res["protect"] if r["m"] == m]
            ax.plot([r["nodes"] for r in rows], [r["protect_s"] for r in rows], marker="o", label=f"m = {m}")
        ax.set_xlabel(f"EC group size G ({res['protect'][0]['node_bytes'] // MIB} MiB per node)")
        ax.set_ylabel("commit -> protected (s)")
        ax.set_title("erasure-coding groups")
        ax.legend()
    if "nodes" in panel:
        ax = panel["nodes"]
        x = [r["nodes"] for r in res["nodes"]]
        for key in ("commit_s", "protect_s", "restore_s", "rebuild_s"):
            ax.plot(x, [r[key] for r in res["nodes"]], marker="o", label=key[:-2])
        ax.set_xlabel(f"nodes, one SMP each, EC groups of 2 ({res['nodes'][0]['node_bytes'] // MIB} MiB per node)")
        ax.set_ylabel("seconds")
        ax.set_title("nodes in the job")
        ax.legend()
    fig.suptitle(f"inmem_ft scaling, {res['machine']['cores']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="sizes up to 1 GiB, fewer configurations and repeats "
                                                        "(a few minutes on 2 cores)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON here")
    p.add_argument("--plot", metavar="PNG", help="draw the four curves here (needs matplotlib)")
    p.add_argument("--only", default="size,tensors,ranks,protect,nodes", help="comma-separated sections to run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rank-bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        rank_worker(args)
        return 0
    only = set(args.only.split(","))
    unknown = only - {"size", "tensors", "ranks", "protect", "nodes"}
    if unknown:
        p.error(f"--only: unknown sections {sorted(unknown)}; choose from size, tensors, ranks, protect, nodes")
    quick = args.quick
    repeats = 5 if quick else 9
    res = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "load_avg_1m": os.getloadavg()[0]},
           "config": {"quick": quick, "repeats": repeats}}
    import torch

    # One intra-op thread, as torchrun gives each rank: on a shared machine a parallel copy waits for its
    # slowest thread, which makes single measurements jump by 10x.
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["INMEM_FT_RUNTIME_DIR"] = os.path.join(tmp, "run")
        if "size" in only:
            sizes = [64 * MIB, 256 * MIB, GIB] + ([] if quick else [2 * GIB, 4 * GIB])
            res["size"] = run_sizes(sizes, repeats, tmp)
            if len(res["size"]) > 1:
                res["size_slope"] = {f"{k}_per_GiB": slope(res["size"], k) for k in ("blocking_s", "commit_s", "floor_s")}
        if "tensors" in only:
            res["tensors"] = run_tensors([10, 100, 1000, 10_000, 100_000], repeats, tmp)
        if "ranks" in only:
            res["ranks"] = run_ranks([1, 2, 4, 8], 3 if quick else 7, (16 if quick else 64) * MIB, tmp)
        if "protect" in only:
            res["protect"] = run_protect([2, 4, 8] if quick else [2, 3, 4, 6, 8], [1, 2],
                                         (16 if quick else 64) * MIB)
        if "nodes" in only:
            res["nodes"] = run_nodes([2, 4] if quick else [2, 4, 6, 8], (64 if quick else 128) * MIB)
            res["nodes_slope"] = nodes_slope(res["nodes"])
    print(format_results(res))
    report.write(res, args.json, plot, args.plot)
    return 0


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)  # exits with main's code; a worker's process groups are destroyed on every path (issue 23)
