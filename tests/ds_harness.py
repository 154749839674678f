"""Deterministic multi-process DeepSpeed training on CPU/gloo, for fault-tolerance tests.

Each rank is a real OS process (this file, run as a script) so that "losing a rank" is a real SIGKILL.
Every source of state a real trainer has feeds the loss: model + optimizer + LR scheduler (DeepSpeed),
dropout (torch CPU RNG), an augmentation drawing from Python's `random` and numpy's global RNG, and a
data stream whose position advances each step. A checkpoint that forgets any of them shows up as a
loss that differs from the uninterrupted run, bit for bit.

Checkpoints go through a pluggable backend (`backend="module:Class"`), constructed in the worker as
`Class(engine, ckpt_dir)` with `save(step, rank_state)` and `load() -> rank_state | None`, where
rank_state is this rank's harness state (step, stream position, RNG) and the backend keeps it per
rank; the default, `StockCheckpoint`, is DeepSpeed's own save_checkpoint/load_checkpoint on disk.
"""
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from inmem_ft.launcher.ports import free_port

IN_DIM, HIDDEN, OUT_DIM = 16, 48, 8
MICRO_BATCH = 4
STOCK_BACKEND = "ds_harness:StockCheckpoint"
FORGETTABLE = ("python", "numpy", "torch", "stream")


@dataclass(frozen=True)
class HarnessConfig:
    stage: int = 1  # ZeRO stage 0..3
    dtype: str = "fp32"  # "fp32" | "bf16"
    world_size: int = 2
    steps: int = 8
    seed: int = 1234
    # False keeps DeepSpeed from JIT-compiling deepspeed_shm_comm (70-120 s on a fresh 2-core machine);
    # training never uses it (only inference_all_reduce does), so losses are the same either way.
    shm_comm: bool = False


@dataclass
class RunResult:
    """Per-rank losses keyed by 1-based step; `returncodes[r]` is -9 for a rank that was killed."""
    losses: dict  # {rank: {step: float}}
    start_step: dict  # {rank: step the run resumed after (0 for a fresh run)}
    returncodes: dict
    wall_s: float
    out_dir: Path


# ----------------------------------------------------------------------------------------------
# Launcher side (the test process). Imports neither torch nor deepspeed, so it stays light.
# ----------------------------------------------------------------------------------------------

def run(cfg: HarnessConfig, out_dir, *, ckpt_dir=None, save_at=(), resume=False, forget=(),
        kill_rank=None, kill_step=None, backend=STOCK_BACKEND, timeout_s=180.0,
        extra_env=None) -> RunResult:
    """Trains `cfg.steps` steps on `cfg.world_size` rank processes and returns their losses.

    save_at: steps after which every rank saves through `backend` into `ckpt_dir`.
    resume: load the newest checkpoint from `ckpt_dir` first and continue after its step.
    forget: pieces of the harness's own state not restored on resume, out of FORGETTABLE; a negative
      control showing that each of them is needed for a bit-exact resume.
    kill_rank/kill_step: that rank SIGKILLs itself in step `kill_step`, after backward and before the
      optimizer step (so the step is half done, as in a real crash); the launcher then SIGKILLs the
      survivors, which are stuck in or failing on a collective, as a job scheduler would.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not set(forget) <= set(FORGETTABLE):
        raise ValueError(f"forget must be a subset of {FORGETTABLE}")
    spec = dict(asdict(cfg), ckpt_dir=str(ckpt_dir) if ckpt_dir else None, save_at=list(save_at),
                resume=resume, forget=list(forget), kill_rank=kill_rank, kill_step=kill_step, backend=backend,
                out_dir=str(out_dir))
    if (save_at or resume) and not ckpt_dir:
        raise ValueError("save_at/resume need ckpt_dir")
    base_env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                    WORLD_SIZE=str(cfg.world_size), OMP_NUM_THREADS="1",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                             os.environ.get("PYTHONPATH")])))
    # Only used with shm_comm=True: one JIT build shared by all runs instead of one per fresh dir.
    base_env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))
    base_env.update(extra_env or {})
    t0 = time.monotonic()
    procs = []
    for rank in range(cfg.world_size):
        env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, __file__, json.dumps(spec)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    try:
        _wait(procs, kill_rank, timeout_s, out_dir)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    wall = time.monotonic() - t0
    result = RunResult({}, {}, {r: p.returncode for r, p in enumerate(procs)}, wall, out_dir)
    for rank in range(cfg.world_size):
        rec = read_record(out_dir, rank)
        result.losses[rank] = rec["losses"]
        result.start_step[rank] = rec["start_step"]
    return result


def _wait(procs, kill_rank, timeout_s, out_dir):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if kill_rank is not None and codes[kill_rank] is not None:
            if codes[kill_rank] != -signal.SIGKILL:
                raise RuntimeError(f"rank {kill_rank} exited with {codes[kill_rank]} before its kill step\n"
                                   + _log_tail(out_dir, kill_rank))
            return  # survivors are killed by the caller
        if all(c is not None for c in codes):
            bad = [r for r, c in enumerate(codes) if c != 0]
            if bad:
                raise RuntimeError(f"ranks {bad} failed: {codes}\n" + _log_tail(out_dir, bad[0]))
            return
        time.sleep(0.05)
    raise TimeoutError(f"run did not finish in {timeout_s}s\n" + _log_tail(out_dir, 0))


def _log_tail(out_dir, rank, n=4000):
    text = (Path(out_dir) / f"rank{rank}.log").read_text(errors="replace")
    return f"--- rank{rank}.log (tail) ---\n{text[-n:]}"


def read_record(out_dir, rank) -> dict:
    path = Path(out_dir) / f"losses.rank{rank}.json"
    if not path.exists():  # killed before its first step finished
        return {"start_step": None, "losses": {}}
    rec = json.loads(path.read_text())
    rec["losses"] = {int(k): v for k, v in rec["losses"].items()}
    return rec


def run_uninterrupted(cfg: HarnessConfig, out_dir, **kw) -> RunResult:
    return run(cfg, out_dir, **kw)


def run_and_kill(cfg: HarnessConfig, out_dir, *, kill_rank: int, kill_step: int, ckpt_dir=None,
                 save_at=(), **kw) -> RunResult:
    return run(cfg, out_dir, ckpt_dir=ckpt_dir, save_at=save_at, kill_rank=kill_rank, kill_step=kill_step, **kw)


def run_resume(cfg: HarnessConfig, out_dir, *, ckpt_dir, forget=(), **kw) -> RunResult:
    return run(cfg, out_dir, ckpt_dir=ckpt_dir, resume=True, forget=forget, **kw)


def assert_same_losses(expected: RunResult, actual: RunResult):
    """Bit-exact: Python floats from fp32/bf16 tensors compare exactly, and JSON round-trips them."""
    bad = [(step, rank, got, expected.losses[rank][step])
           for rank, losses in actual.losses.items() for step, got in losses.items()
           if got != expected.losses[rank][step]]
    if bad:
        step, rank, got, want = min(bad)
        raise AssertionError(f"{len(bad)} losses differ; first: step {step} rank {rank}: {got!r} != {want!r}")


def check_resume(cfg: HarnessConfig, work_dir, *, save_step: int, kill_rank: int, kill_step: int,
                 backend=STOCK_BACKEND, reference: RunResult = None) -> dict:
    """Save at `save_step`, crash at `kill_step`, resume: the losses must equal the uninterrupted run.

    Returns {"ref", "crash", "resume"} -> RunResult, for timings or further checks.
    """
    if not save_step < kill_step <= cfg.steps:
        raise ValueError("need save_step < kill_step <= steps")
    work_dir = Path(work_dir)
    ckpt = work_dir / "ckpt"
    ref = reference or run_uninterrupted(cfg, work_dir / "ref")
    crashed = run_and_kill(cfg, work_dir / "crash", kill_rank=kill_rank, kill_step=kill_step,
                           ckpt_dir=ckpt, save_at=(save_step,), backend=backend)
    resumed = run_resume(cfg, work_dir / "resume", ckpt_dir=ckpt, backend=backend)
    assert_same_losses(ref, crashed)
    assert crashed.losses[kill_rank].keys() == set(range(1, kill_step)), "kill came at the wrong step"
    assert set(resumed.start_step.values()) == {save_step}
    assert_same_losses(ref, resumed)
    assert all(r.keys() == set(range(save_step + 1, cfg.steps + 1)) for r in resumed.losses.values())
    return {"ref": ref, "crash": crashed, "resume": resumed}


# ----------------------------------------------------------------------------------------------
# Worker side (one rank process).
# ----------------------------------------------------------------------------------------------

def ds_config(cfg) -> dict:
    conf = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        # torch_adam: DeepSpeed's FusedAdam would JIT-compile a C++ op on CPU.
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
        # The scheduler has state of its own that a resume must bring back.
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 4}},
        "zero_optimization": {"stage": cfg["stage"]},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg["dtype"] == "bf16":
        conf["bf16"] = {"enabled": True}
    return conf


def build_model(seed):
    import torch
    from torch import nn
    torch.manual_seed(seed)  # identical initial weights on every rank
    return nn.Sequential(nn.Linear(IN_DIM, HIDDEN), nn.GELU(), nn.Dropout(0.1),
                         nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Dropout(0.1),
                         nn.Linear(HIDDEN, OUT_DIM))


class SyntheticStream:
    """Batch i of rank r is a pure function of (seed, r, i); the position is the stream's only state."""

    def __init__(self, seed, rank):
        import torch
        self.seed, self.rank, self.position = seed, rank, 0
        teacher = torch.Generator().manual_seed(seed)
        self.teacher = torch.randn(IN_DIM, OUT_DIM, generator=teacher)

    def next(self):
        import torch
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.position)
        self.position += 1
        x = torch.randn(MICRO_BATCH, IN_DIM, generator=g)
        return x, torch.tanh(x @ self.teacher)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, sd):
        self.position = sd["position"]


def augment(x):
    # Python's and numpy's global RNGs stand in for a data pipeline's augmentations.
    import random
    import numpy as np
    import torch
    scale = 1.0 + 0.1 * random.random()
    noise = torch.from_numpy(np.random.standard_normal(x.shape).astype("float32"))
    return x * scale + 0.05 * noise


def capture_rng() -> dict:
    import random
    import numpy as np
    import torch
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng(state, skip=()):
    import random
    import numpy as np
    import torch
    if "python" not in skip:
        random.setstate(state["python"])
    if "numpy" not in skip:
        np.random.set_state(state["numpy"])
    if "torch" not in skip:
        torch.set_rng_state(state["torch"])


def seed_rngs(seed):
    import random
    import numpy as np
    import torch
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class StockCheckpoint:
    """DeepSpeed's own checkpointing, with the harness's per-rank state carried in client_state.

    client_state lands in the model-states file, which ZeRO-0/1/2 write on DP rank 0 only and every
    rank reads back: a rank's own RNG and stream position would be lost (all ranks would resume with
    rank 0's). So every rank's state is gathered into rank 0's client_state, and each rank picks its
    own on load. DeepSpeed saves no RNG state itself.
    """

    def __init__(self, engine, ckpt_dir):
        self.engine, self.ckpt_dir = engine, ckpt_dir

    def save(self, step, rank_state):
        import deepspeed.comm as dist
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, rank_state)
        self.engine.save_checkpoint(self.ckpt_dir, tag=f"step{step}", client_state={"harness_ranks": states})

    def load(self):
        import deepspeed.comm as dist
        path, client_state = self.engine.load_checkpoint(self.ckpt_dir)
        return None if path is None else client_state["harness_ranks"][dist.get_rank()]


def _import_attr(spec):
    import importlib
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def _disable_shm_comm():
    # DeepSpeed builds the op only when this probe says it is compatible; False is the path DeepSpeed
    # itself takes off Linux (ShareMemCommBuilder.is_compatible), falling back to plain gloo.
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _write_record(out_dir, rank, start_step, losses, timings):
    path = Path(out_dir) / f"losses.rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"start_step": start_step, "losses": losses, "timings": timings}))
    os.replace(tmp, path)  # a SIGKILL never leaves a torn record


def worker(spec: dict):
    t_start = time.monotonic()
    import torch
    torch.set_num_threads(1)  # 4 ranks on 2 cores; also keeps reductions in one fixed order
    import deepspeed
    if not spec["shm_comm"]:
        _disable_shm_comm()
    rank = int(os.environ["RANK"])
    t0 = time.monotonic()
    deepspeed.init_distributed(dist_backend="gloo")
    t_dist = time.monotonic() - t0

    model = build_model(spec["seed"])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(spec))
    seed_rngs(spec["seed"] + 17 * rank)  # per-rank dropout masks and augmentations
    stream = SyntheticStream(spec["seed"], rank)
    ckpt = _import_attr(spec["backend"])(engine, spec["ckpt_dir"]) if spec["ckpt_dir"] else None

    start_step = 0
    if spec["resume"]:
        state = ckpt.load()
        if state is None:
            raise RuntimeError(f"nothing to resume from in {spec['ckpt_dir']}")
        start_step = state["step"]
        assert engine.global_steps == start_step, (engine.global_steps, start_step)
        if "stream" not in spec["forget"]:
            stream.load_state_dict(state["stream"])
        restore_rng(state["rng"], skip=spec["forget"])

    timings = {"dist_init_s": t_dist, "ready_s": time.monotonic() - t_start}
    losses = {}
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    for step in range(start_step + 1, spec["steps"] + 1):
        x, y = stream.next()
        out = engine(augment(x).to(dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        engine.backward(loss)
        if rank == spec["kill_rank"] and step == spec["kill_step"]:
            os.kill(os.getpid(), signal.SIGKILL)
        engine.step()
        losses[step] = loss.item()
        if step == start_step + 1:
            timings["first_step_s"] = time.monotonic() - t_start
        if step in spec["save_at"]:
            t0 = time.monotonic()
            ckpt.save(step, {"step": step, "stream": stream.state_dict(), "rng": capture_rng()})
            timings[f"save{step}_s"] = time.monotonic() - t0
        _write_record(spec["out_dir"], rank, start_step, losses, timings)
    timings["total_s"] = time.monotonic() - t_start
    _write_record(spec["out_dir"], rank, start_step, losses, timings)



if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(worker, json.loads(sys.argv[1]))  # the process groups are destroyed on every path (issue 23)
