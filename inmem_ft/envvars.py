"""Every INMEM_FT_* environment variable inmem_ft or its launch scripts read or set: one registry, rendered into
the configuration reference (docs/reference.md) at docs build time; tests/test_envvars.py fails when the code
uses a variable this list lacks, or this list keeps one the code no longer uses."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    read_by: str
    """Who reads it: a Python entry point, or the launch script that reads it."""
    default: str
    unit: str
    text: str
    internal: bool = False
    """Set by inmem_ft itself for its own processes; listed so that nobody wonders, not to be set by hand."""


VARIABLES: tuple[EnvVar, ...] = (
    # Trainer side (SnapshotConfig.from_env, the adapters) and the CLI defaults.
    EnvVar("INMEM_FT_JOB", "trainers, `inmem-ft`, launch scripts", "`default`; `torchrun_inmem.sh`: `$SLURM_JOB_ID`; `slurm_inmem.sbatch`: `inmemft-<SLURM job id>`",
           "name: 1-64 of `[A-Za-z0-9_-]`",
           "Job id: names the SMP socket and the shared-memory segments; the same on every node and across "
           "re-queues of one job."),
    EnvVar("INMEM_FT_NODE", "trainers, `inmem-ft`", "`$GROUP_RANK`, else `$SLURM_NODEID`, else `0`", "index from 0",
           "This node's index: picks the local SMP."),
    EnvVar("INMEM_FT_SMP_SOCKET", "trainers, `inmem-ft`", "`<runtime dir>/<job>/node<node>.sock`", "path",
           "The local SMP's control socket."),
    EnvVar("INMEM_FT_RUNTIME_DIR", "trainers, `inmem-ft`, launch scripts",
           "`$XDG_RUNTIME_DIR/inmem_ft`, else `/tmp/inmem_ft-<uid>`", "directory",
           "Where SMP sockets and logs go; the SMP log is `<dir>/<job>/node<N>.log`."),
    EnvVar("INMEM_FT_SHM_DIR", "SMP, trainers", "`/dev/shm`", "directory (a tmpfs)",
           "Where the segment namespace `inmemft-<uid>/` is created; every process of a node must see the "
           "same value."),
    EnvVar("INMEM_FT_START_FRESH", "trainers", "unset", "`1` or unset",
           "Train from scratch when the SMPs hold snapshots of a completed step that cannot be restored on every "
           "rank (default: fail with `NoUsableSnapshot`, keeping them). Same as `\"start_fresh\": true`."),
    EnvVar("INMEM_FT_ALLOW_UNTESTED", "DeepSpeed and Megatron adapters", "unset", "`1` or unset",
           "Run a DeepSpeed or megatron-core release outside the tested range, with a warning (default: refused "
           "at `install()`). Same as `\"allow_untested\": true`."),
    EnvVar("INMEM_FT_SECRET", "SMP, launch scripts", "unset", "string, at least 16 bytes",
           "The per-job SMP-to-SMP secret itself (needed with `--peers`); put in the SMP's environment only."),
    EnvVar("INMEM_FT_SECRET_FILE", "launch scripts", "unset", "path of a mode-0600 file",
           "The per-job secret as a file; `torchrun_inmem.sh` passes it to the SMP as `--secret-file`. Give "
           "either this or `INMEM_FT_SECRET`."),
    EnvVar("INMEM_FT_PERSIST_DIR", "`inmem-ft smp start`", "unset: no disk tier", "directory",
           "The disk tier's directory (`--persist-dir`)."),
    EnvVar("INMEM_FT_SPILL_DIR", "`inmem-ft smp start`, launch scripts", "unset: no disk tier", "directory",
           "The same directory under its older name: read when `INMEM_FT_PERSIST_DIR` is unset. Size it for one "
           "snapshot per rank of the node."),
    EnvVar("INMEM_FT_LOSS_LOG", "examples, `inmem_ft.telemetry`", "unset: no loss log", "path (JSON lines)",
           "Rank 0 appends `(step, loss)` here; `inmem-ft launch` and the tests compare runs with it."),
    EnvVar("INMEM_FT_DEMO_DIR", "`make demo` (`python -m inmem_ft.demo`)", "`out/demo`", "directory",
           "Where the demo keeps its logs and `timeline.json`."),
    # torchrun_inmem.sh
    EnvVar("INMEM_FT_MEMORY_BUDGET", "launch scripts", "required; `slurm_inmem.sbatch`: `64GiB`", "size, e.g. `64GiB`",
           "Shared memory this node's SMP may use (`--memory-budget`)."),
    EnvVar("INMEM_FT_SMP_ARGS", "`torchrun_inmem.sh`", "empty", "arguments, split on whitespace",
           "Extra arguments for `inmem-ft smp start`, e.g. `--parity 1 --nodes 4 --peers 0=node0:7100,...`."),
    EnvVar("INMEM_FT_MAX_RESTARTS", "`torchrun_inmem.sh`", "`3`", "count", "torchrun `--max-restarts`."),
    EnvVar("INMEM_FT_RDZV_BACKEND", "`torchrun_inmem.sh`", "`c10d`", "`c10d` or `static`",
           "torchrun's rendezvous. c10d orders nodes by `--local-addr`; static keeps `RANK = NODE_RANK x "
           "NPROC_PER_NODE + LOCAL_RANK` and needs `INMEM_FT_MAX_RESTARTS=0` (torch's static store keeps the dead "
           "ranks' addresses across restarts)."),
    EnvVar("INMEM_FT_LOCAL_ADDR", "`torchrun_inmem.sh`", "unset", "address",
           "This node's address for torchrun (`--local-addr`); c10d orders the nodes by it."),
    EnvVar("INMEM_FT_WIPE_ON_EXIT", "`torchrun_inmem.sh`", "`finished`", "`finished`, `1` or `0`",
           "When to delete this node's snapshots from shared memory as the job ends: when torchrun exits 0 "
           "with no signal, always (after the SIGTERM flush), or never."),
    # slurm_inmem.sbatch
    EnvVar("INMEM_FT_PARITY", "`slurm_inmem.sbatch`", "unset: no erasure coding", "nodes (m)",
           "Erasure-code across the allocation's nodes: the script builds `--parity`, `--nodes` and `--peers`."),
    EnvVar("INMEM_FT_PEER_PORT", "`slurm_inmem.sbatch`", "`7100`", "TCP port",
           "Node i's SMP listens for its peers on this port + i."),
    EnvVar("INMEM_FT_STEP_WAIT", "`slurm_inmem.sbatch`", "`300`", "seconds",
           "How long `srun` may wait for SLURM to create the job step."),
    EnvVar("INMEM_FT_LAUNCH_SCRIPT", "`slurm_inmem.sbatch`", "found through `$PYTHON`", "path",
           "The `torchrun_inmem.sh` to run on every node."),
    EnvVar("INMEM_FT_NODE_ORDER", "`slurm_inmem.sbatch`", "set by the script", "`name=addr` list",
           "The allocation's nodes in torchrun's order; each node's task finds its `NODE_RANK` in it.",
           internal=True),
    # `inmem-ft run` (the per-node agent) and the torchrun launch script that runs it.
    EnvVar("INMEM_FT_HANG_TIMEOUT", "`inmem-ft run`, launch scripts", "`300`", "seconds",
           "A rank whose heartbeat (one per step) is older than this is hung: its stacks go to the agent's log, "
           "then it is killed and the node's ranks restart. Same as `inmem-ft run --hang-timeout`."),
    EnvVar("INMEM_FT_STANDBYS", "`inmem-ft run`, launch scripts", "one per local rank", "count",
           "Warm standby processes per node that restarted ranks start on (they skip their imports); `0`: off. "
           "Same as `inmem-ft run --standbys`."),
    EnvVar("INMEM_FT_RDZV_POLL", "`inmem-ft run`, launch scripts", "`auto`: nodes x 1 ms, 0.05 to 1",
           "seconds (>= 0.01) or `auto`",
           "How often the agents' c10d rendezvous re-reads its store while it waits for the other nodes (torch's "
           "own: every second). `auto` keeps the store's load at most about what torch's second gives at 1000 "
           "nodes. Same as `inmem-ft run --rdzv-poll`."),
    EnvVar("INMEM_FT_MIN_NODES", "`torchrun_inmem.sh`", "`$NNODES`", "count, 1 to `NNODES`",
           "The fewest nodes the job trains on: below `NNODES`, the script runs `inmem-ft run --nnodes "
           "MIN:NNODES` and a node lost for good is trained without (see `INMEM_FT_SPARE_WAIT`)."),
    EnvVar("INMEM_FT_SPARE_WAIT", "`inmem-ft run`, launch scripts", "`5`", "whole seconds",
           "With a node range (`--nnodes MIN:MAX`, `NNODES=MIN:MAX`): how long the nodes left after a node loss "
           "wait for another to take its place before they train on without it, the state resharded from memory. "
           "Same as `inmem-ft run --spare-wait`."),
    EnvVar("INMEM_FT_AGENT", "`torchrun_inmem.sh`", "`inmem`", "`inmem` or `torchrun`",
           "`inmem` runs the node under `inmem-ft run`; `torchrun` keeps torch's restarts alone (hang detection and "
           "standbys off); the agent owns the node's SMP either way."),
    # Set by the simulated cluster (launcher/simulated.py, the tests' and benchmarks' harness) and the agent.
    EnvVar("INMEM_FT_ATTEMPT", "ranks of the simulated cluster", "set by the launcher", "count from 1",
           "Which attempt (restart) of the job a rank belongs to.", internal=True),
    EnvVar("INMEM_FT_HEARTBEAT_DIR", "workers under `inmem-ft run`", "set by the agent", "directory",
           "Where each rank's heartbeat record goes (hang detection).", internal=True),
    EnvVar("INMEM_FT_EVENTS", "the agent, the SMP and the ranks under `inmem-ft run`",
           "set by the agent: `<work dir>/events.jsonl`", "path (JSON lines, mode 0600)",
           "The node's events file: each timeline event as one JSON record (inmem_ft/events.py, docs/agent.md); "
           "set it before `inmem-ft run` to put the file elsewhere.", internal=True),
    EnvVar("INMEM_FT_WORKER_RECORD", "ranks of the simulated cluster", "set by the launcher", "path",
           "Where a worker records its start (time lost per failure).", internal=True),
    EnvVar("INMEM_FT_WORKER_RECORD_DIR", "workers under `inmem-ft run`", "set by the agent", "directory",
           "Where each local rank records its start, as `rank<RANK>.json` (time lost per failure).", internal=True),
    EnvVar("INMEM_FT_TEST_CORRUPT_AT", "the examples (tests of the check after a restore)", "unset", "step",
           "Rank 0 makes one Adam second moment negative right after that step's optimizer step, before its "
           "snapshot, on the first attempt only: a state saved bad with valid checksums.", internal=True),
    EnvVar("INMEM_FT_TEST_SPIKE_AT", "the examples (tests of the check after a restore)", "unset", "step",
           "Rank 0 multiplies its first parameter by 30 at that place instead: finite, but the losses after a "
           "restore of it spike above the bound.", internal=True),
    EnvVar("INMEM_FT_TEST_FLIP_AT", "the examples (tests of replica fingerprints)", "unset", "step",
           "Right after that step's optimizer step, one bit of one replicated weight flips on one rank, before "
           "the snapshot: replicas that disagree.", internal=True),
    EnvVar("INMEM_FT_TEST_FLIP_RANK", "the examples (tests of replica fingerprints)", "1", "rank",
           "The rank whose weight INMEM_FT_TEST_FLIP_AT flips.", internal=True),
)
