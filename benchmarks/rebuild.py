"""Rebuilding a lost node: seconds and peak memory of the replacement SMP against the node's size.

    python benchmarks/rebuild.py [--quick] [--sizes MiB,...] [--piece BYTES] [--compare-with CHECKOUT]
                                 [--json OUT] [--plot PNG]

A 4-node EC group (m=1, one rank per node) of real SMP processes on loopback; every node commits one slot of
the given size, the step is protected, then node 1 is lost (SIGKILL, segments unlinked) and a replacement SMP
started. The clock runs from starting the replacement until its status says the rebuild is done; `rebuild_s`
is the rebuild's own figure (its event=rebuilt line). Memory is sampled from /proc/<pid>/status every 10 ms
while it rebuilds: `peak_rss` is VmHWM (its segments count, as it touches them), `peak_anon` the highest
RssAnon seen (private memory: Python, buffers, anything held beside the segments). `anon_over_node` =
(peak_anon - its RssAnon once the rebuild is done) / node bytes: what the rebuild held beside its segments,
per byte of node; a constant number of MiB (the piece buffers) means nothing there grows with the node.

`--compare-with DIR` rebuilds the same node, on the same survivors, with the replacement SMP run from another
checkout (PYTHONPATH=DIR), e.g. a worktree of the commit before streaming rebuilds, so the two rows are
measured side by side.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # runs from a checkout without installing the package

import report  # noqa: E402  benchmarks/report.py

from inmem_ft.cluster import rebuild  # noqa: E402
from inmem_ft.launcher.simulated import SimulatedCluster  # noqa: E402
from inmem_ft.smp import control  # noqa: E402
from inmem_ft.smp.client import SMPClient  # noqa: E402
from inmem_ft.smp.segments import Segment  # noqa: E402
from inmem_ft.snapshot import segment as seg  # noqa: E402
from inmem_ft.snapshot.checksum import checksum, to_hex  # noqa: E402

MIB = 1 << 20
G, M, LOST = 4, 1, 1
FILL = 64 * MIB  # random bytes are generated this much at a time, straight into the slot


def commit(socket_path: str, rank: int, nbytes: int, seed: int) -> None:
    """One committed slot of `nbytes` random bytes, written in place (the benchmark holds no copy)."""
    manifest = {"format": seg.FORMAT, "rank": rank, "step": 1, "world_size": G,
                "leaves": [{"o": 0, "n": nbytes, "h": to_hex(0), "dt": "uint8", "sh": [nbytes]}]}
    raw = seg.encode_manifest(manifest)
    client = SMPClient(socket_path)
    try:
        reply = client.call("begin", rank=rank, step=1, manifest_len=len(raw), data_len=nbytes, keep_step=None)
        segment = Segment(reply["segment"])
        data = np.frombuffer(segment.buf, dtype=np.uint8, count=nbytes, offset=reply["data_off"])
        rng = np.random.default_rng(seed)
        for a in range(0, nbytes, FILL):
            data[a: a + FILL] = rng.integers(0, 256, min(FILL, nbytes - a), dtype=np.uint8)
        manifest["leaves"][0]["h"] = to_hex(checksum(data))
        segment.buf[seg.HEADER_SIZE: seg.HEADER_SIZE + len(raw)] = seg.encode_manifest(manifest)
        del data
        segment.close()
        client.call("commit", rank=rank, step=1)
    finally:
        client.close()


def proc_status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def rebuild_once(cluster, node_bytes: int, label: str, pythonpath: str | None) -> dict:
    cluster.lose_node(LOST)
    env = dict(cluster.env)
    if pythonpath:
        cluster.env = {**env, "PYTHONPATH": pythonpath}
    t0 = time.perf_counter()
    try:
        cluster.start_smp(LOST)
    finally:
        cluster.env = env
    pid = cluster.smps[LOST].pid
    peak_anon, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            try:
                peak_anon[0] = max(peak_anon[0], proc_status(pid)["RssAnon"])
            except (OSError, KeyError):
                return
            time.sleep(0.01)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    while True:
        state = control.call(cluster.socket_path(LOST), "status")["ec"]["rebuild"]
        if state != "running":
            break
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    if state != "ok":
        raise RuntimeError(f"{label}: the rebuild failed: {state}")
    status = proc_status(pid)
    idle_anon = status["RssAnon"]  # once done: the rebuild's buffers are freed, the SMP idles
    with open(cluster.smp_log(LOST)) as f:
        seconds = [float(s) for s in re.findall(r"event=rebuilt step=1 .*seconds=([0-9.]+)", f.read())]
    return {"label": label, "node_bytes": node_bytes, "wall_s": wall, "rebuild_s": seconds[-1] if seconds else None,
            "peak_rss": status["VmHWM"], "peak_anon": peak_anon[0], "idle_anon": idle_anon,
            "anon_over_node": (peak_anon[0] - idle_anon) / node_bytes, "rss_over_node": status["VmHWM"] / node_bytes}


def measure(node_bytes: int, piece: int | None, compare_with: str | None) -> list[dict]:
    os.environ.setdefault("INMEM_FT_SECRET", "benchmark-secret-" + "0" * 16)
    # SMPs run as `python -m inmem_ft.smp`, which imports from the working directory first: run them from an
    # empty one, so PYTHONPATH alone says which checkout each SMP runs.
    os.environ["PYTHONPATH"] = os.path.dirname(HERE)
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        os.environ["INMEM_FT_RUNTIME_DIR"] = os.path.join(tmp, "run")
        cluster = SimulatedCluster(G, 1, f"rebuild{os.getpid()}", 2 * node_bytes + 64 * MIB,
                                   os.path.join(tmp, "logs"), parity=M)
        if piece:
            cluster.ec = type(cluster.ec)(**{**cluster.ec.__dict__, "rebuild_piece": piece})
        cluster.start()
        try:
            for node in range(G):
                commit(cluster.socket_path(node), node, node_bytes, seed=node)
            for node in range(G):
                control.call(cluster.socket_path(node), "complete", step=1)
            deadline = time.monotonic() + 600
            while any(control.call(cluster.socket_path(n), "status")["ec"]["protected_step"] != 1 for n in range(G)):
                if time.monotonic() > deadline:
                    raise RuntimeError("step 1 was not protected within 600 s")
                time.sleep(0.05)
            rows = []
            if compare_with:
                rows.append(rebuild_once(cluster, node_bytes, "whole node (--compare-with)", compare_with))
            rows.append(rebuild_once(cluster, node_bytes, "streamed (this checkout)", None))
            return rows
        finally:
            cluster.stop()
            os.chdir(cwd)


def run(sizes, piece, compare_with) -> dict:
    rows = []
    for size in sizes:
        with report.phase(f"rebuild of a {size} MiB node"):
            rows += measure(size * MIB, piece, compare_with)
    return {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "load_avg_1m": os.getloadavg()[0]},
            "config": {"G": G, "m": M, "piece": piece or rebuild.PIECE, "sizes_MiB": sizes,
                       "compare_with": compare_with},
            "rows": rows}


def format_table(results: dict) -> str:
    cfg = results["config"]
    rows = [{**r, "MiB": r["node_bytes"] // MIB, "rss_MiB": r["peak_rss"] / MIB, "anon_MiB": r["peak_anon"] / MIB,
             "rebuild": r["rebuild_s"] if r["rebuild_s"] is not None else float("nan")} for r in results["rows"]]
    return "\n".join(report.table(
        f"rebuild of node {LOST} of a G={cfg['G']}, m={cfg['m']} group on loopback, piece {cfg['piece'] // MIB} MiB, "
        f"{results['machine']['cores']} cores (load {results['machine']['load_avg_1m']:.1f})",
        [("node MiB", "{MiB}"), ("replacement", "{label}"), ("wall s", "{wall_s:.2f}"), ("rebuild s", "{rebuild:.2f}"),
         ("peak RSS MiB", "{rss_MiB:.0f}"), ("RSS/node", "{rss_over_node:.2f}"), ("peak anon MiB", "{anon_MiB:.0f}"),
         ("(anon-idle)/node", "{anon_over_node:.3f}")], rows))


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (t_ax, m_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    for label in dict.fromkeys(r["label"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["label"] == label]
        x = [r["node_bytes"] / MIB for r in rows]
        t_ax.plot(x, [r["wall_s"] for r in rows], "o-", label=label)
        m_ax.plot(x, [r["peak_rss"] / MIB for r in rows], "o-", label=f"{label}: peak RSS")
        m_ax.plot(x, [r["peak_anon"] / MIB for r in rows], "s--", label=f"{label}: peak anon")
    for ax, ylabel in ((t_ax, "seconds (start to rebuilt)"), (m_ax, "MiB")):
        ax.set_xlabel("node size, MiB")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    t_ax.set_title("rebuild time")
    m_ax.set_title("replacement SMP memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="nodes of 64 and 256 MiB (default 64, 256, 1024)")
    parser.add_argument("--sizes", help="node sizes in MiB, comma-separated (overrides --quick)")
    parser.add_argument("--piece", type=int, default=None, help="--rebuild-piece of the SMPs (default: theirs)")
    parser.add_argument("--compare-with", metavar="DIR", help="also rebuild with the SMP of the checkout in DIR")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON here")
    parser.add_argument("--plot", metavar="PNG", help="draw the figures here (needs matplotlib)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else ([64, 256] if args.quick else [64, 256, 1024])
    results = run(sizes, args.piece, args.compare_with)
    print(format_table(results))
    report.write(results, args.json, plot, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
