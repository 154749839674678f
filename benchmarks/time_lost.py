"""Time lost per failure through the shipped SLURM script: a killed rank under torch's cold restart alone
(INMEM_FT_AGENT=torchrun: `inmem-ft run` with hang detection and standbys off), under
`inmem-ft run` with its warm standbys off and on (and on with torch's own 1 s rendezvous poll instead of the
agent's scaled one), a hung rank under `inmem-ft run` (detection included), a killed SMP (the agent starts a new
one, which adopts the snapshots, and restarts the ranks), a rank killed early (at the first step trained, before
the standbys are ready: no cold start where the zygote forks them), and a second kill 10 s after the first
(the restart used the standbys up: forks replace them at once). And a node lost for good (issue 41): 3 nodes x 1
rank of `torchrun_inmem.sh`, node 2's SMP and rank SIGKILLed, then its agent: with `INMEM_FT_MIN_NODES=2` the
survivors shrink to 2 nodes after the spare wait, resharding from memory; with 3 the job waits for a replacement,
whose agent is started 30 s or 120 s after the loss (a simulated spare: an empty SMP that rebuilds the lost
node's snapshots from its EC group). The shrink's time lost ends at the step reached, but the job then trains on
2 nodes of 3 until a node joins: the steps' time before and after says at what rate.

    python benchmarks/time_lost.py [--repeat N] [--cases "A;B"] [--hang-timeout S] [--json OUT] [--plot PNG]
    python benchmarks/time_lost.py --quick --json benchmarks/results/time_lost_shrink.json  # the node losses, once

The demo model (the DeepSpeed GPT example, ZeRO-2, CPU, a snapshot every 5 steps) runs on 2 nodes x 2 ranks
submitted with `sbatch launch/slurm_inmem.sbatch` to a real SLURM started on this machine
(tests/slurm_cluster.py: a controller and two slurmd nodes); where SLURM cannot run, 2 nodes of
`torchrun_inmem.sh` on this machine instead (the result says which). Once training runs (with standbys: once both
nodes' standbys are ready), rank 3 gets SIGKILL, or SIGSTOP in the hang case, from outside. Every case is
measured alike from the loss log: from the signal until training is back at the step it had reached. Runs of
`inmem-ft run` also give its own split of that time (the failed node's time_lost.json). With --repeat the
cases alternate and the figures are medians.
"""
from __future__ import annotations

import argparse
import glob
import re
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # runs from a checkout without installing the package
sys.path.insert(1, os.path.join(ROOT, "tests"))  # tests/slurm_cluster.py: the real SLURM the tests use

from inmem_ft import events  # noqa: E402
from inmem_ft.launcher.ports import free_port  # noqa: E402
from inmem_ft.smp.segments import names_with_prefix, unlink  # noqa: E402
from slurm_cluster import SlurmCluster, unavailable  # noqa: E402

import report  # noqa: E402  benchmarks/report.py

# case -> (INMEM_FT_AGENT, INMEM_FT_STANDBYS, signal, INMEM_FT_RDZV_POLL, what is killed and when); "agent, torch's 1 s
# rendezvous poll" shows in one run what the agent's scaled poll (agent/rendezvous.py) saves
CASES = {"torchrun": ("torchrun", "0", signal.SIGKILL, "", "rank"),
         "agent, standbys off": ("inmem", "0", signal.SIGKILL, "", "rank"),
         "agent": ("inmem", "", signal.SIGKILL, "", "rank"), "agent, hang": ("inmem", "", signal.SIGSTOP, "", "rank"),
         "agent, torch's 1 s rendezvous poll": ("inmem", "", signal.SIGKILL, "1", "rank"),
         "agent, SMP killed": ("inmem", "", signal.SIGKILL, "", "smp"),
         "agent, early kill": ("inmem", "", signal.SIGKILL, "", "early"),
         "agent, second kill 10 s later": ("inmem", "", signal.SIGKILL, "", "second")}
# case -> seconds until the lost node's replacement starts; None: no replacement, the survivors shrink
NODE_LOSS = {"node lost, shrink": None, "node lost, spare after 30 s": 30.0, "node lost, spare after 120 s": 120.0}
LOSS_NODES, SPARE_WAIT_S = 3, 5  # the spare wait: torchrun_inmem.sh's default
SECOND_AFTER_S = 10.0
VICTIM = 3  # on the second node
INTERVAL = 5
SBATCH = ["sbatch", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=15", "--parsable"]
SBATCH_SCRIPT = os.path.join(ROOT, "launch", "slurm_inmem.sbatch")
NODE_SCRIPT = os.path.join(ROOT, "launch", "torchrun_inmem.sh")
WAIT_S = 600


class Slurm:
    """The job submitted to the SLURM cluster."""

    def __init__(self, cluster: SlurmCluster, work: str, env: dict, argv: list[str]):
        self.cluster, self.out = cluster, os.path.join(work, "slurm.out")
        proc = cluster.run(*SBATCH, f"--output={self.out}", SBATCH_SCRIPT, *argv, env={**env,
                                                                                      "SLURM_CONF": cluster.conf},
                           cwd=ROOT)
        self.id = proc.stdout.strip().split(";")[0]
        if not self.id.isdigit():
            raise SystemExit(f"sbatch failed: {proc.stderr}")

    def output(self) -> str:
        return _read(self.out)

    def stop(self) -> None:
        self.cluster.run("scancel", self.id)
        if not self.cluster.wait_until(lambda: self.cluster.job_field(self.id, "JobState") not in
                                       ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING"), 120):
            self.cluster.run("scancel", "--signal=KILL", "--full", self.id)


class Script:
    """Without SLURM: the node script run once per node on this machine (`node_env`: each node's own
    variables)."""

    def __init__(self, work: str, env: dict, argv: list[str], nodes: int = 2, node_env=lambda node: {}):
        self.work, self.env, self.argv, self.node_env = work, env, argv, node_env
        self.logs = [os.path.join(work, f"node{n}.out") for n in range(nodes)]
        self.procs: dict[int, subprocess.Popen] = {}
        for node in range(nodes):
            self.start(node)

    def start(self, node: int) -> None:
        """The node's script (again: a replacement node, its log appended to the lost one's)."""
        with open(self.logs[node], "a") as out:
            self.procs[node] = subprocess.Popen(
                ["bash", NODE_SCRIPT, *self.argv], env={**self.env, "NODE_RANK": str(node), **self.node_env(node)},
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.work)

    def output(self) -> str:
        return "".join(map(_read, self.logs))

    def stop(self) -> None:
        procs = list(self.procs.values())
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def one_run(case: str, work: str, cluster: SlurmCluster | None, hang_timeout: float) -> dict:
    if case in NODE_LOSS:
        return node_loss_run(work, NODE_LOSS[case])
    agent, standbys, signum, poll, what = CASES[case]
    job = f"b{uuid.uuid4().hex[:10]}"
    os.makedirs(work, exist_ok=True)
    loss_log = os.path.join(work, "loss.jsonl")
    runtime = os.environ["INMEM_FT_RUNTIME_DIR"]
    env = _env(job, runtime, 2, 2)
    env.update({"INMEM_FT_AGENT": agent, "INMEM_FT_HANG_TIMEOUT": f"{hang_timeout:g}"})
    if standbys:
        env["INMEM_FT_STANDBYS"] = standbys
    if poll:
        env["INMEM_FT_RDZV_POLL"] = poll
    argv = ["-m", "inmem_ft.examples.deepspeed_gpt", "--zero-stage", "2", "--steps", "100000", "--interval",
            str(INTERVAL), "--loss-log", loss_log]
    run = Slurm(cluster, work, env, argv) if cluster else Script(work, env, argv)
    try:
        if what == "early":
            _wait(lambda: _steps(loss_log), run, "the first step")
        elif standbys == "0":
            _wait(lambda: _steps(loss_log) and _steps(loss_log)[-1]["step"] >= 4 * INTERVAL, run, "training")
        else:
            _wait(lambda: len(_agent_events(runtime, job, "standbys_ready")) == 2, run, "both nodes' standbys ready")
        victim = _smp_pid(job, VICTIM // 2) if what == "smp" else _rank_pid(job, VICTIM)
        at = time.time()
        os.kill(victim, signum)
        if what == "second":  # the first kill's restart, then the restarted rank killed 10 s after the first
            time.sleep(max(0.0, at + SECOND_AFTER_S - time.time()))
            victim = _rank_pid(job, VICTIM, not_pid=victim)
            at = time.time()
            os.kill(victim, signum)
        _wait(lambda: _back_past(_steps(loss_log), at), run, "recovery")
    finally:
        run.stop()
        for seg in names_with_prefix(f"inmemft.{job}."):
            unlink(seg)
    lost, reached, restored = _recovery(_steps(loss_log), at)
    out = {"lost_s": lost, "reached_step": reached, "restored_step": restored}
    text = run.output()
    ready = _agent_events(runtime, job, "standbys_ready")
    if ready:
        out["standby_rss_mib"] = [int(x) for x in ready[0]["fields"]["rss_mib"].split(",")]
    if agent == "inmem":
        out["agent_split"] = _agent_split(_last_split(runtime, job, 1, f"{case}: the failed node", text))
    return out


def _last_split(runtime: str, job: str, node: int, who: str, output: str) -> dict:
    """The newest entry of the node's agent's time_lost.json."""
    splits = _read_json(os.path.join(runtime, job, f"agent-node{node}", "time_lost.json"))
    if not splits:
        raise SystemExit(f"{who}'s agent wrote no time_lost.json:\n{output[-3000:]}")
    return splits[-1]


def _agent_split(split: dict) -> dict:
    return {"total_s": split["total_s"], "parts": {p["part"]: p["seconds"] for p in split["parts"]},
            "starts": split["starts"], "failure": split["failure"]}


def _env(job: str, runtime: str, nodes: int, per_node: int) -> dict:
    """The node script's environment for a job of `nodes` x `per_node` ranks on this machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INMEM_FT_", "TORCHELASTIC_", "PET_"))}
    env.update({"PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), "PYTHONPATH": ROOT,
                "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "INMEM_FT_RUNTIME_DIR":
                runtime, "INMEM_FT_JOB": job, "INMEM_FT_MEMORY_BUDGET": "256MiB", "NNODES": str(nodes),
                "NPROC_PER_NODE": str(per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "INMEM_FT_WIPE_ON_EXIT": "1"})
    return env


def node_loss_run(work: str, spare_after: float | None) -> dict:
    """Node 2 of 3 lost for good (its SMP, rank and agent SIGKILLed, in that order) two steps past a snapshot:
    the survivors shrink (`spare_after` None) or wait for the replacement started `spare_after` s later. Standbys
    off (the replacement could have none warm). Time lost from the kill to the step reached, from rank 0's loss
    log; a survivor's agent split (node 1's time_lost.json, with the shrink's parts: its rank rebuilds the lost
    node's share from parity)."""
    job = f"b{uuid.uuid4().hex[:10]}"
    os.makedirs(work, exist_ok=True)
    loss_log = os.path.join(work, "loss.jsonl")
    runtime = os.environ["INMEM_FT_RUNTIME_DIR"]
    first = free_port(LOSS_NODES)
    env = _env(job, runtime, LOSS_NODES, 1)
    env.update({"INMEM_FT_STANDBYS": "0", "INMEM_FT_SECRET": f"time-lost-{job}-0123456789",
                "INMEM_FT_MIN_NODES": str(LOSS_NODES - 1 if spare_after is None else LOSS_NODES),
                "INMEM_FT_SPARE_WAIT": str(SPARE_WAIT_S),
                "INMEM_FT_SMP_ARGS": f"--parity 1 --nodes {LOSS_NODES} --group-size {LOSS_NODES} --peers "
                                     + ",".join(f"{n}=127.0.0.1:{first + n}" for n in range(LOSS_NODES))})
    # a global batch of 12 divides over 3 and 2 data-parallel ranks: the shrink keeps it (accumulation 2 -> 3)
    argv = ["-m", "inmem_ft.examples.deepspeed_gpt", "--zero-stage", "2", "--steps", "100000", "--interval",
            str(INTERVAL), "--global-batch", "12", "--micro-batch", "2", "--loss-log", loss_log]
    lost = LOSS_NODES - 1
    run = Script(work, env, argv, LOSS_NODES, lambda node: {"INMEM_FT_LOCAL_ADDR": f"127.0.1.{100 + node}"})
    try:
        _wait(lambda: _steps(loss_log) and _steps(loss_log)[-1]["step"] >= 3 * INTERVAL + 2, run, "training")
        victims = [_smp_pid(job, lost), _rank_pid(job, lost)]
        at = time.time()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        os.killpg(run.procs[lost].pid, signal.SIGKILL)
        if spare_after is not None:
            time.sleep(max(0.0, at + spare_after - time.time()))
            run.start(lost)
        _wait(lambda: _back_past(_steps(loss_log), at, 6), run, "recovery")
    finally:
        run.stop()
        for seg in names_with_prefix(f"inmemft.{job}."):
            unlink(seg)
    records = _steps(loss_log)
    lost_s, reached, restored = _recovery(records, at)
    out = {"lost_s": lost_s, "reached_step": reached, "restored_step": restored,
           "step_s_before": _step_s([r for r in records if r["time"] <= at][-6:]),
           "step_s_after": _step_s([r for r in records if r["time"] > at + lost_s][-6:])}
    split = _last_split(runtime, job, 1, "node 1", run.output())  # its rank reads the lost node's share
    out["agent_split"] = _agent_split(split)
    if split.get("resize"):
        out["resize"] = split["resize"]
    return out


def _step_s(records: list[dict]) -> float | None:
    """Seconds per step over consecutive loss-log records (one process's)."""
    if len(records) < 2:
        return None
    return (records[-1]["time"] - records[0]["time"]) / (records[-1]["step"] - records[0]["step"])


def _recovery(records: list[dict], at: float) -> tuple[float, int, int | None] | None:
    """(seconds from `at` until the loss log is back at the step reached, that step, the step restored) or None
    while it is not back. The restart's records are those of another process than the one logging at `at`
    (rank 0 restarts with every rank), so a step the failed attempt still logged after `at` counts as reached,
    not as the restart's."""
    before = [r for r in records if r["time"] <= at]
    if not before:
        return None
    failed = before[-1]["pid"]
    reached = max(r["step"] for r in records if r["pid"] == failed)
    restart = [r for r in records if r["time"] > at and r["pid"] != failed]
    back = next((r for r in restart if r["step"] >= reached), None)
    return (back["time"] - at, reached, restart[0]["step"] - 1) if back else None


def _back_past(records: list[dict], at: float, past: int = 2) -> bool:
    """Whether training is back, and `past` steps past the step reached (so that no later record changes the
    figure: a step the failed attempt still logged after `at` is followed by the restart's)."""
    found = _recovery(records, at)
    return found is not None and records[-1]["step"] >= found[1] + past


def _agent_events(runtime: str, job: str, name: str) -> list[dict]:
    """The records of event `name` the nodes' agents wrote so far (inmem_ft/events.py), node 0's first."""
    return [r for node in range(2)
            for r in events.where(events.Reader(os.path.join(runtime, job, f"agent-node{node}", events.FILE))
                                  .records(), name)]


def _rank_pid(job: str, rank: int, not_pid: int | None = None) -> int:
    """The live process of `rank` (other than `not_pid`) in the job's newest attempt, from its worker record
    (agent/worker.py): a cold start and a standby that took the rank both write theirs."""
    records = glob.glob(os.path.join(os.environ["INMEM_FT_RUNTIME_DIR"], job, "agent-node*", "attempt*",
                                     f"rank{rank}.json"))
    for path in sorted(records, key=_attempt_number, reverse=True):
        record = _read_json(path)
        if record and record.get("pid") != not_pid and os.path.exists(f"/proc/{record['pid']}"):
            return record["pid"]
    raise SystemExit(f"no process of rank {rank} of job {job}")


def _attempt_number(path: str) -> int:
    return int(re.search(r"attempt(\d+)", path).group(1))


def _smp_pid(job: str, node: int) -> int:
    """The SMP process of `node` (`python -m inmem_ft.smp ... --node N`, its job in its environment)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"inmem_ft.smp" in argv and _environ(int(pid)).get(b"INMEM_FT_JOB") == job.encode() \
                and argv[argv.index(b"--node") + 1:][:1] == [str(node).encode()]:
            return int(pid)
    raise SystemExit(f"no SMP of node {node} of job {job}")


def _environ(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return {}


def _wait(cond, run, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline or "event=torchrun_exit" in run.output():
            raise SystemExit(f"{what}: not within {WAIT_S} s:\n{run.output()[-4000:]}")
        time.sleep(0.1)


def _steps(path: str) -> list[dict]:
    return [json.loads(line) for line in _read(path).splitlines() if line.endswith("}")]


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _read_json(path: str):
    text = _read(path)
    return json.loads(text) if text else None


def summary(runs: list[dict]) -> dict:
    """Medians over the repeats of one case: the time lost, and each part of the agent's split."""
    out = {"lost_s": statistics.median(r["lost_s"] for r in runs)}
    splits = [r["agent_split"] for r in runs if r.get("agent_split")]
    if splits:
        # A split whose ranks' records missed a boundary merges the parts around it ("setup + restore + ..."):
        # each part's median is over the splits that measured it on its own.
        names = list(dict.fromkeys(p for s in splits for p in s["parts"]))
        parts = {p: [s["parts"][p] for s in splits if s["parts"].get(p) is not None] for p in names}
        totals = [s["total_s"] for s in splits if s["total_s"] is not None]
        out.update(total_s=statistics.median(totals) if totals else None,
                   parts={p: statistics.median(v) if v else None for p, v in parts.items()},
                   starts=[s["starts"] for s in splits])
    for key in ("step_s_before", "step_s_after"):
        got = [r[key] for r in runs if r.get(key) is not None]
        if got:
            out[key] = statistics.median(got)
    resizes = [r["resize"] for r in runs if r.get("resize")]
    if resizes:
        parts = {p: [z["parts"][p] for z in resizes if z["parts"][p] is not None] for p in resizes[0]["parts"]}
        totals = [z["total_s"] for z in resizes if z["total_s"] is not None]
        out["resize"] = {"how": resizes[0]["how"], "nodes": resizes[0]["nodes"],
                         "total_s": statistics.median(totals) if totals else None,
                         "parts": {p: statistics.median(v) if v else None for p, v in parts.items()}}
    return out


def node_loss(cases: dict) -> dict:
    """Per node lost for good: the seconds lost to the step reached by shrinking and by waiting for each spare
    (what `inmem-ft plan` reads: planning/inputs.py), and the shrunk job's training rate on this machine (steps
    per second after / before: 3 ranks on 2 cores, not what 2 nodes of 3 train at on a cluster)."""
    out = {}
    shrink = cases.get("node lost, shrink")
    if shrink:
        out["shrink_s"] = shrink["lost_s"]
        if shrink.get("step_s_before") and shrink.get("step_s_after"):
            out["shrunk_rate"] = round(shrink["step_s_before"] / shrink["step_s_after"], 3)
    for case, after in NODE_LOSS.items():
        if after is not None and case in cases:
            out[f"spare_after_{after:g}_s"] = cases[case]["lost_s"]
    return out


def goals(cases: dict, hang_goal: float) -> dict:
    """Each goal of the cases measured: a warm rank kill <= 3 s, a hang <= its timeout + 3 s, and an early or a
    second kill <= 2x the warm rank kill (issue 42: no cold start)."""
    out = {}
    if "agent" in cases:
        warm = cases["agent"]["lost_s"]
        out.update(rank_kill_s=3.0, rank_kill_met=warm <= 3.0)
        for case in ("agent, early kill", "agent, second kill 10 s later"):
            if case in cases:
                out[f"{case}: x warm"] = round(cases[case]["lost_s"] / warm, 2)
                out[f"{case}: <= 2x met"] = cases[case]["lost_s"] <= 2 * warm
    if "agent, hang" in cases:
        out.update(hang_s=hang_goal, hang_met=cases["agent, hang"]["lost_s"] <= hang_goal)
    return out


def plot(results: dict, path: str) -> None:
    """Each case's runs and median (time lost from the signal, per the loss log), and the agent's split of each
    of its cases (medians) as stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(results["runs"])
    fig, (runs, split) = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw={"width_ratios": [1, 1.6]})
    for row, case in enumerate(cases):
        seconds = [r["lost_s"] for r in results["runs"][case]]
        runs.plot(seconds, [row] * len(seconds), "o", alpha=0.7)
        runs.plot([results["cases"][case]["lost_s"]], [row], "k|", markersize=20)
    runs.set_yticks(range(len(cases)), cases)
    runs.set_xlabel("s lost (signal to step reached, loss log)")
    agent_cases = [c for c in cases if results["cases"][c].get("parts")]
    colors = plt.get_cmap("tab10").colors
    for row, case in enumerate(agent_cases):
        left = 0.0
        for i, (part, seconds) in enumerate(results["cases"][case]["parts"].items()):
            if seconds:
                split.barh(row, seconds, left=left, color=colors[i % 10], label=part if row == 0 else None)
                left += seconds
    split.set_yticks(range(len(agent_cases)), agent_cases)
    split.set_xlabel("inmem-ft run's own split (medians, s)")
    split.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=4, frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="runs per case, alternating (default: 3)")
    p.add_argument("--cases", default=None, help=f"which, separated by ; (default: all: "
                   f"{'; '.join([*CASES, *NODE_LOSS])})")
    p.add_argument("--hang-timeout", type=float, default=5.0, help="the agent's hang timeout, s (default: 5)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="draw a PNG of the results here")
    p.add_argument("--quick", action="store_true", help="the node-loss cases once each (a few minutes)")
    args = p.parse_args()
    known = [*CASES, *NODE_LOSS]
    chosen = [c.strip() for c in args.cases.split(";")] if args.cases else (list(NODE_LOSS) if args.quick else known)
    if any(c not in known for c in chosen):
        p.error(f"--cases {args.cases}: expected some of {'; '.join(known)}")
    if args.quick:
        args.repeat = 1
    why = unavailable() if any(c in CASES for c in chosen) else "only the node-loss cases, which run the node script"
    cluster = None
    if not why:
        cluster = SlurmCluster()
        cluster.start()
    try:
        runs = report.alternating(chosen, args.repeat,
                                  lambda case, i, work: one_run(case, work, cluster, args.hang_timeout),
                                  label=lambda case: case if case in NODE_LOSS else
                                  f"{case}, rank {VICTIM} {signal.Signals(CASES[case][2]).name}")
    finally:
        if cluster:
            cluster.stop()
    cases = {case: summary(r) for case, r in runs.items()}
    hang_goal = args.hang_timeout + 3
    only_loss = all(case in NODE_LOSS for case in chosen)
    results = {"launcher": "slurm_inmem.sbatch on a real SLURM (2 slurmd nodes on this machine)" if cluster else
               f"torchrun_inmem.sh, {LOSS_NODES} nodes x 1 rank on this machine ({why})" if only_loss else
               f"torchrun_inmem.sh, 2 nodes on this machine (SLURM not available: {why})",
               "model": "deepspeed_gpt ZeRO-2 (2 layers, hidden 64), CPU",
               "nodes": LOSS_NODES if only_loss else 2, "ranks_per_node": 1 if only_loss else 2,
               "interval": INTERVAL, "victim_rank": VICTIM, "hang_timeout_s": args.hang_timeout,
               "repeat": args.repeat, "machine": report.machine(), "runs": runs, "cases": cases,
               "goals": goals(cases, hang_goal)}
    if any(case in cases for case in NODE_LOSS):
        results["node_loss"] = {"nodes": LOSS_NODES, "ranks_per_node": 1, "spare_wait_s": SPARE_WAIT_S,
                                "standbys": 0, **node_loss(cases)}
    if "agent" in cases:  # the planner reads the warm-standby restart's detection from here (planning/inputs.py)
        results["standby"] = cases["agent"]
    print(f"s lost per failure, from the signal to the step reached (medians of {args.repeat}; {results['launcher']}):")
    for case, s in cases.items():
        print(f"  {case:<20} {s['lost_s']:6.2f}" + (f"   agent's split: " + ", ".join(
            f"{k} {v:.3f}" for k, v in s["parts"].items() if v is not None) if s.get("parts") else ""))
    print(f"goals: {results['goals']}; {results['machine']}")
    report.write(results, args.json, plot, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
