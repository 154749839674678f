"""Issue 41: elastic continue-from-memory under the production agent. Three `inmem-ft run` agents are three nodes
(one rank each, their SMPs an EC group with m=1) of the DeepSpeed GPT example, ZeRO-2, a global batch of 12 in
micro batches of 2. A node lost for good with `--nnodes 2:3`: the survivors go on at 2 nodes, resharding step 6
from memory (the lost node's shards from parity), the state right after the restore equal to the 3-node run's
at step 6, the global batch kept by a larger gradient accumulation, the data position continuous; the SMPs' EC
groups formed again over the two survivors, so that the first snapshot after the shrink is protected."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from conftest import ROOT
from inmem_ft import events
from inmem_ft.agent import rendezvous, run
from inmem_ft.cluster.groups import Groups
from inmem_ft.config import InmemFTBlock
from inmem_ft.errors import SPARE_EXIT, ConfigError, InmemFTError
from inmem_ft.globalbatch import GlobalBatchRefused, for_dp
from inmem_ft.integrations.deepspeed.batch import keep_global_batch
from inmem_ft.launcher.ports import free_port
from inmem_ft.smp import control
from inmem_ft.smp.segments import names_with_prefix, unlink
from inmem_ft.telemetry import read_losses

NODES, STEPS, INTERVAL, LOST_AT, LOST = 3, 12, 3, 7, 2  # node 2 is lost after step 7: step 6 is resharded
EXAMPLE = ["-m", "inmem_ft.examples.deepspeed_gpt", "--zero-stage", "2", "--steps", str(STEPS), "--interval",
           str(INTERVAL), "--global-batch", "12", "--micro-batch", "2", "--dropout", "0", "--layers", "1"]
# torch's rendezvous drops a node that stopped its keep-alives after interval x attempts (5 x 3 s by default):
# the survivors' next round starts then; 1 x 3 s keeps the test short, and a live agent a loaded box holds up
# for 2 s is still not taken for lost.
KEEP_ALIVE = "keep_alive_interval=1,keep_alive_max_attempt=3"


class Cluster:
    """`nodes` agents on one box, each its own node: its loopback address (torch orders nodes by it), its SMP,
    its work dir; the rendezvous store held by the test, so that losing any node leaves it."""

    def __init__(self, tmp, job: str, nodes: int, nnodes: str, agent_args=(), smp_args: str = "", example=EXAMPLE):
        from torch.distributed import TCPStore

        self.tmp, self.job, self.nodes, self.example = tmp, job, nodes, example
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        first = free_port(nodes)
        peers = ",".join(f"{n}=127.0.0.1:{first + n}" for n in range(nodes))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("INMEM_FT_", "TORCHELASTIC_", "PET_"))}
        self.env.update({"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "INMEM_FT_RUNTIME_DIR": str(tmp / "run"),
                         "INMEM_FT_SECRET": "elastic-test-secret-0123456789"})
        self.command = [sys.executable, "-m", "inmem_ft", "run", "--nnodes", nnodes, "--nproc-per-node", "1",
                        "--rdzv-backend", "c10d", "--rdzv-id", job, "--rdzv-endpoint", f"127.0.0.1:{self.store.port}",
                        "--rdzv-conf", f"is_host=0,{KEEP_ALIVE}", "--max-restarts", "2", "--monitor-interval", "0.1",
                        "--job", job, "--memory-budget", "128MiB", "--standbys", "0", "--wipe-on-exit", "1",
                        "--smp-args", f"--parity 1 --nodes {nodes} --group-size {nodes} --peers {peers} {smp_args}",
                        *agent_args]
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, node: int, example_args) -> None:
        out = open(self.tmp / f"agent{node}.out", "w")
        self.procs[node] = subprocess.Popen(
            [*self.command, "--local-addr", f"127.0.1.{100 + node}", "--node-rank", str(node),
             "--work-dir", str(self.tmp / f"work{node}"), *self.example, *example_args],
            env={**self.env, "INMEM_FT_NODE": str(node)}, cwd=self.tmp, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    def wait(self, timeout_s: float) -> dict[int, int]:
        try:
            return {n: p.wait(timeout=timeout_s) for n, p in self.procs.items()}
        except subprocess.TimeoutExpired:
            raise AssertionError("agents timed out:\n" + "\n".join(self.out(n)[-4000:] for n in self.procs))

    def shrunk(self, lost: int, example_args, timeout_s: float) -> str:
        """Every node started with `example_args`, which lose node `lost` for good: the survivors' output, once they
        finished the run at one node fewer."""
        for node in range(self.nodes):
            self.start(node, example_args)
        codes = self.wait(timeout_s)
        survivors = [self.out(n) for n in range(self.nodes) if n != lost]
        assert codes.pop(lost) == -signal.SIGKILL and set(codes.values()) == {0}, survivors[0][-6000:]
        assert all(f"event=shrink nodes={self.nodes}->{self.nodes - 1}" in out for out in survivors), survivors[0]
        return "\n".join(survivors)

    def grown(self, lost: int, example_args, layouts: tuple[str, str], loss_log, timeout_s: float = 300) -> int:
        """Every node started with `example_args`, which lose node `lost` for good after step LOST_AT (and train on
        until stopped);
        once the survivors' SMPs protect a step after the shrink, node `lost` starts again (a new agent, an empty
        SMP), the job grows back at the next snapshot and trains two snapshots on at the full count, protected
        over all its nodes again; then every agent is stopped. Returns the step the grown job restored, resharded
        from memory from layout `layouts[0]` onto `layouts[1]`, which every survivor's loss log continues from."""
        for node in range(self.nodes):
            self.start(node, example_args)
        deadline = time.monotonic() + timeout_s

        def until(check, what):
            while not check():
                assert time.monotonic() < deadline and self.procs[0].poll() is None, f"no {what}:\n" + \
                    self.out(0)[-4000:]
                time.sleep(0.2)

        until(lambda: f"event=shrink nodes={self.nodes}->{self.nodes - 1}" in self.out(0), "shrink")
        smp0 = str(self.tmp / "run" / self.job / "node0.sock")

        def ec():
            return control.call(smp0, "status")["ec"]

        survivors = [n for n in range(self.nodes) if n != lost]
        # The SMPs' groups are formed again over the survivors, and protect the steps after the shrink.
        shrunk_from = LOST_AT - LOST_AT % INTERVAL
        until(lambda: ec()["group"] == survivors and ec()["degraded"] is None and
              ec()["protected_step"] > shrunk_from, "protection over the survivors")
        assert f"erasure coding: group {survivors}, survives 1 lost node(s) per group" in subprocess.run(
            [sys.executable, "-m", "inmem_ft", "smp", "status", "--socket", smp0], capture_output=True, text=True,
            env=self.env).stdout
        self.start(lost, example_args)
        until(lambda: f"event=grow nodes={self.nodes - 1}->{self.nodes}" in self.out(0), "grow")
        pattern = re.compile(rf"restore rank={lost} step=(\d+) source=memory_resharded from={layouts[0]} "
                             rf"to={layouts[1]}")
        until(lambda: pattern.search(self.out(lost)), f"restore onto {layouts[1]}")
        grown = int(pattern.search(self.out(lost)).group(1))
        until(lambda: max(json.loads(ln)["step"] for ln in open(loss_log)) >= grown + 2 * INTERVAL,
              "training at the full count")
        until(lambda: ec()["group"] == list(range(self.nodes)) and ec()["degraded"] is None and
              ec()["protected_step"] > grown, "protection over every node again")
        for p in self.procs.values():
            p.send_signal(signal.SIGTERM)
        assert set(self.wait(120).values()) == {128 + signal.SIGTERM}
        assert "event=node_waiting count=1" in self.out(0)
        # Each restart goes on from the step it restored: the global order has no gap and no step twice in a row.
        steps = [json.loads(line)["step"] for line in open(loss_log)]
        restarts = [i for i in range(1, len(steps)) if steps[i] != steps[i - 1] + 1]
        again = [steps[i] for i in restarts]
        if again[:1] == [LOST_AT]:  # trained again after the shrink where the log had it before (Megatron's may not)
            again = again[1:]
        assert again[:1] == [grown + 1], steps
        assert all(steps[i] <= steps[i - 1] for i in restarts), steps
        return grown

    def refused(self, lost: int, batch_args, timeout_s: float = 300) -> str:
        """Every node started with `batch_args` (a global batch that does not divide at one node fewer, on_shrink
        "refuse"), node `lost` lost for good after step LOST_AT: once the survivors' agents wait for a spare, node
        `lost` starts again, and the job goes on at the full count to the end. Node 0's output."""
        for node in range(self.nodes):
            self.start(node, [*batch_args, "--lose-node-at", str(LOST_AT), "--die-rank", str(lost)])
        deadline = time.monotonic() + timeout_s
        while "event=spare_wait" not in self.out(0):
            assert time.monotonic() < deadline and self.procs[0].poll() is None, self.out(0)[-4000:]
            time.sleep(0.2)
        self.start(lost, batch_args)
        codes = self.wait(timeout_s)
        out = self.out(0)
        assert codes == dict.fromkeys(range(self.nodes), 0), out[-4000:]
        assert "on_shrink is \"refuse\": the job waits for a node to join" in out
        assert "event=spare_joined" in out and f"event=grow nodes={self.nodes - 1}->{self.nodes}" in out, out[-4000:]
        return out

    def out(self, node: int) -> str:
        return (self.tmp / f"agent{node}.out").read_text()

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for node in range(self.nodes):  # what a killed agent could not stop
            sock = str(self.tmp / "run" / self.job / f"node{node}.sock")
            found = control.ping(sock) if os.path.exists(sock) else None
            if found:
                with contextlib.suppress(ProcessLookupError):  # it may be exiting by itself
                    os.kill(found["pid"], signal.SIGKILL)
        for seg in names_with_prefix(f"inmemft.{self.job}."):
            unlink(seg)


@pytest.fixture
def cluster(tmp_path, job):
    made = []

    def make(nnodes: str, agent_args=(), name: str = "", smp_args: str = "", example=EXAMPLE):
        """`name`: a run of its own (folder, job id) beside others in the same test; `example`: the command the
        agents run (the DeepSpeed GPT example's by default)."""
        (tmp_path / name).mkdir(exist_ok=True)
        made.append(Cluster(tmp_path / name, job + name, NODES, nnodes, agent_args, smp_args, example))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_a_node_lost_for_good_the_survivors_reshard_from_memory_and_go_on_with_the_global_batch(cluster, tmp_path):
    c = cluster("2:3", ["--spare-wait", "1"])
    dump = tmp_path / "state{restart}.pt"
    for node in range(NODES):
        c.start(node, ["--loss-log", str(tmp_path / "loss.jsonl"), "--lose-node-at", str(LOST_AT), "--die-rank",
                       str(LOST), "--dump-full", str(dump), "--dump-step", "6"])
    codes = c.wait(300)
    survivors = [c.out(n) for n in range(NODES) if n != LOST]
    assert codes[LOST] == -signal.SIGKILL and [codes[n] for n in range(NODES) if n != LOST] == [0, 0], survivors
    for out in survivors:
        assert "event=elastic nodes=2:3 spare_wait_s=1" in out
        assert "event=shrink nodes=3->2 world_size=2" in out, out
    both = "\n".join(survivors)
    assert "[example] batch global=12 micro=2 accumulation=2 dp=3" in both
    assert "[example] batch global=12 micro=2 accumulation=3 dp=2" in both  # the global batch kept
    # Step 6 resharded from memory onto DP 2; the lost node's shards (in rank 1's new range) rebuilt from parity.
    lines = [next(ln for ln in both.splitlines() if f"restore rank={rank} step=6 source=memory_resharded" in ln)
             for rank in (0, 1)]
    assert all("from=tp1.pp1.dp3.zero2 to=tp1.pp1.dp2.zero2" in ln and "bytes_disk" not in ln for ln in lines)
    assert "bytes_parity=" in lines[1], lines
    # The state right after the restore is the 3-node run's at step 6, tensor for tensor, and so are the step,
    # the scheduler and the data position.
    before, after = torch.load(str(dump).format(restart=0)), torch.load(str(dump).format(restart=1))
    assert sorted(before) == sorted(after)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    counters = [json.loads(open(f"{str(dump).format(restart=r)}.json").read()) for r in (0, 1)]
    assert counters[1]["restored"] == "memory_resharded"
    assert {k: v for k, v in counters[0].items() if k != "restored"} == \
           {k: v for k, v in counters[1].items() if k != "restored"}
    assert counters[1]["position"] == 6 and counters[1]["global_samples"] == 6 * 12
    # No global batch skipped or trained twice: step 7 (lost with the node) again, then on to the end.
    steps = [json.loads(line)["step"] for line in open(tmp_path / "loss.jsonl")]
    assert steps == [*range(1, LOST_AT + 1), *range(7, STEPS + 1)], steps
    # The time the shrink cost, part by part, as for any restart (the restore line names the two layouts).
    [split] = json.loads((tmp_path / "work0" / "time_lost.json").read_text())
    assert split["restored_step"] == 6 and all(p["seconds"] is not None for p in split["parts"]), split
    # ... and as a shrink: the spare wait (1 s, from the round having its 2 nodes), the reconstruction (rank 1's
    # reads from parity), the same total, in time_lost.json and in each survivor's events.
    for node in (0, 1):
        [split] = json.loads((tmp_path / f"work{node}" / "time_lost.json").read_text())
        resize = split["resize"]
        assert (resize["how"], resize["nodes"], list(resize["parts"])) == ("shrink", "3->2", [
            "detection", "teardown", "agents' rendezvous", "spare wait", "start and imports", "rendezvous", "setup",
            "reconstruction", "reshard", "first step"]), resize
        assert resize["total_s"] == pytest.approx(split["total_s"]) and 0.5 < resize["parts"]["spare wait"] < 3
        assert (resize["parts"]["reconstruction"] > 0) == (node == 1), resize
        [said] = events.where(events.read(str(tmp_path / f"work{node}" / events.FILE)), "shrink_parts", role="agent")
        assert said["fields"]["spare_wait_s"] == resize["parts"]["spare wait"], said
    # Protection after the shrink: each survivor's SMP formed its group over the two survivors (G 3 -> 2, said)
    # before the ranks restarted, and the first snapshot after the shrink (step 9) is protected by it.
    for node, out in zip((0, 1), survivors):
        assert "event=ec_groups nodes=0,1 group=0,1: the steps from the next snapshot on are protected by EC " \
               "group [0, 1] of [[0, 1]] (G=2, fewer than the configured 3: 2 nodes are left)" in out, out
        records = events.read(str(tmp_path / f"work{node}" / events.FILE))
        protected = {r["fields"]["step"]: r["fields"]["group"] for r in events.where(records, "protected", role="smp")}
        assert protected[6] == [0, 1, 2] and protected[9] == [0, 1], protected
        assert not [r for r in events.where(records, "protect_failed", role="smp")], records


@pytest.mark.parametrize("dp, on_shrink, accumulation, size", [
    (3, "keep", 2, 12), (2, "keep", 3, 12), (4, "keep", 2, 16), (5, "keep", 1, 10), (1, "refuse", 6, 12)])
def test_the_accumulation_covers_the_ranks_that_came_or_went_else_on_shrink_decides(dp, on_shrink, accumulation,
                                                                                     size):
    batch = for_dp(12, 2, dp, on_shrink)
    assert (batch.accumulation, batch.size) == (accumulation, size)
    assert batch.kept == (size == 12)
    assert (f"a global batch of {size}" in batch.note()) == (size != 12)


@pytest.mark.parametrize("survivors, size, m, sets", [
    ([0, 1], 3, 1, [[0, 1]]), ([0, 2], 3, 1, [[0, 2]]), ([0, 1, 2, 4, 5, 6, 7], 4, 1, [[0, 1, 2, 4], [5, 6, 7]]),
    (range(5), 4, 2, [[0, 1, 2, 3, 4]]), (range(8), 4, 1, [[0, 1, 2, 3], [4, 5, 6, 7]]), ([3], 3, 1, None),
    ([0, 1], 3, 2, None)])
def test_ec_groups_are_formed_over_the_survivors_at_most_g_to_a_group_or_none_when_m_is_too_many(survivors, size, m,
                                                                                                 sets):
    groups = Groups.over(survivors, size, m)
    assert (groups and [list(s) for s in groups.sets]) == sets
    if groups:
        assert groups.members(sets[-1][-1]) == sets[-1] and groups.position(sets[0][0]) == 0


def test_on_shrink_refuse_waits_for_a_node_with_one_line_and_bad_values_are_refused():
    with pytest.raises(GlobalBatchRefused, match="does not divide by micro batch 2 x 5 data-parallel ranks") as e:
        for_dp(12, 2, 5, "refuse")
    assert e.value.exit_code == SPARE_EXIT  # the agent restarts only once a node joins
    with pytest.raises(ConfigError, match="'on_shrink' = 'wait': must be one of"):
        InmemFTBlock.from_dict({"on_shrink": "wait"})
    config = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    assert keep_global_batch(config, 2) == {**config, "gradient_accumulation_steps": 3}
    assert keep_global_batch({"train_micro_batch_size_per_gpu": 2}, 2) == {"train_micro_batch_size_per_gpu": 2}


def test_spare_wait_is_checked_and_becomes_torchs_last_call_after_the_start(monkeypatch, tmp_path, capsys):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    monkeypatch.setenv("INMEM_FT_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("INMEM_FT_SMP_SOCKET", raising=False)
    base = ["--job", "j", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", "x.py"]
    args = run.parser().parse_args(["--nnodes", "2:3", "--spare-wait", "7", *base])
    assert (run.options(args).nodes, run.options(args).spare_wait_s) == ((2, 3), 7)
    assert "INMEM_FT_SMP_SOCKET" not in os.environ  # reading the options leaves the process as it was
    assert run.options(run.parser().parse_args(["--nnodes", "3", *base])).nodes == (3, 3)
    with pytest.raises(InmemFTError, match="a node range needs the c10d rendezvous"):
        run.options(run.parser().parse_args(["--nnodes", "2:3", "--max-restarts", "0", "--job", "j", "x.py"]))
    monkeypatch.setenv("INMEM_FT_SPARE_WAIT", "soon")  # a string default goes through the option's type too
    with pytest.raises(SystemExit):
        run.parser().parse_args(["--nnodes", "2:3", *base])
    assert "argument --spare-wait: 'soon' is not a whole number of seconds >= 0" in capsys.readouterr().err

    class Handler(dynamic_rendezvous.DynamicRendezvousHandler):
        def __init__(self):  # only what set_last_call touches
            self._settings = types.SimpleNamespace(timeout=RendezvousTimeout())

    handler = Handler()
    assert handler._settings.timeout.last_call.total_seconds() == 30  # torch's, for the start
    assert rendezvous.set_last_call(handler, 7) and handler._settings.timeout.last_call.total_seconds() == 7
    assert not rendezvous.set_last_call(object(), 7)


@pytest.mark.slow
def test_after_a_shrink_a_restart_on_the_smaller_layout_is_bit_identical_to_none(cluster, tmp_path):
    """Two runs lose node 2 after step 7 and go on at 2 nodes from step 6; in the second, rank 1 is killed after
    step 10 as well and the job restarts on 2 nodes from step 9: each step's last loss equals the first run's."""
    runs = {}
    for name, extra in (("plain", []), ("killed", ["--die-at", "10", "--die-rank", "1", "--die-attempt", "1"])):
        c = cluster("2:3", ["--spare-wait", "1"], name)
        log = tmp_path / f"{name}.jsonl"
        for node in range(NODES):
            c.start(node, ["--loss-log", str(log), "--lose-node-at", str(LOST_AT), "--die-rank", str(LOST)]
                    if node == LOST else ["--loss-log", str(log), *extra])
        codes = c.wait(300)
        assert [codes[n] for n in range(NODES) if n != LOST] == [0, 0], c.out(0)[-4000:]
        c.close()
        runs[name] = read_losses(log)
        if name == "killed":
            assert "restore rank=1 step=9 source=memory seconds=" in c.out(1), c.out(1)[-4000:]
    assert sorted(runs["plain"]) == list(range(1, STEPS + 1))
    assert runs["killed"] == runs["plain"]


@pytest.mark.slow
def test_a_node_that_joins_after_a_shrink_is_taken_in_at_the_next_snapshot(cluster, tmp_path):
    """After the shrink to 2 nodes, node 2 starts again (a new agent, an empty SMP): the agents take it in at
    the next snapshot, and all three ranks reshard the newest complete step from DP 2 onto DP 3."""
    c = cluster("2:3", ["--spare-wait", "1"])
    log = tmp_path / "loss.jsonl"
    grown = c.grown(LOST, ["--loss-log", str(log), "--steps", "100000", "--lose-node-at", str(LOST_AT),
                           "--die-rank", str(LOST)], ("tp1.pp1.dp2.zero2", "tp1.pp1.dp3.zero2"), log)
    assert c.out(0).count("[example] batch global=12 micro=2 accumulation=2 dp=3") == 2  # at the start, grown
    assert grown > LOST_AT


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["disk", "none"])
def test_a_second_loss_before_the_first_snapshot_after_a_shrink_is_protected_falls_to_the_disk_tier(cluster,
                                                                                                     tmp_path, tier):
    """Node 2 is lost after step 7 (the job goes on at 2 nodes from step 6), then node 1 after step 8 of the
    2-node run, before its first snapshot (step 9): two of the three nodes that protect step 6 are gone, so node 0
    alone cannot rebuild it from memory. Its SMP says it runs unprotected now (one node, m=1), and the rank
    resumes from step 6 on the SMPs' disk tier, with one line saying what was lost and which step is loaded from
    disk, no traceback; the job trains to the end on one node. Without a disk tier the one line says that, and the
    job stops (a restart cannot help)."""
    disk = tmp_path / "disk"
    c = cluster("1:3", ["--spare-wait", "1"],
                smp_args=f"--persist-dir {disk} --persist-every-steps {INTERVAL}" if tier == "disk" else "")
    log = tmp_path / "loss.jsonl"
    lose = {LOST: ["--lose-node-at", str(LOST_AT), "--die-rank", str(LOST)],
            1: ["--lose-node-at", "8", "--die-rank", "1", "--die-attempt", "1"]}
    for node in range(NODES):
        c.start(node, ["--loss-log", str(log), *lose.get(node, [])])
    codes = c.wait(300)
    out = c.out(0)
    assert codes == {0: 0 if tier == "disk" else 1, 1: -signal.SIGKILL, 2: -signal.SIGKILL}, out[-4000:]
    assert "event=shrink nodes=3->2" in out and "event=shrink nodes=2->1" in out, out[-4000:]
    assert "event=ec_groups nodes=0 group=none: 1 node(s) left, too few for m=1" in out
    if tier == "none":
        [line] = [ln for ln in out.splitlines() if "NothingToResume" in ln]
        assert "node(s) [1] are lost" in line and "the SMPs run without a disk tier" in line, line
        assert "Traceback" not in out[out.index("NothingToResume"):] and "event=job_stopped" in out
        return
    # Node 2's listing is still known from the shrink's restore (decoded then): node 1 is what is missing.
    [line] = [ln for ln in out.splitlines() if "event=memory_lost" in ln]
    assert "node(s) [1] are lost" in line and f"step 6 is loaded from the disk tier ({disk / c.job})" in line, line
    restore = next(ln for ln in out.splitlines() if "restore rank=0 step=6 source=memory_resharded" in ln
                   and "to=tp1.pp1.dp1.zero2" in ln)
    assert "from=tp1.pp1.dp3.zero2" in restore and "bytes_disk=" in restore and "bytes_memory" not in restore
    assert "Traceback" not in out[out.index("event=memory_lost"):]  # (the ranks a lost peer failed print theirs)
    assert "[example] batch global=12 micro=2 accumulation=6 dp=1" in out  # the global batch kept on one node
    steps = [json.loads(line)["step"] for line in open(log)]
    assert steps[-(STEPS - 6):] == list(range(7, STEPS + 1)), steps


@pytest.mark.slow
def test_on_shrink_refuse_waits_for_a_node_to_join_and_goes_on_with_it(cluster, tmp_path):
    """A global batch of 6 in micro batches of 2 does not divide on 2 nodes: with on_shrink "refuse", the survivors
    of node 2's loss do not train on another global batch; their ranks exit with SPARE_EXIT and the agents wait,
    saying so, until node 2 comes back (a new agent, an empty SMP that rebuilds step 6 from parity); the job goes
    on at 3 nodes from step 6."""
    c = cluster("2:3", ["--spare-wait", "1"])
    log = tmp_path / "loss.jsonl"
    out = c.refused(LOST, ["--global-batch", "6", "--micro-batch", "2", "--on-shrink", "refuse", "--loss-log",
                           str(log)])
    assert out.count("[example] batch global=6 micro=2 accumulation=1 dp=3") == 2  # at the start, and back at 3
    assert "accumulation=1 dp=2" not in out  # never trained on another global batch
    assert re.search(r"restore rank=2 step=6 source=(peer_reconstruction|memory) ", c.out(LOST)), c.out(LOST)[-4000:]
    steps = [json.loads(line)["step"] for line in open(log)]
    assert steps == [*range(1, LOST_AT + 1), *range(7, STEPS + 1)], steps
