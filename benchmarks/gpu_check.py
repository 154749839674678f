"""The one-GPU check (issue 36): every figure the GPU data path promises, measured side by side in one run.

    python benchmarks/gpu_check.py                      # one H100/H200: <= 8.3 minutes, JSON to $OUT
    python benchmarks/gpu_check.py --device cpu --quick # seconds; the default suite runs this

Phases, each in a subprocess of its own under a time cap (what it measured before the cap is kept), each
skipped with its reason where the device or a package is missing:
  a  gpu_tests     the `gpu`-marked tests (pytest -m gpu)
  b  training      bf16 model, fp32 masters, fused AdamW: 30 steps without and 30 with a snapshot every 5
                   (save(overlap=True) before forward, fence() before the update):
                   step-time ratio, training thread's wait per snapshot, copy GB/s against a plain pinned
                   copy of the same tensors, commit time
  c  many_tensors  save() blocking of 100,000 small device tensors against 10 of the same bytes
  d  restore       restore(to_device=True) GB/s against a plain pinned H2D copy, bit-exact, restore + first
                   step against torch.load from disk + first step
  e  deepspeed     examples/deepspeed_gpt.py on the device (NCCL, bf16, torch's fused AdamW), ZeRO-1 and
                   ZeRO-3: killed (-9) after a snapshot and resumed from memory, losses bit-identical to an
                   uninterrupted run; then a 2-rank snapshot taken on the host (gloo, the device hidden)
                   resharded onto the one device rank, every parameter and moment equal to the host's
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import torch

import report  # benchmarks/report.py (the script's own folder is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PHASES = ["gpu_tests", "training", "many_tensors", "restore", "deepspeed"]
# Seconds per phase on the device: 500 at most, which leaves a device session of 15 minutes room for its start
# and one rerun of a phase.
CAPS = {"gpu_tests": 100, "training": 120, "many_tensors": 60, "restore": 60, "deepspeed": 160}
GOALS = "blocked <= 0.1 x copy; step ratio <= 1.02; copy >= 0.8 x pinned; restore >= 0.7 x pinned H2D; " \
        "100,000 tensors <= 2 x 10"


def sync() -> None:
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def host_buffer(size: int, device: torch.device) -> torch.Tensor:
    """The plain pinned copy's target (pageable on a host without an accelerator)."""
    return torch.empty(size, dtype=torch.uint8, pin_memory=device.type != "cpu")


def plain_copy_s(tensors, device: torch.device, to_device: bool) -> float:
    """One flat pinned host buffer and every tensor copied through it non-blocking: the floor of a snapshot's
    copy out (or a restore's copy in)."""
    buf, offset, views = host_buffer(nbytes(tensors), device), 0, []
    for t in tensors:
        t = torch.empty_like(t) if to_device else t.detach()  # a restore's fresh device tensors
        n = t.numel() * t.element_size()
        views.append((buf[offset:offset + n].view(t.dtype).view(t.shape), t))
        offset += n
    times = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for host, dev in views:
            (dev.copy_(host, non_blocking=True) if to_device else host.copy_(dev, non_blocking=True))
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


class Smp:
    """One SMP (node 0) and a Snapshotter on it, for a phase's worker process."""

    def __init__(self, budget: int):
        from inmem_ft import SnapshotConfig, Snapshotter
        from inmem_ft.smp import control

        self.job = f"gpuchk{uuid.uuid4().hex[:8]}"
        control.start(self.job, 0, budget)
        self.snap = Snapshotter(SnapshotConfig(job=self.job))

    def close(self) -> None:
        from inmem_ft.smp import control, paths

        self.snap.close()
        control.stop(paths.default_socket(self.job, 0), wipe=True)


def build(hidden: int, blocks: int, device: torch.device):
    """A bf16 model with fp32 master weights under AdamW (fused on an accelerator), as mixed precision trains."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                                      torch.nn.Linear(4 * hidden, hidden)) for _ in range(blocks)])
    model = model.to(device=device, dtype=torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-4, fused=device.type != "cpu")

    def step(batch: torch.Tensor, before_update=None) -> float:
        loss = model(batch).float().pow(2).mean()
        loss.backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        if before_update is not None:
            before_update()  # the fence: the update must not run before an overlapped snapshot's copy
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
        return loss.detach()

    def state(i: int) -> dict:
        return {"model": model.state_dict(), "masters": masters, "optimizer": opt.state_dict(), "step": i}

    return model, masters, opt, step, state


def state_tensors(state: dict) -> list[torch.Tensor]:
    out = list(state["model"].values()) + list(state["masters"])
    out += [v for s in state["optimizer"]["state"].values() for v in s.values()
            if isinstance(v, torch.Tensor) and v.numel() > 1]
    return out


def phase_training(args, device, out) -> None:
    hidden, blocks, batch = (64, 2, 8) if args.quick else (4096, 5, 16)  # 5 x 2 x 4096 x 16384 = 671M params
    model, masters, opt, step, state = build(hidden, blocks, device)
    x = torch.randn(batch, 512 if not args.quick else 4, hidden, device=device, dtype=torch.bfloat16)
    step(x)  # materializes AdamW's moments
    tensors = state_tensors(state(0))
    size = nbytes(tensors)
    out.update(params=sum(p.numel() for p in model.parameters()), state_bytes=size)
    out["plain_pinned_copy_s"] = plain_copy_s(tensors, device, to_device=False)
    out["plain_pinned_gbps"] = size / out["plain_pinned_copy_s"] / 1e9
    args.save()
    steps = 10 if args.quick else 30

    def run(snapshots: bool, smp: Smp | None):
        times, waits, commits = [], [], []
        for i in range(1, steps + 1):
            sync()
            t0 = time.perf_counter()
            if snapshots and i % 5 == 0:
                smp.snap.save(i, state(i), overlap=True)  # the copy runs behind forward and backward
                waits.append(time.perf_counter() - t0)

                def fence():  # what fence_optimizer does before the step, timed as the training thread's wait
                    t1 = time.perf_counter()
                    smp.snap.fence()
                    waits[-1] += time.perf_counter() - t1
                step(x, fence)
            else:
                step(x)
            sync()
            times.append(time.perf_counter() - t0)
            if snapshots and smp.snap.metrics.last_committed:
                commits.append(smp.snap.metrics.last_committed["commit_s"])
        return statistics.mean(times), waits, commits

    out["step_s_without"] = run(False, None)[0]
    args.save()
    smp = Smp(2 * size + (1 << 30))
    try:
        smp.snap.save(0, state(0))  # the first snapshot lays out and registers the slot, as at job start
        smp.snap.wait()
        sync()
        t0 = time.perf_counter()
        smp.snap.save(1, state(1))  # not overlapped: the device waits for the whole copy out
        sync()
        out["copy_s"] = time.perf_counter() - t0
        smp.snap.wait()
        out["copy_gbps"] = size / out["copy_s"] / 1e9
        out["copy_vs_pinned"] = out["copy_gbps"] / out["plain_pinned_gbps"]
        args.save()
        with_s, waits, commits = run(True, smp)
        smp.snap.wait()
        commits.append(smp.snap.metrics.last_commit_s)
    finally:
        smp.close()
    out.update(step_s_with=with_s, step_ratio=with_s / out["step_s_without"],
               wait_per_snapshot_s=statistics.median(waits), commit_s=statistics.median(commits),
               blocked_vs_copy=statistics.median(waits) / out["copy_s"])


def phase_many_tensors(args, device, out) -> None:
    total = (1000 if args.quick else 100_000) * 256  # fp32 elements: 100 MiB on the device
    for count in (10, total // 256):
        torch.manual_seed(0)
        tensors = {f"t{i}": torch.randn(total // count, device=device) for i in range(count)}
        smp = Smp(3 * total * 4 + (256 << 20))
        try:
            smp.snap.save(0, tensors)
            smp.snap.wait()
            stalls = []
            for i in range(1, 4):
                sync()
                t0 = time.perf_counter()
                smp.snap.save(i, tensors)
                stalls.append(time.perf_counter() - t0)
                smp.snap.wait()
        finally:
            smp.close()
        out[f"blocking_{count}_s"] = statistics.median(stalls)
        args.save()
    out["count"] = total // 256
    out["ratio"] = out[f"blocking_{total // 256}_s"] / out["blocking_10_s"]


def phase_restore(args, device, out) -> None:
    hidden, blocks, batch = (64, 2, 8) if args.quick else (4096, 2, 16)
    model, masters, opt, step, state = build(hidden, blocks, device)
    x = torch.randn(batch, hidden, device=device, dtype=torch.bfloat16)
    step(x)
    saved = state(1)
    tensors = state_tensors(saved)
    size = nbytes(tensors)
    expected = [t.detach().clone() for t in tensors]
    out["state_bytes"] = size
    out["plain_pinned_h2d_s"] = plain_copy_s(tensors, device, to_device=True)
    smp = Smp(2 * size + (1 << 30))
    try:
        smp.snap.save(1, saved)
        smp.snap.wait()
        sync()
        t0 = time.perf_counter()
        back = smp.snap.restore(to_device=True)
        sync()
        out["restore_s"] = time.perf_counter() - t0
        got = state_tensors(back)
        out["bit_exact"] = len(got) == len(expected) and all(
            g.device == e.device and torch.equal(g, e) for g, e in zip(got, expected))
        out["restore_vs_pinned"] = out["plain_pinned_h2d_s"] / out["restore_s"]
        args.save()
        sync()
        t0 = time.perf_counter()
        back = smp.snap.restore(to_device=True)
        model.load_state_dict(back["model"])
        step(x)
        sync()
        out["restore_first_step_s"] = time.perf_counter() - t0
    finally:
        smp.close()
    with tempfile.TemporaryDirectory() as d:
        torch.save(saved, os.path.join(d, "state.pt"))
        sync()
        t0 = time.perf_counter()
        loaded = torch.load(os.path.join(d, "state.pt"), map_location=device, weights_only=False)
        model.load_state_dict(loaded["model"])
        step(x)
        sync()
        out["disk_first_step_s"] = time.perf_counter() - t0


def phase_deepspeed(args, device, out) -> None:
    from inmem_ft.launcher.simulated import SimulatedCluster

    steps, interval, die_at = (8, 2, 4) if args.quick else (12, 4, 8)
    example = ["-m", "inmem_ft.examples.deepspeed_gpt", "--dtype", "bf16", "--steps", str(steps),
               "--interval", str(interval), "--global-batch", "8"]
    logs = tempfile.mkdtemp(prefix="gpuchk-ds-")
    device_env = {} if device.type == "cpu" else {"CUDA_VISIBLE_DEVICES": str(device.index or 0)}

    def cluster(ranks: int) -> SimulatedCluster:
        return SimulatedCluster(1, ranks, f"gpuchk{uuid.uuid4().hex[:8]}", 2 << 30, logs)

    def losses(path: str) -> dict:
        with open(path) as f:
            return {r["step"]: r["loss"] for r in map(json.loads, f)}

    def attempt(c: SimulatedCluster, argv: list[str], env: dict | None = None):
        t0 = time.monotonic()
        a = c.run(example + argv, {**device_env, **(env or {})})
        return a, time.monotonic() - t0, c.rank_log(a.number, 0)

    for stage in (1, 3):
        key, zero = f"zero{stage}", ["--zero-stage", str(stage)]
        with cluster(1) as ref_c, cluster(1) as c:
            a, took, log = attempt(ref_c, [*zero, "--loss-log", f"{logs}/{key}-ref.jsonl"])
            out[f"{key}_uninterrupted_s"] = round(took, 2)
            if not a.ok:
                raise SystemExit(f"{key}: the uninterrupted run failed:\n{log[-1500:]}")
            ref = losses(f"{logs}/{key}-ref.jsonl")
            a, _, _ = attempt(c, [*zero, "--loss-log", f"{logs}/{key}-a.jsonl", "--die-at", str(die_at)])
            out[f"{key}_killed"] = a.returncodes.get(0) == -signal.SIGKILL
            a, took, log = attempt(c, [*zero, "--loss-log", f"{logs}/{key}-b.jsonl"])
            out[f"{key}_resumed_s"] = round(took, 2)
            out[f"{key}_from_memory"] = f"step={die_at} source=memory" in log
            got = losses(f"{logs}/{key}-b.jsonl") if a.ok else {}
            out[f"{key}_bit_identical"] = bool(got) and got == {s: ref[s] for s in range(die_at + 1, steps + 1)}
            if not a.ok:
                out[f"{key}_tail"] = log[-1500:]
        args.save()

    # Reshard onto the device: DP 2 on the host (the device hidden: gloo), then DP 1 on the device.
    with cluster(2) as c:
        host, on_device = f"{logs}/host.pt", f"{logs}/device.pt"
        a = c.run(example + ["--zero-stage", "1", "--steps", str(die_at), "--dump-full", host,
                             "--dump-step", str(die_at)], {"CUDA_VISIBLE_DEVICES": ""})
        if not a.ok:
            raise SystemExit(f"the 2-rank host run failed:\n{c.rank_log(a.number, 0)[-1500:]}")
        c.reshape(1, 1)
        a, took, log = attempt(c, ["--zero-stage", "1", "--steps", str(die_at), "--reshard", "auto",
                                   "--dump-full", on_device, "--dump-step", str(die_at)])
        out["reshard_s"] = round(took, 2)
        out["reshard_from_memory"] = f"step={die_at} source=memory" in log or "memory_resharded" in log
        if not a.ok:
            out["reshard_tail"] = log[-1500:]
        else:
            want, got = torch.load(host, map_location="cpu"), torch.load(on_device, map_location="cpu")
            out["reshard_tensors"] = len(want)
            out["reshard_equal"] = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


WORKERS = {"training": phase_training, "many_tensors": phase_many_tensors, "restore": phase_restore,
           "deepspeed": phase_deepspeed}


def worker(args) -> None:
    device = torch.device(args.device)
    out: dict = {}

    def save() -> None:  # after every figure: a phase cut off by its cap keeps what it measured
        with open(args.result, "w") as f:
            json.dump(out, f)

    args.save = save
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index or 0)
    WORKERS[args.phase](args, device, out)
    out["status"] = "ran"
    save()


def subprocess_phase(cmd: list[str], cap: float, env: dict) -> tuple[int | None, str, float]:
    """Run a phase under its cap. At the cap it gets SIGINT first, so that its `finally` blocks and pytest's
    fixtures stop the SMPs they started (daemons in sessions of their own); its group is killed after that."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            rc = None
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        log.seek(0)
        return rc, log.read()[-2000:], time.monotonic() - t0


def skip_reason(name: str, args) -> str | None:
    accel = torch.accelerator.is_available() and args.device != "cpu"
    if name == "gpu_tests" and not accel:
        return f"needs an accelerator (device {args.device})"
    if name in ("training", "many_tensors", "restore") and args.device != "cpu" and not accel:
        return f"device {args.device} is not available"
    missing = [m for m in ("pyeclib", "cryptography") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{', '.join(missing)} not importable: install the bundle (make gpu-bundle; README, GPU check)"
    if name == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed is not importable (install the bundle: make gpu-bundle)"
        if args.quick:
            return "--quick: the DeepSpeed kill -9 resume test takes minutes"
    return None


def run_phase(name: str, args, tmp: str, env: dict) -> dict:
    reason = skip_reason(name, args)
    if reason:
        return {"status": "skipped", "reason": reason}
    cap = CAPS[name]  # an upper bound only: a loaded CPU box running --quick stays far below it
    result = os.path.join(tmp, f"{name}.json")
    if name == "gpu_tests":
        # Only the files that hold gpu tests: collecting the others would import frameworks the device lacks.
        files = sorted(f"tests/{f}" for f in os.listdir(os.path.join(REPO, "tests"))
                       if f.startswith("test_") and "mark.gpu" in open(os.path.join(REPO, "tests", f)).read())
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--phase", name, "--device", args.device,
               "--result", result] + (["--quick"] if args.quick else [])
    rc, tail, took = subprocess_phase(cmd, cap, env)
    out = {}
    if os.path.exists(result):
        with open(result) as f:
            out = json.load(f)
    out.update(seconds=round(took, 1), cap_s=cap)
    if rc is None:
        out.update(status="timed out", reason=f"capped at {cap:.0f} s; figures so far kept", tail=tail)
    elif rc != 0:
        out.update(status="failed", reason=f"exit {rc}", tail=tail)
    else:
        out["status"] = "ran"
        if name == "gpu_tests":
            out["summary"] = tail.strip().splitlines()[-1] if tail.strip() else ""
    return out


def summary(name: str, r: dict) -> str:
    keys = {"gpu_tests": ["summary"], "training": ["step_ratio", "blocked_vs_copy", "copy_vs_pinned", "commit_s"],
            "many_tensors": ["ratio"], "restore": ["restore_vs_pinned", "bit_exact", "restore_first_step_s",
                                                   "disk_first_step_s"], "deepspeed": ["zero1_bit_identical", "zero3_bit_identical",
                                                                        "reshard_equal"]}[name]
    got = [f"{k}={r[k]:.3g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys if k in r]
    return " ".join(got) or r.get("reason", "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.accelerator.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes and caps (seconds on a CPU)")
    p.add_argument("--json", default=None, help="write the results here (default: $OUT/gpu_check.json)")
    p.add_argument("--phase", choices=PHASES, action="append", help="only these phases (repeatable)")
    report.worker_args(p)
    args = p.parse_args()
    if args.worker:
        args.phase = args.phase[0]
        worker(args)
        return 0
    json_path = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    results = {"device": args.device, "quick": args.quick, "goals": GOALS, "phases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, INMEM_FT_RUNTIME_DIR=os.path.join(tmp, "run"), OMP_NUM_THREADS="4",
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for name in PHASES:
            if args.phase and name not in args.phase:
                results["phases"][name] = {"status": "skipped", "reason": "not asked for (--phase)"}
                continue
            with report.phase(f"phase {name}"):
                results["phases"][name] = run_phase(name, args, tmp, env)
            report.write(results, json_path)  # after every phase: a run cut short keeps the phases it did
    print("\n".join(report.table(f"gpu_check on {report.meta()['machine']['gpu'] or 'cpu'} ({args.device})",
                                 [("phase", "{phase}"), ("status", "{status}"), ("s", "{seconds}"),
                                  ("figures", "{figures}")],
                                 [{"phase": n, "status": r["status"], "seconds": r.get("seconds", "-"),
                                   "figures": summary(n, r)} for n, r in results["phases"].items()])))
    print(f"goals: {GOALS}")
    if json_path:
        print(f"JSON: {json_path}")
    return 0


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)
