"""A real SLURM on this host for the tests: munged, one slurmctld and two slurmd "nodes" n0 and n1.

The nodes share the host name but not their address (127.0.0.1 and 127.0.0.2, both loopback), as two
machines would not: torchrun orders nodes by address, and the SMPs of both nodes need their own ports.

Everything lives in its own temporary directory with its own ports and munge socket, so it neither needs
nor touches a system SLURM or munge. Jobs run as root (so does the test), with the submitter's
environment (sbatch's --export=ALL default).
"""
from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from inmem_ft.launcher.ports import free_port

NODES = ("n0", "n1")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
GRACE_S = 60  # KillWait: what a signalled job has between SIGTERM and SIGKILL (the preemption grace time)


def unavailable() -> str | None:
    """Why a SLURM cluster cannot be started here, or None."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"SLURM/munge not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge"
    if os.getuid() != 0:
        return "the SLURM tests start slurmd and munged (as user munge), which needs root"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "user 'munge' does not exist (install the munge package)"
    return None


CONF = """\
ClusterName=inmemft
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.sock
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=10
KillWait={grace}
MinJobAge=3600
# Verbose: the logs say why a step was refused, and when each step's task exited (task_exits reads that).
DebugFlags=Steps
SlurmctldDebug=verbose
SlurmdDebug=verbose
NodeName=n0 NodeHostname={host} NodeAddr=127.0.0.1 Port={port0} CPUs=4 RealMemory=4000
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.2 Port={port1} CPUs=4 RealMemory=4000
PartitionName=test Nodes=n0,n1 Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    def __init__(self):
        # Not under pytest's tmp dirs: munged, running as user munge, must reach its socket directory.
        self.dir = tempfile.mkdtemp(prefix="inmem_ft-slurm-")
        os.chmod(self.dir, 0o755)
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.pids: dict[str, int] = {}

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> None:
        for sub in ("munge", "munge/key", "state", "spool", "log"):
            os.makedirs(os.path.join(self.dir, sub))
        munge = pwd.getpwnam("munge")
        key_dir = os.path.join(self.dir, "munge", "key")
        key = os.path.join(key_dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        for path, mode in ((os.path.join(self.dir, "munge"), 0o755), (key_dir, 0o700), (key, 0o400)):
            os.chown(path, munge.pw_uid, munge.pw_gid)
            os.chmod(path, mode)
        with open(self.conf, "w") as f:
            f.write(CONF.format(host=socket.gethostname(), dir=self.dir, grace=GRACE_S, ctld_port=free_port(),
                                port0=free_port(), port1=free_port()))
        m = os.path.join(self.dir, "munge")
        self._daemon("munged", ["runuser", "-u", "munge", "--", "munged", f"--socket={m}/munge.sock",
                                f"--key-file={key}", f"--pid-file={m}/munged.pid",
                                f"--log-file={m}/munged.log", f"--seed-file={key_dir}/seed"],
                     f"{m}/munged.pid")
        self._daemon("slurmctld", ["slurmctld", "-f", self.conf], f"{self.dir}/slurmctld.pid")
        for node in NODES:
            self.start_node(node)
        self.wait_idle(NODES, timeout_s)

    def start_node(self, node: str) -> None:
        self._daemon(node, ["slurmd", "-f", self.conf, "-N", node], f"{self.dir}/slurmd-{node}.pid")

    def _daemon(self, name: str, argv: list[str], pid_file: str) -> None:
        """Run a daemon that forks into the background and writes its pid file; remember its pid."""
        if os.path.exists(pid_file):
            os.unlink(pid_file)  # a killed predecessor's (a replaced node's): not the pid to remember
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} did not start (rc {proc.returncode}): {proc.stderr.strip()}; "
                               f"see {self.dir}/log")
        deadline = time.monotonic() + 30
        while not os.path.exists(pid_file) or not open(pid_file).read().strip():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} wrote no pid file {pid_file}; see {self.dir}/log")
            time.sleep(0.1)
        self.pids[name] = int(open(pid_file).read())

    def kill_node(self, node: str) -> None:
        """The node dies: its slurmd and every job process on it (slurmstepd and below) get SIGKILL."""
        victims = [self.pids.pop(node)] + self.step_pids(node)
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(os.path.join(self.dir, "spool", node), ignore_errors=True)  # a replacement starts bare

    def step_pids(self, node: str) -> list[int]:
        """Every process of a job on `node` (its tasks carry SLURMD_NODENAME and this cluster's SLURM_CONF,
        and so does whatever they start, the SMP included) and the slurmstepd above them."""
        marks = (f"SLURMD_NODENAME={node}\0".encode(), f"SLURM_CONF={self.conf}\0".encode())
        out = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = b"\0" + f.read()
                if not all(b"\0" + m in environ for m in marks):
                    continue
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                out.add(int(entry))
                with open(f"/proc/{ppid}/comm") as f:
                    if f.read().strip() == "slurmstepd":
                        out.add(ppid)
            except (OSError, IndexError, ValueError):
                continue
        return sorted(out)

    def stop(self, keep_logs: str | None = None) -> None:
        """Cancel every job, stop every daemon this cluster started (by pid), remove its files (its
        slurmctld, slurmd and munged logs are copied to `keep_logs` first, when given)."""
        if "slurmctld" in self.pids:
            subprocess.run(["scancel", "--full", "--signal=KILL", "--user=root"], env=self.env,
                           capture_output=True, timeout=30)
            subprocess.run(["scancel", "--user=root"], env=self.env, capture_output=True, timeout=30)
            self.wait_until(lambda: not self.squeue(), 30)
        for node in NODES:
            if node in self.pids:
                for pid in self.step_pids(node):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        # All at once: each daemon takes 2-5 s to exit, one after the other they took 11 s.
        pids = [pid for pid in (self.pids.pop(name, None) for name in [*NODES, "slurmctld", "munged"]) if pid]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if not self.wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids), 15):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if keep_logs is not None:
            for log in (os.path.join(self.dir, "log"), os.path.join(self.dir, "munge", "munged.log")):
                if os.path.isdir(log):
                    shutil.copytree(log, keep_logs, dirs_exist_ok=True)
                elif os.path.exists(log):
                    shutil.copy(log, keep_logs)
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- queries --------------------------------------------------------------------------------------
    def run(self, *argv: str, timeout_s: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=kw.pop("env", self.env), capture_output=True, text=True,
                              timeout=timeout_s, **kw)

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %T").stdout.split()
        return dict(zip(out[::2], out[1::2]))

    def wait_idle(self, nodes, timeout_s: float) -> None:
        if not self.wait_until(lambda: all(self.node_states().get(n) == "idle" for n in nodes), timeout_s):
            raise RuntimeError(f"nodes {nodes} not idle within {timeout_s:.0f} s: sinfo says "
                               f"{self.node_states()}; see {self.dir}/log")

    def squeue(self) -> list[str]:
        return self.run("squeue", "--noheader", "--format=%i").stdout.split()

    def job_field(self, job_id: str, field: str) -> str:
        out = self.run("scontrol", "show", "job", job_id).stdout
        return next((kv.split("=", 1)[1] for kv in out.split() if kv.startswith(field + "=")), "")

    def task_exits(self, node: str, job_id: str, step: str) -> list[str]:
        """When the task of step `step` ("batch", "0") of the job exited on `node`, once per attempt (the
        times of its slurmd's log, which sort)."""
        with open(os.path.join(self.dir, "log", f"slurmd-{node}.log")) as f:
            return re.findall(rf"^\[(\S+)\] \[{job_id}\.{step}\] task \d+ \(\d+\) exited", f.read(), re.M)

    @staticmethod
    def wait_until(cond, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return True
            time.sleep(0.5)
        return False
