#!/usr/bin/env bash
# torchrun_inmem.sh: run one node of an inmem_ft-protected torchrun job.
#
# Usage (on every node, the same command; `inmem-ft launch-script torchrun > torchrun_inmem.sh` writes it out):
#   INMEM_FT_JOB=myjob INMEM_FT_MEMORY_BUDGET=64GiB \
#   NNODES=4 NODE_RANK=<0..3> NPROC_PER_NODE=8 MASTER_ADDR=node0 MASTER_PORT=29500 \
#     bash torchrun_inmem.sh train.py --train-args...
#
# What it does on this node:
#   1. checks its inputs (a clear message and exit code 2 on a bad one);
#   2. starts this node's SMP (`python -m inmem_ft smp start`), an owner-only daemon that holds the
#      ranks' in-memory snapshots; if one already serves this job and node (a re-queued job whose
#      previous launcher was killed), it is reused;
#   3. exports INMEM_FT_JOB, INMEM_FT_NODE and INMEM_FT_SMP_SOCKET for the trainers and runs torchrun's
#      agent with inmem_ft's (`inmem-ft run`, torchrun's options) with --max-restarts: when a worker fails
#      or hangs (no heartbeat for INMEM_FT_HANG_TIMEOUT seconds: its stacks go to the log, then it is
#      killed), the agent stops the survivors and restarts every rank (on warm standby processes, see
#      INMEM_FT_STANDBYS), and the restarted ranks restore from
#      the SMPs, which outlive the restarts; the agent logs the time each failure cost, part by part;
#   4. when the job ends (success, failure, SIGTERM/SIGINT/SIGHUP) stops the SMP (on a signal at once,
#      with SIGTERM, so that it writes its newest complete step to INMEM_FT_PERSIST_DIR first). A job that
#      finished (torchrun exit code 0, no signal) has its snapshots released; after a failure or a stop from
#      outside they stay in shared memory (/dev/shm/inmemft-<uid>/inmemft.<job>.*) so that a re-queued job
#      under the same job id resumes from them (INMEM_FT_WIPE_ON_EXIT changes this). `inmem-ft smp status`
#      lists what stopped SMPs left there, `inmem-ft smp clean --job <job>` frees it.
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
#                           finished (default: when torchrun exits 0 and no signal stopped the job), 1 (always;
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
#   INMEM_FT_AGENT          inmem (default: `inmem-ft run`) or torchrun (plain torchrun: no hang detection,
#                           no time-lost report)
#   PYTHON, TORCHRUN        the interpreter, and the torchrun INMEM_FT_AGENT=torchrun uses (default: `python`,
#                           `torchrun` on PATH)
#   TORCHRUN_ARGS           extra torchrun arguments (split on whitespace), e.g. "--log-dir /tmp/tr"
#
# Rendezvous: with c10d (the default) torchrun assigns node ranks itself, ignoring NODE_RANK, in the
# sorted order of the nodes' --local-addr: each agent keeps its place across restarts, so a rank restores
# from the SMP it saved to; where NODE_RANK is each node's place in that order (slurm_inmem.sbatch does
# this), RANK = NODE_RANK * NPROC_PER_NODE + LOCAL_RANK also across a re-queue. With static, RANK = NODE_RANK *
# NPROC_PER_NODE + LOCAL_RANK always, also across a re-queue, at the cost of torchrun's membership
# handling (the survivors restart when their collectives fail, not when the agents notice).
#
# Log lines on stderr: "[inmem_ft] launch node=N event=..." (start, smp_started, smp_reused, torchrun,
# signal, torchrun_exit, smp_stopped, error); the agent's on stdout: "[inmem_ft] agent node=N event=..."
# (hang, hang_stack, time_lost).
# Exit code: torchrun's; 2 for bad input; 3 if the SMP could not be started.
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

# ---- inputs -----------------------------------------------------------------------------------------
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
TORCHRUN="${TORCHRUN:-torchrun}"
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
WIPE_ON_EXIT="${INMEM_FT_WIPE_ON_EXIT:-finished}"
[[ "$WIPE_ON_EXIT" == finished || "$WIPE_ON_EXIT" == 1 || "$WIPE_ON_EXIT" == 0 ]] \
    || fail 2 "INMEM_FT_WIPE_ON_EXIT='$WIPE_ON_EXIT' must be finished, 1 or 0"
if [[ -z "${MASTER_ADDR:-}" ]]; then
    (( NNODES == 1 )) || fail 2 "MASTER_ADDR is not set: the address of node 0, reachable from every node"
    MASTER_ADDR=127.0.0.1
fi
[[ "$RDZV_BACKEND" == c10d || "$RDZV_BACKEND" == static ]] \
    || fail 2 "INMEM_FT_RDZV_BACKEND='$RDZV_BACKEND' must be c10d or static"
command -v "$PYTHON" >/dev/null || fail 2 "PYTHON='$PYTHON' not found on PATH"
[[ "$AGENT" == inmem || "$AGENT" == torchrun ]] || fail 2 "INMEM_FT_AGENT='$AGENT' must be inmem or torchrun"
if [[ "$AGENT" == torchrun ]]; then
    command -v "$TORCHRUN" >/dev/null || fail 2 "TORCHRUN='$TORCHRUN' not found on PATH"
    launcher=("$TORCHRUN")
else  # this script starts and stops the SMP; the agent points the ranks at it
    launcher=("$PYTHON" -m inmem_ft run --no-smp --job "$INMEM_FT_JOB")
fi

# The secret: read here, then removed from this shell's environment; only the SMP gets it.
secret=""
if [[ -n "${INMEM_FT_SECRET:-}" && -n "${INMEM_FT_SECRET_FILE:-}" ]]; then
    fail 2 "both INMEM_FT_SECRET and INMEM_FT_SECRET_FILE are set: give the secret one way"
elif [[ -n "${INMEM_FT_SECRET_FILE:-}" ]]; then
    f="$INMEM_FT_SECRET_FILE"
    [[ -f "$f" && -r "$f" ]] || fail 2 "secret file '$f' does not exist or is not readable"
    read -r owner mode < <(stat -L -c '%u %a' -- "$f")
    [[ "$owner" == "$(id -u)" ]] || fail 2 "secret file '$f' is owned by uid $owner, not by you (uid $(id -u))"
    (( (8#$mode & 8#077) == 0 )) \
        || fail 2 "secret file '$f' is readable by group/others (mode $mode): chmod 600 '$f'"
    secret="$(<"$f")"
    secret="${secret#"${secret%%[![:space:]]*}"}"  # strip surrounding whitespace, as the SMP does
    secret="${secret%"${secret##*[![:space:]]}"}"
    [[ -n "$secret" ]] || fail 2 "secret file '$f' is empty"
elif [[ -n "${INMEM_FT_SECRET:-}" ]]; then
    secret="$INMEM_FT_SECRET"
fi
unset INMEM_FT_SECRET INMEM_FT_SECRET_FILE

read -r -a smp_extra <<< "${INMEM_FT_SMP_ARGS:-}"
read -r -a torchrun_extra <<< "${TORCHRUN_ARGS:-}"
export INMEM_FT_JOB
export INMEM_FT_NODE="$NODE_RANK"

log "start job=${INMEM_FT_JOB} nnodes=${NNODES} nproc_per_node=${NPROC_PER_NODE}" \
    "master=${MASTER_ADDR}:${MASTER_PORT} rdzv=${RDZV_BACKEND} max_restarts=${MAX_RESTARTS}"

# ---- the SMP ----------------------------------------------------------------------------------------
# Socket path as the CLI computes it (INMEM_FT_RUNTIME_DIR etc.), unless INMEM_FT_SMP_SOCKET is given.
if [[ -z "${INMEM_FT_SMP_SOCKET:-}" ]]; then
    INMEM_FT_SMP_SOCKET="$("$PYTHON" -c 'import sys; from inmem_ft.smp.paths import default_socket as s
print(s(sys.argv[1], int(sys.argv[2])))' "$INMEM_FT_JOB" "$NODE_RANK")" \
        || fail 2 "cannot import inmem_ft with PYTHON='$PYTHON' (is it installed, or on PYTHONPATH?)"
fi
export INMEM_FT_SMP_SOCKET
smp=("$PYTHON" -m inmem_ft smp)
node_args=(--job "$INMEM_FT_JOB" --node "$NODE_RANK" --socket "$INMEM_FT_SMP_SOCKET")

smp_pid=""
torchrun_pid=""
torchrun_rc=""
signalled=""
smp_done=""
# shellcheck disable=SC2317  # called from traps
on_signal() {  # before torchrun runs: exit (the EXIT trap stops the SMP); after: stop torchrun and the SMP
    log "signal sig=$1"
    signalled="$1"
    if [[ -z "$torchrun_pid" ]]; then
        exit $((128 + $(kill -l "$1")))
    fi
    kill -TERM "$torchrun_pid" 2>/dev/null
    # The SMP stops (and spills) at once: torchrun can take longer than the grace time before SIGKILL
    # (an agent whose rendezvous host is gone waits on it), and the snapshots in memory are already whole.
    stop_smp
}
for sig in TERM INT HUP; do
    # shellcheck disable=SC2064  # expand $sig now
    trap "on_signal $sig" "$sig"
done
smp_running() { "${smp[@]}" status "${node_args[@]}" >/dev/null 2>&1; }
# shellcheck disable=SC2317  # called from the EXIT trap
alive() { [[ -r "/proc/$1/status" ]] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status"; }
# shellcheck disable=SC2317  # called from the EXIT trap
stop_smp() {
    local wipe=() why="" rc pid wiped
    [[ -n "$smp_done" ]] && return
    smp_done=1
    if [[ "$WIPE_ON_EXIT" == 1 ]]; then
        wipe=(--wipe)
    elif [[ "$WIPE_ON_EXIT" == finished && -z "$signalled" && "$torchrun_rc" == 0 ]]; then
        wipe=(--wipe) why=" reason=finished"  # nothing will resume from them: give the memory back
    fi
    if [[ -n "$signalled" ]]; then
        # Stopped from outside (preemption, scancel, requeue, time limit): the SMP gets SIGTERM, on which it
        # first writes its newest complete step to its disk tier (INMEM_FT_PERSIST_DIR), if it has one;
        # only then are its segments wiped (INMEM_FT_WIPE_ON_EXIT=1), so that a later job still resumes.
        pid="$("${smp[@]}" status "${node_args[@]}" 2>/dev/null | sed -n '1s/.* pid \([0-9]*\) .*/\1/p')"
        if [[ -n "$pid" ]] && kill -TERM "$pid" 2>/dev/null; then
            while alive "$pid"; do sleep 0.2; done
            wiped=0  # no SMP runs any more: --wipe removes what it left in /dev/shm
            (( ${#wipe[@]} )) && "${smp[@]}" stop "${node_args[@]}" --wipe >/dev/null 2>&1 && wiped=1
            log "smp_stopped wiped=$wiped by=SIGTERM pid=$pid"
            return
        fi
    fi
    "${smp[@]}" stop "${node_args[@]}" "${wipe[@]}" >/dev/null 2>&1
    rc=$?
    if (( rc == 0 )); then
        log "smp_stopped wiped=${#wipe[@]}${why}"
    else
        log "smp_stop_failed rc=$rc pid=${smp_pid:-?}"
        [[ -n "$smp_pid" ]] && kill -TERM "$smp_pid" 2>/dev/null
    fi
}

if smp_running; then
    log "smp_reused socket=${INMEM_FT_SMP_SOCKET}"
else
    # A subshell exports the secret to the SMP alone (`env VAR=...` would show it in ps).
    out="$(
        [[ -n "$secret" ]] && export INMEM_FT_SECRET="$secret"
        exec "${smp[@]}" start "${node_args[@]}" --memory-budget "$INMEM_FT_MEMORY_BUDGET" "${smp_extra[@]}" 2>&1
    )" || fail 3 "the SMP did not start: ${out//$'\n'/ | }"
    [[ "$out" =~ pid\ ([0-9]+) ]] && smp_pid="${BASH_REMATCH[1]}"
    log "smp_started pid=${smp_pid:-?} socket=${INMEM_FT_SMP_SOCKET}"
fi
secret=""
trap stop_smp EXIT

# ---- torchrun ---------------------------------------------------------------------------------------
rdzv=(--rdzv-backend="$RDZV_BACKEND" --rdzv-id="$INMEM_FT_JOB")
if [[ "$RDZV_BACKEND" == c10d ]]; then
    # Node 0 hosts the rendezvous store (deterministic also when every node resolves to one host).
    is_host=false; (( NODE_RANK == 0 )) && is_host=true
    rdzv+=(--rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" --rdzv-conf="is_host=${is_host}")
    [[ -n "${INMEM_FT_LOCAL_ADDR:-}" ]] && rdzv+=(--local-addr="$INMEM_FT_LOCAL_ADDR")
    # By default the workers of every attempt share the rendezvous store, where the previous
    # attempt's gloo/NCCL addresses are still found: a restarted rank then connects to a dead port
    # ("Connection refused") and the restarts are used up. A fresh store per round avoids that.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
else
    rdzv+=(--node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT")
fi
cmd=("${launcher[@]}" --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" "${rdzv[@]}"
     --max-restarts="$MAX_RESTARTS" "${torchrun_extra[@]}" "$@")
log "torchrun cmd=\"${cmd[*]}\""

# torchrun runs in the background so that a signal reaches the trap at once; torchrun is told to stop
# with SIGTERM (a background job of a script ignores SIGINT), stops its workers and exits.
"${cmd[@]}" &
torchrun_pid=$!
while :; do
    wait "$torchrun_pid"
    rc=$?
    kill -0 "$torchrun_pid" 2>/dev/null || break  # else: wait was interrupted by a trapped signal
done
torchrun_rc="$rc"
log "torchrun_exit rc=$rc"
exit "$rc"
