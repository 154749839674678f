"""What every benchmark does with its results: JSON for machines (with where, when, on which commit and by
which command it was measured, so benchmarks/render.py can say so beside every figure), a PNG for people; and
the progress lines that keep a run of several minutes from going silent."""
import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The load when the benchmark started: on a shared machine it says more about a figure than the core count.
_LOAD_AT_START = os.getloadavg()[0]

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


def worker_args(parser) -> None:
    """The hidden arguments by which a benchmark runs its own script as each rank's worker."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=None, help=argparse.SUPPRESS)


def table(title: str, columns: list[tuple[str, str]], rows: list[dict]) -> list[str]:
    """The lines of a text table under `title`: `columns` are (header, format of a row's fields, such as
    "{blocking_s:.4f}"), one row a dict."""
    cells = [[fmt.format(**row) for _, fmt in columns] for row in rows]
    widths = [max(len(head), *(len(c[i]) for c in cells)) for i, (head, _) in enumerate(columns)]
    return [title] + ["  " + "  ".join(c.rjust(w) for c, w in zip(line, widths))
                      for line in [[head for head, _ in columns]] + cells]


def _relative(value):
    """Paths inside the repository as repository-relative ones: a result file names no machine's folders."""
    if isinstance(value, dict):
        return {k: _relative(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_relative(v) for v in value]
    if isinstance(value, str) and value.startswith(REPO + os.sep):
        return os.path.relpath(value, REPO)
    return value


def write(results: dict, json_path: str | None, plot=None, plot_path: str | None = None) -> None:
    results.update(_relative(results), meta=meta())
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
    return f"{cpu_model()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end"


def meta() -> dict:
    """Where, when and how the figures were measured: the machine (no host name), the UTC date, the commit
    (`-dirty` when the work tree had changes) and the command line, relative to the repository."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
    return {"benchmark": os.path.splitext(os.path.basename(script))[0],
            "command": shlex.join(["python", script, *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": _COMMIT_AT_START,
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": round(memory_bytes() / 2**30),
                        "gpu": gpu_name(), "load_average": [round(_LOAD_AT_START, 1), round(os.getloadavg()[0], 1)],
                        "python": platform.python_version(), "os": f"{platform.system()} {platform.release()}"}}


def commit() -> str | None:
    """HEAD, with `-dirty` when the code measured (inmem_ft/, benchmarks/) differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no", "--", "inmem_ft", "benchmarks", ":!benchmarks/render.py", ":!benchmarks/results") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gpu_name() -> str | None:
    """The GPU, if the benchmark itself imported torch and one is there (never imports torch for this)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


_COMMIT_AT_START = commit()  # the code that ran, not what the tree holds when the run ends
