"""The trainer's heartbeat (telemetry.Heartbeat): a few stores into a mapped file per beat, read by the agent and
`inmem-ft launch` through one function (agent/hangs.beats_of), also while its writer is stopped (a hung rank); and
hangs.dump_and_kill, which kills a rank judged hung only if it did not beat or exit while its stacks were dumped."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from inmem_ft.agent import hangs
from inmem_ft.telemetry import Heartbeat, read_heartbeats

BEAT_FOREVER = """
import sys
from inmem_ft.telemetry import Heartbeat
hb = Heartbeat(sys.argv[1], int(sys.argv[2]))
step = 0
while True:
    step += 1
    hb.beat(step=step)
"""


def test_fields_accumulate_and_the_rare_ones_go_beside(tmp_path):
    hb = Heartbeat(str(tmp_path), 3)
    assert read_heartbeats(str(tmp_path)) == {}  # nothing before the first beat
    hb.beat(step=4, restored={"step": 3, "source": "memory", "seconds": 0.5})
    hb.beat(step=5, snapshot_step=5, stall_s=0.01, bytes=128)
    hb.beat(step=6)
    [(rank, beat)] = read_heartbeats(str(tmp_path)).items()
    assert rank == 3 and beat["pid"] == os.getpid() and beat["step"] == 6 and not beat["done"]
    assert (beat["snapshot_step"], beat["stall_s"], beat["bytes"]) == (5, 0.01, 128)
    assert beat["restored"]["source"] == "memory" and time.time() - beat["time"] < 60
    hb.beat(done=True)
    assert read_heartbeats(str(tmp_path))[3]["done"]
    assert os.stat(hb.path).st_mode & 0o777 == 0o600  # owner only


def test_beats_of_ignores_records_of_earlier_processes(tmp_path):
    Heartbeat(str(tmp_path), 0).beat(step=1)
    subprocess.run([sys.executable, "-c", "import sys; from inmem_ft.telemetry import Heartbeat; "
                    "Heartbeat(sys.argv[1], 1).beat(step=1, restored=None)", str(tmp_path)],
                   check=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=60)
    assert sorted(read_heartbeats(str(tmp_path))) == [0, 1]
    assert list(hangs.beats_of(str(tmp_path), {0: os.getpid(), 1: 99})) == [0]


def test_a_stopped_writer_leaves_a_whole_beat_that_goes_stale(tmp_path):
    """Stopped at any instruction of a beat (SIGSTOP, as a hung rank): its last whole beat still reads."""
    proc = subprocess.Popen([sys.executable, "-c", BEAT_FOREVER, str(tmp_path), "0"],
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        deadline = time.monotonic() + 60
        while 0 not in read_heartbeats(str(tmp_path)):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        for _ in range(20):
            proc.send_signal(signal.SIGSTOP)
            _wait_stopped(proc.pid)  # kill() returns before the signal has stopped the process
            beats = hangs.beats_of(str(tmp_path), {0: proc.pid})
            assert beats[0]["step"] > 0, beats
            stopped_at = beats[0]["time"]
            assert hangs.stale(beats, stopped_at + 2, 1.0) == [0]
            assert hangs.beats_of(str(tmp_path), {0: proc.pid})[0]["time"] == stopped_at  # it stays put
            proc.send_signal(signal.SIGCONT)
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.001)


RANK = """
import os, signal, sys, time
from inmem_ft.telemetry import STACK_SIGNAL, Heartbeat, dump_stacks_on
dump_stacks_on(STACK_SIGNAL)
hb = Heartbeat(sys.argv[1], 0)
if sys.argv[2] == "beats":  # slow, not hung: it beats as soon as it runs again
    signal.signal(signal.SIGCONT, lambda *_: hb.beat(step=2))
elif sys.argv[2] == "exits":  # it was finishing
    signal.signal(signal.SIGCONT, lambda *_: os._exit(0))
hb.beat(step=1)
while True:
    time.sleep(0.01)
"""


@pytest.mark.parametrize("then", ["hangs", "beats", "exits"])
def test_dump_and_kill_spares_a_rank_that_beat_or_exited_during_the_dump(tmp_path, then):
    """hangs.dump_and_kill asks a rank judged hung for its stacks (SIGUSR1, then SIGCONT) and kills it, unless its
    heartbeat advanced or it exited meanwhile: then it was not hung, and it is left alone."""
    log = tmp_path / "rank0.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path), then], stderr=err,
                                env={**os.environ, "PYTHONPATH": ROOT})
    try:
        deadline = time.monotonic() + 60
        while not (beats := hangs.beats_of(str(tmp_path), {0: proc.pid})):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        [dump] = hangs.dump_and_kill(beats, {0: str(log)}, str(tmp_path), 10.0).values()
        assert "File \"<string>\"" in dump.stack, dump  # its own stack, from faulthandler
        if then == "hangs":
            assert dump.spared == "" and proc.wait(10) == -signal.SIGKILL
        elif then == "beats":
            assert dump.spared == "it beat again (step 2) while its stacks were dumped", dump
            assert proc.poll() is None
        else:
            assert dump.spared == "it exited while its stacks were dumped", dump
            assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()
