"""The SMP's state for Prometheus: an HTTP /metrics endpoint (--metrics-port) and a file for node_exporter's
textfile collector (--metrics-textfile), both read from SMP.status() at each scrape or write, so the metrics
and `inmem-ft smp status` always say the same thing and no counter of their own can drift from it.

prometheus_client is imported only when one of them is asked for: the CLI and a daemon without metrics
start without it.
"""
from __future__ import annotations

import argparse
import logging
import os
import threading

from .. import argtypes
from ..errors import ConfigError

log = logging.getLogger("inmem_ft.smp")
TEXTFILE_EVERY_S = 5.0  # node_exporter reads the file at each of its scrapes, typically every 15 s or more


# --metrics-port: a TCP port, 0 for none
port = argtypes.bounded(int, "port {text!r} must be an integer from 1 to 65535, or 0 for no endpoint", minimum=0,
                        maximum=65535)


def add_metrics_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=port, default=0, metavar="PORT",
                   help="serve the SMP's state for Prometheus on http://ADDR:PORT/metrics (default: 0, none)")
    p.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                   help="address the metrics endpoint listens on; 0.0.0.0 lets other hosts scrape it "
                        "(default: %(default)s, this host only)")
    p.add_argument("--metrics-textfile", default=None, metavar="PATH",
                   help=f"also write the metrics to PATH every {TEXTFILE_EVERY_S:.0f} s, atomically, for "
                        f"node_exporter's textfile collector (name it *.prom in its directory; default: none)")


def metrics_argv(args) -> list[str]:
    """The daemon's arguments for the metrics `args` asks for (inmem-ft smp start passes them on)."""
    out = []
    if args.metrics_port:
        out += ["--metrics-port", str(args.metrics_port), "--metrics-addr", args.metrics_addr]
    if args.metrics_textfile:
        out += ["--metrics-textfile", os.path.abspath(args.metrics_textfile)]
    return out


def _gauges(status: dict):
    """(name, help, value, extra labels) of every gauge; steps, ages and lags not known yet are left out."""
    yield "budget_bytes", "shared memory the SMP may use", status["budget"], {}
    yield "used_bytes", "shared memory the SMP's slots and parity use", status["used"], {}
    yield "uptime_seconds", "seconds since the SMP started", status["uptime_s"], {}
    yield "complete_step", "newest step the trainers reported complete on every rank", status["complete_step"], {}
    yield "held_step", "newest step every rank that runs on this node holds committed", status["held_step"], {}
    yield "held_step_age_seconds", "seconds since the last rank committed the held step", status["held_age_s"], {}
    yield "bad_steps", "snapshot steps found bad (after a restore, or replicas that disagreed): never restored again", len(status["bad_steps"]), {}
    for rank in status["ranks"]:
        labels = {"rank": str(rank["rank"])}
        committed = [s for s in rank["slots"] if s["state"] == "committed"]
        for state in ("committed", "writing", "empty"):
            yield ("rank_slots", "the rank's slots in each state", sum(s["state"] == state for s in rank["slots"]),
                   {**labels, "state": state})
        yield "rank_slot_bytes", "shared memory the rank's slots hold", sum(s["capacity"] for s in rank["slots"]), \
            labels
        newest = max(committed, key=lambda s: s["step"], default=None)
        yield ("rank_snapshot_bytes", "bytes of the rank's newest committed snapshot",
               newest["bytes"] if newest else None, labels)
        yield "rank_step", "the rank's newest committed step", newest["step"] if newest else None, labels
    ec = status["ec"]
    if ec:
        yield "ec_protected_step", "newest step the EC group protects", ec["protected_step"], {}
        yield "ec_lag_seconds", "seconds from complete to protected, of the newest protected step", ec["ec_lag_s"], {}
        yield "ec_parity_bytes", "shared memory this node's parity uses", ec["parity_bytes"], {}
        yield "ec_degraded", "1 while this node's newest steps are not protected against a node loss", \
            int(ec["degraded"] is not None), {}
        yield "ec_rebuild_running", "1 while this node rebuilds its slots from its EC group", \
            int(ec["rebuild"] == "running"), {}
    disk = status["disk"]
    if disk:
        yield "disk_flushed_step", "newest step this node flushed to the disk tier", disk["flushed_step"], {}
        yield "disk_flush_lag_seconds", "seconds from complete to on disk, of the last flush", disk["flush_lag_s"], {}
    for link in status["peers"]:
        if link["state"] != "unknown":  # never called yet: neither up nor down
            yield "peer_up", "1 if the last call to the peer node's SMP was answered, 0 if not", \
                int(link["state"] == "up"), {"peer": str(link["node"])}


def _counters(status: dict):
    """(name, help, value) of every counter (since the SMP started)."""
    counts = status["counters"]
    yield "commits", "snapshots committed", counts["commits"]
    yield "skipped", "snapshots skipped: both of a rank's slots held steps that must survive", counts["skipped"]
    yield "torn", "slots discarded torn: a write that never committed", counts["torn"]
    yield "corrupt", "slots discarded corrupt: a checksum failed", counts["corrupt"]
    yield "sentinel_trips", "restored steps the check after a restore found bad", counts["sentinel_trips"]
    yield "replica_mismatches", "snapshot steps whose data-parallel replicas disagreed", counts["replica_mismatches"]
    if status["ec"]:
        yield "ec_rebuilds", "rebuilds of this node's slots from its EC group that finished", status["ec"]["rebuilds"]
    if status["disk"]:
        yield "disk_flush_failures", "flushes to the disk tier that failed", status["disk"]["flush_failures"]


class StatusCollector:
    """A prometheus_client collector that turns one SMP.status() into metrics at each collect."""

    def __init__(self, status):
        self.status = status  # a callable: SMP.status

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        status = self.status()
        base = {"job": status["job"], "node": str(status["node"])}
        families = {}
        for name, text, value, extra in _gauges(status):
            if value is None:
                continue
            labels = {**base, **extra}
            family = families.get(name)
            if family is None:
                family = families[name] = GaugeMetricFamily(f"inmem_ft_{name}", text, labels=list(labels))
            family.add_metric(list(labels.values()), value)
        for name, text, value in _counters(status):
            family = families[name] = CounterMetricFamily(f"inmem_ft_{name}", text, labels=list(base))
            family.add_metric(list(base.values()), value)
        yield from families.values()


class Exporter:
    """The endpoint and/or the textfile of one SMP, until close()."""

    def __init__(self, status, port: int = 0, addr: str = "127.0.0.1", textfile: str | None = None):
        try:
            from prometheus_client import CollectorRegistry
        except ImportError:
            raise ConfigError("--metrics-port/--metrics-textfile need prometheus_client: pip install "
                              "prometheus_client") from None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatusCollector(status))
        self.textfile, self.server = textfile, None
        self._stop, self._writer = threading.Event(), None
        if textfile:
            self._write()  # now: a path it cannot write is a setup error, said before the SMP is up
            self._writer = threading.Thread(target=self._write_every, name="inmem_ft-metrics-textfile", daemon=True)
            self._writer.start()
        if port:
            from prometheus_client import start_http_server

            try:
                self.server, _ = start_http_server(port, addr, self.registry)
            except OSError as e:
                self.close()
                raise ConfigError(f"--metrics-port {port}: cannot listen on {addr}:{port}: {e.strerror or e}; give a "
                                  f"free port, or 0 for no endpoint") from None
            log.info("smp event=metrics url=http://%s:%d/metrics", addr, port)

    def _write(self) -> None:
        from prometheus_client import write_to_textfile

        try:
            write_to_textfile(self.textfile, self.registry)  # a temporary file beside it, then a rename
        except OSError as e:
            raise ConfigError(f"--metrics-textfile {self.textfile}: {e.strerror or e}; give a path in a writable "
                              f"directory (node_exporter's --collector.textfile.directory)") from None

    def _write_every(self) -> None:
        while not self._stop.wait(TEXTFILE_EVERY_S):
            try:
                self._write()
            except ConfigError as e:  # a disk that filled up: say it, keep the SMP serving, try again
                log.error("smp event=metrics_textfile_failed reason=%s", e)

    def close(self) -> None:
        """Stop serving; remove the textfile, so that node_exporter stops reporting an SMP that is gone."""
        self._stop.set()
        if self._writer is not None:
            self._writer.join()  # a write finishing after the unlink below would leave the file behind
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        if self.textfile:
            try:
                os.unlink(self.textfile)
            except FileNotFoundError:
                pass
