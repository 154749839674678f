"""The trainer's heartbeat (telemetry.Heartbeat): a few stores into a mapped file per beat, read by the agent and
`inmem-ft launch` through one function (agent/hangs.beats_of), also while its writer is stopped (a hung rank)."""
import os
import signal
import subprocess
import sys
import time

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
