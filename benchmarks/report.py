"""What every benchmark does with its results: JSON for machines, a PNG for people; and the progress lines
that keep a run of several minutes from going silent."""
import json
import os
import platform
import sys
import tempfile
import time
from contextlib import contextmanager

# Workers run under a SimulatedCluster with their output in a log file; rank 0 prefixes its progress lines
# with this, and the parent echoes them while it waits.
PROGRESS = "[bench] "
STILL_RUNNING_EVERY_S = 60.0


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@contextmanager
def phase(name: str):
    """A line when a phase starts and one with its duration when it ends."""
    say(f"{name} ...")
    t0 = time.monotonic()
    yield
    say(f"{name}: done in {time.monotonic() - t0:.0f} s")


def echo_worker(cluster, name: str):
    """A SimulatedCluster.wait poll: echoes rank 0's progress lines of the running attempt, and says the
    phase is still running when rank 0 has said nothing for a minute."""
    return echo_log(lambda: cluster.rank_log(cluster.attempts, 0), name)


def echo_log(read_log, name: str):
    """The same for any log: `read_log()` returns its text so far (for workers run by another launcher)."""
    seen, quiet_since = [0], [0.0]

    def poll(seconds: float) -> None:
        lines = [line for line in read_log().splitlines() if line.startswith(PROGRESS)]
        for line in lines[seen[0]:]:
            say(f"  {name}: {line[len(PROGRESS):]} ({seconds:.0f} s)")
        if len(lines) > seen[0]:
            seen[0], quiet_since[0] = len(lines), seconds
        elif seconds - quiet_since[0] >= STILL_RUNNING_EVERY_S:
            quiet_since[0] = seconds
            say(f"  {name}: still running ({seconds:.0f} s)")

    return poll


def progress(text: str) -> None:
    """Worker side (call on rank 0): a progress line for the parent to echo."""
    print(PROGRESS + text, flush=True)


def table(title: str, columns: list[tuple[str, str]], rows: list[dict]) -> list[str]:
    """The lines of a text table under `title`: `columns` are (header, format of a row's fields, such as
    "{blocking_s:.4f}"), one row a dict."""
    cells = [[fmt.format(**row) for _, fmt in columns] for row in rows]
    widths = [max(len(head), *(len(c[i]) for c in cells)) for i, (head, _) in enumerate(columns)]
    return [title] + ["  " + "  ".join(c.rjust(w) for c, w in zip(line, widths))
                      for line in [[head for head, _ in columns]] + cells]


def write(results: dict, json_path: str | None, plot=None, plot_path: str | None = None) -> None:
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    if plot_path:
        os.makedirs(os.path.dirname(os.path.abspath(plot_path)), exist_ok=True)
        plot(results, plot_path)


def alternating(modes, repeat: int, run, label=lambda mode: mode) -> dict:
    """{mode: [run(mode, i, folder) for each repeat i]}: the modes alternate within each repeat, so that the
    machine's load hits them alike; each run gets a folder of its own, all in one temporary folder that also
    holds the runtime dir (sockets, logs)."""
    runs = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("INMEM_FT_RUNTIME_DIR", os.path.join(tmp, "run"))
        for i in range(repeat):
            for mode in modes:
                with phase(f"run {i + 1}/{repeat}, {label(mode)}"):
                    runs[mode].append(run(mode, i, os.path.join(tmp, f"{mode}{i}")))
    return runs


def machine() -> str:
    return f"{platform.node()}: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end"
