#!/usr/bin/env bash
# torchrun_inmem.sh: run one node of an inmem_ft-protected torchrun job.
#
# Usage (on every node, the same command; `inmem-ft launch-script torchrun > torchrun_inmem.sh` writes it out):
#   INMEM_FT_JOB=myjob INMEM_FT_MEMORY_BUDGET=64GiB \
#   NNODES=4 NODE_RANK=<0..3> NPROC_PER_NODE=8 MASTER_ADDR=node0 MASTER_PORT=29500 \
#     bash torchrun_inmem.sh train.py --train-args...
#
# This script only turns the environment below into arguments (a clear message and exit code 2 on a bad
# one) and then becomes `inmem-ft run` (torchrun with inmem_ft's agent, see docs/agent.md), which on this node:
#   1. starts the node's SMP, an owner-only daemon that holds the ranks' in-memory snapshots (or reuses one
#      that already serves this job and node: a re-queued job whose previous launcher was killed), and
#      starts it again should it die (the new one adopts the snapshots, the ranks restart and restore);
#   2. runs the ranks with --max-restarts: when a rank fails or hangs (no heartbeat for INMEM_FT_HANG_TIMEOUT
#      seconds: its stacks go to the log, then it is killed), every rank restarts (on warm standby processes,
#      see INMEM_FT_STANDBYS) and restores from the SMPs; it logs the time each failure cost, part by part;
#   3. when the job ends stops the SMP; on SIGTERM/SIGINT/SIGHUP at once, with SIGTERM, so that it writes its
#      newest complete step to INMEM_FT_PERSIST_DIR first. A job that finished (every rank exited 0, no
#      signal) has its snapshots released; after a failure or a stop from outside they stay in shared memory
#      (/dev/shm/inmemft-<uid>/inmemft.<job>.*) so that a re-queued job under the same job id resumes from
#      them (INMEM_FT_WIPE_ON_EXIT changes this). `inmem-ft smp status` lists what stopped SMPs left there,
#      `inmem-ft smp clean --job <job>` frees it.
#
# Environment:
#   INMEM_FT_JOB            job id, 1-64 of [A-Za-z0-9_-] (default: $SLURM_JOB_ID); the same on every node
#   INMEM_FT_MEMORY_BUDGET  shared memory this node's SMP may use, e.g. 64GiB (required)
#   NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT
#                           the usual torchrun variables (defaults 1, 0, 1, 127.0.0.1, 29500; MASTER_ADDR
#                           is required when NNODES > 1). NODE_RANK is also the SMP's node id.
#   INMEM_FT_MAX_RESTARTS   torchrun --max-restarts (default 3)
#   INMEM_FT_RDZV_BACKEND   torchrun rendezvous: c10d (default) or static (see below)
#   INMEM_FT_LOCAL_ADDR     this node's address for torchrun (--local-addr); c10d orders the nodes by it
#   INMEM_FT_SECRET / INMEM_FT_SECRET_FILE
#                           the per-job SMP-to-SMP secret (erasure coding across nodes), as a value or as
#                           a file that only its owner can read (mode 0600). It is put in the SMP's
#                           environment only: never on a command line, never in the trainers' environment.
#   INMEM_FT_SMP_ARGS       extra arguments for `inmem-ft smp start` (split on whitespace), e.g. the EC
#                           options "--parity 1 --nodes 4 --peers 0=node0:7100,1=node1:7100,..."
#   INMEM_FT_WIPE_ON_EXIT   when to delete this node's snapshots from shared memory as the job ends:
#                           finished (default: when the ranks succeeded and no signal stopped the job), 1 (always;
#                           when signalled, after the SMP wrote to INMEM_FT_PERSIST_DIR), 0 (never: keep even
#                           a finished job's, e.g. to `inmem-ft export` it)
#   INMEM_FT_PERSIST_DIR    the disk tier: a directory (shared or node-local disk) where the SMP, when this
#                           launcher is signalled (preemption, scancel, requeue, time limit), writes the newest step
#                           complete on every rank before it exits; a later SMP of the same job and node
#                           that finds nothing in shared memory starts from it (restore logs
#                           source=disk). Size it for one snapshot per rank of the node. INMEM_FT_SPILL_DIR, its
#                           old name, still works in this release (with a deprecation line).
#   INMEM_FT_RUNTIME_DIR    where SMP sockets and logs go (default $XDG_RUNTIME_DIR/inmem_ft or
#                           /tmp/inmem_ft-<uid>); the SMP log is <dir>/<job>/node<NODE_RANK>.log
#   INMEM_FT_HANG_TIMEOUT   seconds without a heartbeat (one per step) after which a rank is hung (default 300;
#                           0: off)
#   INMEM_FT_STANDBYS       warm standby processes per node for `inmem-ft run` (default: one per local rank;
#                           0: off): they have imported torch and what the ranks import, and the restarted
#                           ranks start on them instead of importing everything again
#   INMEM_FT_AGENT          inmem (default) or torchrun: torch's restarts alone, hang detection and standbys off
#                           (the SMP is still started, supervised and stopped by the agent)
#   PYTHON                  the interpreter (default: `python` on PATH). TORCHRUN is no longer used.
#   TORCHRUN_ARGS           extra torchrun arguments (split on whitespace), e.g. "--log-dir /tmp/tr"
#
# Rendezvous: with c10d (the default) torchrun assigns node ranks itself, ignoring NODE_RANK, in the
# sorted order of the nodes' --local-addr: each agent keeps its place across restarts, so a rank restores
# from the SMP it saved to; where NODE_RANK is each node's place in that order (slurm_inmem.sbatch does
# this), RANK = NODE_RANK * NPROC_PER_NODE + LOCAL_RANK also across a re-queue. With static, RANK = NODE_RANK *
# NPROC_PER_NODE + LOCAL_RANK always, also across a re-queue, at the cost of torchrun's membership
# handling (the survivors restart when their collectives fail, not when the agents notice).
#
# Log lines: "[inmem_ft] launch node=N event=..." (start, torchrun, then from `inmem-ft run`: smp_started,
# smp_reused, signal, smp_stopped, torchrun_exit; error) and "[inmem_ft] agent node=N event=..." (smp_lost,
# hang, hang_stack, time_lost, ...).
# Exit code: the agent's (0: the ranks succeeded; 1: they failed; 128 + N: stopped by signal N); 2 for bad
# input; 3 if the SMP could not be started.
set -uo pipefail

NODE_RANK="${NODE_RANK:-0}"
PROG="$(basename "$0")"

log() { echo "[inmem_ft] launch node=${NODE_RANK} event=$*" >&2; }
fail() {  # fail CODE MESSAGE
    local code="$1"; shift
    echo "$PROG: error: $*" >&2
    log "error rc=${code} msg=\"$*\""
    exit "$code"
}
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0" >&2
    [[ $# -lt 1 ]] && exit 2
    exit 0
fi

INMEM_FT_JOB="${INMEM_FT_JOB:-${SLURM_JOB_ID:-}}"
NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
MASTER_PORT="${MASTER_PORT:-29500}"
MAX_RESTARTS="${INMEM_FT_MAX_RESTARTS:-3}"
RDZV_BACKEND="${INMEM_FT_RDZV_BACKEND:-c10d}"
PYTHON="${PYTHON:-python}"
AGENT="${INMEM_FT_AGENT:-inmem}"

[[ -n "$INMEM_FT_JOB" ]] || fail 2 "INMEM_FT_JOB is not set: give the job a id (the same on every node)"
[[ "$INMEM_FT_JOB" =~ ^[A-Za-z0-9_-]{1,64}$ ]] \
    || fail 2 "INMEM_FT_JOB='$INMEM_FT_JOB' must be 1-64 characters of letters, digits, '_' or '-'"
[[ -n "${INMEM_FT_MEMORY_BUDGET:-}" ]] \
    || fail 2 "INMEM_FT_MEMORY_BUDGET is not set: the shared memory this node's SMP may use, e.g. 64GiB"
for var in NNODES NODE_RANK NPROC_PER_NODE MASTER_PORT MAX_RESTARTS; do
    is_uint "${!var}" || fail 2 "$var='${!var}' must be a non-negative integer"
done
(( NNODES >= 1 )) || fail 2 "NNODES must be at least 1"
(( NPROC_PER_NODE >= 1 )) || fail 2 "NPROC_PER_NODE must be at least 1"
(( NODE_RANK < NNODES )) || fail 2 "NODE_RANK=$NODE_RANK must be below NNODES=$NNODES"
if [[ -z "${MASTER_ADDR:-}" ]]; then
    (( NNODES == 1 )) || fail 2 "MASTER_ADDR is not set: the address of node 0, reachable from every node"
    MASTER_ADDR=127.0.0.1
fi
[[ "$RDZV_BACKEND" == c10d || "$RDZV_BACKEND" == static ]] \
    || fail 2 "INMEM_FT_RDZV_BACKEND='$RDZV_BACKEND' must be c10d or static"
command -v "$PYTHON" >/dev/null || fail 2 "PYTHON='$PYTHON' not found on PATH"
[[ "$AGENT" == inmem || "$AGENT" == torchrun ]] || fail 2 "INMEM_FT_AGENT='$AGENT' must be inmem or torchrun"

# The secret file is read here; `inmem-ft run` takes INMEM_FT_SECRET out of its environment before any rank
# starts and gives it to the SMP alone.
if [[ -n "${INMEM_FT_SECRET:-}" && -n "${INMEM_FT_SECRET_FILE:-}" ]]; then
    fail 2 "both INMEM_FT_SECRET and INMEM_FT_SECRET_FILE are set: give the secret one way"
elif [[ -n "${INMEM_FT_SECRET_FILE:-}" ]]; then
    f="$INMEM_FT_SECRET_FILE"
    [[ -f "$f" && -r "$f" ]] || fail 2 "secret file '$f' does not exist or is not readable"
    read -r owner mode < <(stat -L -c '%u %a' -- "$f")
    [[ "$owner" == "$(id -u)" ]] || fail 2 "secret file '$f' is owned by uid $owner, not by you (uid $(id -u))"
    (( (8#$mode & 8#077) == 0 )) \
        || fail 2 "secret file '$f' is readable by group/others (mode $mode): chmod 600 '$f'"
    INMEM_FT_SECRET="$(<"$f")"
    INMEM_FT_SECRET="${INMEM_FT_SECRET#"${INMEM_FT_SECRET%%[![:space:]]*}"}"  # strip whitespace, as the SMP does
    INMEM_FT_SECRET="${INMEM_FT_SECRET%"${INMEM_FT_SECRET##*[![:space:]]}"}"
    [[ -n "$INMEM_FT_SECRET" ]] || fail 2 "secret file '$f' is empty"
    export INMEM_FT_SECRET
    unset INMEM_FT_SECRET_FILE
fi

read -r -a torchrun_extra <<< "${TORCHRUN_ARGS:-}"
export INMEM_FT_JOB INMEM_FT_NODE="$NODE_RANK"
agent=(--job "$INMEM_FT_JOB" --memory-budget "$INMEM_FT_MEMORY_BUDGET")
[[ "$AGENT" == torchrun ]] && agent+=(--hang-timeout 0 --standbys 0)

rdzv=(--rdzv-backend="$RDZV_BACKEND" --rdzv-id="$INMEM_FT_JOB")
if [[ "$RDZV_BACKEND" == c10d ]]; then
    # Node 0 hosts the rendezvous store (deterministic also when every node resolves to one host).
    is_host=false; (( NODE_RANK == 0 )) && is_host=true
    rdzv+=(--rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" --rdzv-conf="is_host=${is_host}")
    [[ -n "${INMEM_FT_LOCAL_ADDR:-}" ]] && rdzv+=(--local-addr="$INMEM_FT_LOCAL_ADDR")
else
    rdzv+=(--node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT")
fi
cmd=("$PYTHON" -m inmem_ft run "${agent[@]}" --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" "${rdzv[@]}"
     --max-restarts="$MAX_RESTARTS" "${torchrun_extra[@]}" "$@")
log "start job=${INMEM_FT_JOB} nnodes=${NNODES} nproc_per_node=${NPROC_PER_NODE}" \
    "master=${MASTER_ADDR}:${MASTER_PORT} rdzv=${RDZV_BACKEND} max_restarts=${MAX_RESTARTS}"
log "torchrun cmd=\"${cmd[*]}\""
exec "${cmd[@]}"
