"""Erasure-coding throughput against memcpy, measured in the same run.

    python benchmarks/ec_throughput.py [--quick] [--json OUT] [--plot PNG]

For each code (k=4,m=2 and k=8,m=2) it times, interleaved so machine noise hits them all alike:
encoding all parity with one call split across the codec's threads (ec/parallel.py) and on one core,
decoding two lost data blocks (split), a numpy copy of the same data into a preallocated buffer (one
core), and xxh3 over it (the checksum every snapshot region carries). Figures are medians in GB/s (1e9 bytes) of data
bytes. The encode/memcpy ratio says whether parity keeps up with the copy that takes a snapshot
(target >= 1.0).

The MAC rows time the MAC every SMP-to-SMP payload carries (cluster/mac.py: AES-256-GMAC, fed in the
transport's pieces) next to RS(4,2) encoding of the same bytes, interleaved likewise, with the keyed hashes
it was chosen over: hashlib.blake2b (stdlib) and BLAKE3 (the `blake3` package; its row where that is
installed). `MAC time / encode time` is what authenticating a byte costs next to encoding it.

`protect_s` is end to end: a 4-node group of real SMP processes on loopback (one rank per node, m=2),
each node commits a snapshot, the job declares it complete, and the clock stops when every SMP
reports it protected (parity pulled over authenticated TCP, encoded and sealed on all four).

`run()` returns one dict of results, keyed by measurement; further measurements add their own key.
"""

import argparse
import hashlib
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

# Runs from a checkout without installing the package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from inmem_ft.cluster import mac, transport  # noqa: E402
from inmem_ft.ec.codec import RSCodec  # noqa: E402
from inmem_ft.ec.isal import LIB_PATH  # noqa: E402
from inmem_ft.launcher.simulated import SimulatedCluster  # noqa: E402
from inmem_ft.smp import control  # noqa: E402
from inmem_ft.smp.client import SMPClient  # noqa: E402
from inmem_ft.smp.segments import Segment  # noqa: E402
from inmem_ft.snapshot import segment as seg  # noqa: E402
from inmem_ft.snapshot.checksum import checksum, to_hex  # noqa: E402

import report  # benchmarks/report.py (the script's own folder is on sys.path)

CODES = ((4, 2), (8, 2))
TARGET_RATIO = 1.0
MIB = 1 << 20


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_code(k, m, data, repeats):
    """Median encode/decode/memcpy/xxh3 GB/s of the k blocks in `data`, all outputs preallocated."""
    codec, one_core = RSCodec(k, m), RSCodec(k, m, workers=1)
    blocks = np.split(data, k)
    parity = [np.empty_like(blocks[0]) for _ in range(m)]
    lost = [0, 1]
    survivors = {i: b for i, b in enumerate(blocks + parity) if i not in lost}
    rebuilt = {i: np.empty_like(blocks[0]) for i in lost}
    copy = np.empty_like(data)

    def encode():
        codec.encode(blocks, parity)

    def encode_1core():
        one_core.encode(blocks, parity)

    def decode():
        codec.decode(survivors, lost, rebuilt)

    def memcpy():
        np.copyto(copy, data)

    def xxh3():
        checksum(data)

    fns = {"memcpy": memcpy, "encode": encode, "encode_1core": encode_1core, "decode": decode, "xxh3": xxh3}
    # Warm-up: faults in the output pages and builds the codec tables, then checks the round trip.
    for fn in fns.values():
        fn()
    if not all(np.array_equal(rebuilt[i], blocks[i]) for i in lost):
        raise AssertionError(f"RS(k={k},m={m}) decode did not reproduce the lost blocks")
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_timed(fn))
    gbps = {name: data.nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    return {
        "k": k,
        "m": m,
        "threads": codec.workers,
        **{f"{name}_GBps": value for name, value in gbps.items()},
        "ratio_encode_vs_memcpy": gbps["encode"] / gbps["memcpy"],
        "ratio_encode_1core_vs_memcpy": gbps["encode_1core"] / gbps["memcpy"],
        "meets_target": gbps["encode"] / gbps["memcpy"] >= TARGET_RATIO,
    }


MAC_CODE = (4, 2)
MAC_KEY = bytes(range(mac.KEY_SIZE))


def _mac_variants():
    """(name, label, make a fresh hasher with update/digest): the chosen MAC and the alternatives."""
    variants = [("AES-GMAC", "AES-256-GMAC (chosen)", lambda: mac.PayloadMAC(MAC_KEY, "c2s", 0)),
                ("blake2b", "hashlib.blake2b keyed", lambda: hashlib.blake2b(key=MAC_KEY))]
    try:
        import blake3
    except ImportError:
        return variants  # not a dependency: its row only where it is installed
    return variants + [("BLAKE3", "BLAKE3 keyed, 1 thread", lambda: blake3.blake3(key=MAC_KEY))]


def measure_mac(data, repeats):
    """Median GB/s of each MAC and of RS(4,2) encode over the same bytes, interleaved."""
    k, m = MAC_CODE
    codec = RSCodec(k, m)
    blocks = np.split(data, k)
    parity = [np.empty_like(blocks[0]) for _ in range(m)]
    view = memoryview(data)

    def pieces(make):
        h = make()
        for off in range(0, len(view), transport.PIECE):
            h.update(view[off: off + transport.PIECE])
        return h.digest()

    variants = _mac_variants()
    fns = {"encode": lambda: codec.encode(blocks, parity),
           **{name: (lambda make=make: pieces(make)) for name, _, make in variants}}
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_timed(fn))
    gbps = {name: data.nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    return {"code": list(MAC_CODE), "encode_GBps": gbps["encode"],
            "variants": [{"name": name, "label": label, "GBps": gbps[name],
                          "time_vs_encode": gbps["encode"] / gbps[name]} for name, label, _ in variants]}


def _commit(socket_path, rank, step, data):
    manifest = {"rank": rank, "step": step, "world_size": 4,
                "leaves": [{"o": 0, "n": data.nbytes, "h": to_hex(checksum(data)), "dt": "uint8", "sh": [data.nbytes]}]}
    raw = seg.encode_manifest(manifest)
    client = SMPClient(socket_path)
    try:
        reply = client.call("begin", rank=rank, step=step, manifest_len=len(raw), data_len=data.nbytes,
                            keep_step=None, reserve=True)
        segment = Segment(reply["segment"])
        segment.buf[seg.HEADER_SIZE: seg.HEADER_SIZE + len(raw)] = raw
        segment.buf[reply["data_off"]: reply["data_off"] + data.nbytes] = data
        segment.close()
        client.call("commit", rank=rank, step=step)
    finally:
        client.close()


def measure_protect(node_bytes, m=2, nodes=4):
    """Seconds from a step's completion to it being protected on every node of the group."""
    os.environ.setdefault("INMEM_FT_SECRET", "benchmark-secret-" + "0" * 16)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["INMEM_FT_RUNTIME_DIR"] = os.path.join(tmp, "run")
        cluster = SimulatedCluster(nodes, 1, f"bench{os.getpid()}", 4 * node_bytes + (64 << 20),
                                   os.path.join(tmp, "logs"), parity=m).start()
        try:
            data = np.random.default_rng(1).integers(0, 256, node_bytes, dtype=np.uint8)
            for node in range(nodes):
                _commit(cluster.socket_path(node), node, 1, data[::-1].copy() if node % 2 else data)
            start = time.perf_counter()
            for node in range(nodes):
                control.call(cluster.socket_path(node), "complete", step=1)
            pending = set(range(nodes))
            while pending:
                pending = {n for n in pending
                           if control.call(cluster.socket_path(n), "status")["ec"]["protected_step"] != 1}
                time.sleep(0.005)
            elapsed = time.perf_counter() - start
        finally:
            cluster.stop()
    return {"nodes": nodes, "m": m, "node_bytes": node_bytes, "protect_s": elapsed}


def run(quick):
    size = (64 if quick else 256) * MIB
    repeats = 5 if quick else 11
    # float32 like a real snapshot; the content does not change ISA-L's speed.
    data = np.random.default_rng(0).random(size // 4, dtype=np.float32).view(np.uint8)
    return {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "isal": LIB_PATH,
                    "load_avg_1m": os.getloadavg()[0]},
        "config": {"data_bytes": size, "repeats": repeats, "quick": quick, "target_ratio": TARGET_RATIO},
        "ec_throughput": [timed_phase(f"RS({k},{m}) encode/decode vs memcpy, {size // MIB} MiB x {repeats}",
                                      measure_code, k, m, data, repeats) for k, m in CODES],
        "mac": timed_phase(f"payload MAC vs RS({MAC_CODE[0]},{MAC_CODE[1]}) encode, {size // MIB} MiB x {repeats}",
                           measure_mac, data, repeats),
        "protect": timed_phase("protect_s: 4-node group on loopback", measure_protect, 64 * MIB),
    }


def timed_phase(name, fn, *args):
    with report.phase(name):
        return fn(*args)


def format_table(results):
    cfg = results["config"]
    target = f"keeps up (encode/memcpy >= {cfg['target_ratio']})"
    threads = results["ec_throughput"][0]["threads"]
    head = ("code", f"encode GB/s ({threads} thr)", "encode 1 core", "decode(2 lost)", "memcpy", "xxh3",
            "encode/memcpy", "1 core/memcpy", target)
    rows = [
        (
            f"RS({r['k']},{r['m']})",
            f"{r['encode_GBps']:.2f}",
            f"{r['encode_1core_GBps']:.2f}",
            f"{r['decode_GBps']:.2f}",
            f"{r['memcpy_GBps']:.2f}",
            f"{r['xxh3_GBps']:.2f}",
            f"{r['ratio_encode_vs_memcpy']:.2f}",
            f"{r['ratio_encode_1core_vs_memcpy']:.2f}",
            "yes" if r["meets_target"] else "NO",
        )
        for r in results["ec_throughput"]
    ]
    lines = [f"{cfg['data_bytes'] // MIB} MiB of data, median of {cfg['repeats']}, ISA-L {results['machine']['isal']}"]
    lines += _aligned(head, rows)
    macs = results["mac"]
    k, m = macs["code"]
    rows = [(v["label"], f"{v['GBps']:.2f}", f"{v['time_vs_encode']:.2f}") for v in macs["variants"]]
    rows.append((f"RS({k},{m}) encode, for reference", f"{macs['encode_GBps']:.2f}", "1.00"))
    lines += _aligned(("payload MAC", "GB/s", f"MAC time / RS({k},{m}) encode time"), rows)
    p = results["protect"]
    lines.append(f"protect_s (commit -> protected, {p['nodes']}-node group on loopback, m={p['m']}, "
                 f"{p['node_bytes'] // MIB} MiB per node): {p['protect_s']:.3f} s")
    return "\n".join(lines)


def _aligned(head, rows):
    widths = [max(len(row[i]) for row in [head] + rows) for i in range(len(head))]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [head] + rows]


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["ec_throughput"]
    series = (("encode_GBps", f"encode ({rows[0]['threads']} threads)"), ("encode_1core_GBps", "encode (1 core)"),
              ("decode_GBps", "decode (2 lost)"), ("memcpy_GBps", "memcpy (1 core)"), ("xxh3_GBps", "xxh3"))
    x = np.arange(len(rows))
    width = 0.8 / len(series)
    fig, (ax, mac_ax) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    for i, (key, label) in enumerate(series):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, [r[key] for r in rows], width, label=label)
    ax.set_xticks(x, [f"RS(k={r['k']}, m={r['m']})" for r in rows])
    ax.set_ylabel("GB/s of data (median)")
    ax.set_title(f"ISA-L erasure coding vs memcpy, {results['config']['data_bytes'] // MIB} MiB, "
                 f"{results['machine']['cores']} cores")
    ax.legend(fontsize=7)
    macs = results["mac"]
    k, m = macs["code"]
    names = [v["name"] for v in macs["variants"]] + [f"RS({k},{m}) encode"]
    mac_ax.bar(names, [v["GBps"] for v in macs["variants"]] + [macs["encode_GBps"]],
               color=["C3"] + ["C7"] * (len(names) - 2) + ["C0"])
    mac_ax.set_ylabel("GB/s (median)")
    mac_ax.set_title("payload MAC vs encode, 1 core")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB, 5 repeats (a few seconds); default 256 MiB, 11")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON here")
    parser.add_argument("--plot", metavar="PNG", help="draw a bar chart here (needs matplotlib)")
    args = parser.parse_args(argv)
    results = run(args.quick)
    print(format_table(results))
    report.write(results, args.json, plot, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
