#!/usr/bin/env bash
# A two-node Slurm cluster on this one host, for tests.
#
#   bash tests/slurm/cluster.sh start    # install Slurm if needed, start it, wait for idle nodes
#   bash tests/slurm/cluster.sh stop     # stop the daemons started by `start`
#   bash tests/slurm/cluster.sh status   # sinfo
#   eval "$(bash tests/slurm/cluster.sh env)"   # point sbatch/srun/squeue at it
#
# Both nodes (n1, n2) are slurmd processes on 127.0.0.1 with one CPU each.
# Everything (config, state, logs, pid files) lives in $SLURM_TEST_DIR
# (default /tmp/pretrain-slurm). Must run as root.
#
# Environment:
#   SLURM_TEST_DIR            state directory (default /tmp/pretrain-slurm)
#   SLURM_TEST_PORT           slurmctld port; the nodes use the two ports after it
#                             plus 4 (default 7817 -> slurmd 7821, 7822)
#   SLURM_TEST_START_TIMEOUT  seconds to wait for both nodes to be idle (default 60)
#   SLURM_TEST_CRED_EXPIRE    seconds a requeued job waits before it can run
#                             again (Slurm's default is 120; default here 10)
set -euo pipefail

DIR="${SLURM_TEST_DIR:-/tmp/pretrain-slurm}"
CONF="$DIR/slurm.conf"
CTLD_PORT="${SLURM_TEST_PORT:-7817}"
START_TIMEOUT="${SLURM_TEST_START_TIMEOUT:-60}"
CRED_EXPIRE="${SLURM_TEST_CRED_EXPIRE:-10}"
NODES=(n1 n2)
PACKAGES=(slurmctld slurmd slurm-client munge)

log() { echo "[slurm-cluster] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---------------------------------------------------------------- helpers

# Print the pid stored in pid file $1 if that process is alive and its
# command name is $2; print nothing otherwise.
live_pid() {
    local pidfile=$1 name=$2 pid comm state
    [[ -s $pidfile ]] || return 0
    pid=$(tr -dc '0-9' <"$pidfile")
    [[ -n $pid ]] || return 0
    comm=$(cat "/proc/$pid/comm" 2>/dev/null || true)
    [[ $comm == "$name" ]] || return 0
    # A daemon that died but was not reaped (zombie) counts as dead.
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true)
    if [[ -n $state && $state != Z ]]; then
        echo "$pid"
    fi
}

# Send TERM to a pid, wait up to 10 s, then KILL.
kill_pid() {
    local pid=$1 name=$2 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < 100; i++)); do
        if [[ ! -e /proc/$pid ]] || [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) == Z ]]; then
            log "stopped $name (pid $pid)"
            return 0
        fi
        sleep 0.1
    done
    log "$name (pid $pid) ignored SIGTERM; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

ctld_pidfile() { echo "$DIR/run/slurmctld.pid"; }
slurmd_pidfile() { echo "$DIR/run/slurmd-$1.pid"; }

# True when slurmctld and every slurmd of this cluster are alive.
all_daemons_alive() {
    local n
    [[ -n $(live_pid "$(ctld_pidfile)" slurmctld) ]] || return 1
    for n in "${NODES[@]}"; do
        [[ -n $(live_pid "$(slurmd_pidfile "$n")" slurmd) ]] || return 1
    done
}

# True when slurmctld answers a query.
ctld_answers() {
    SLURM_CONF=$CONF timeout 10 sinfo -h -o %D >/dev/null 2>&1
}

# Number of nodes that sinfo reports as idle (0 when slurmctld does not answer).
idle_nodes() {
    { SLURM_CONF=$CONF timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null || true; } | awk '$2 == "idle"' | wc -l
}

print_logs() {
    local f
    for f in "$DIR"/log/*.log; do
        [[ -e $f ]] || continue
        echo "----- $f (last 40 lines) -----" >&2
        tail -n 40 "$f" >&2
    done
    if command -v sinfo >/dev/null; then
        echo "----- sinfo -----" >&2
        SLURM_CONF=$CONF timeout 10 sinfo -N -l >&2 2>&1 || true
    fi
}

# ---------------------------------------------------------------- install

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v sbatch >/dev/null && command -v munged >/dev/null; then
        return 0
    fi
    [[ $(id -u) == 0 ]] || die "Slurm is not installed and installing it needs root"
    log "installing ${PACKAGES[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    # Try with the package lists already on the machine first; refresh them
    # only when that fails (no lists yet, or lists that point at old files).
    if ! apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"; then
        log "apt-get install failed; running apt-get update and retrying"
        apt-get update -q || log "apt-get update reported errors; trying the install anyway"
        apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
    fi
}

# ---------------------------------------------------------------- munge

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0
    fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        install -d -o munge -g munge -m 0700 /etc/munge
        runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    # A munged that died uncleanly leaves its socket and pid file behind.
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock /run/munge/munged.pid
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged
    local i
    for ((i = 0; i < 50; i++)); do
        if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
            touch "$DIR/run/munged.started-by-us"
            return 0
        fi
        sleep 0.2
    done
    die "munged does not answer (see /var/log/munge/munged.log)"
}

stop_munge() {
    [[ -e $DIR/run/munged.started-by-us ]] || return 0
    local pid
    pid=$(live_pid /run/munge/munged.pid munged)
    if [[ -n $pid ]]; then
        kill_pid "$pid" munged
    fi
    rm -f "$DIR/run/munged.started-by-us"
}

# ---------------------------------------------------------------- config

write_conf() {
    local host first_port last_port
    host=$(hostname -s)
    first_port=$((CTLD_PORT + 4))
    last_port=$((CTLD_PORT + 4 + ${#NODES[@]} - 1))
    cat >"$CONF" <<CONF
# Written by tests/slurm/cluster.sh; rewritten on every start.
ClusterName=pretraintest
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# How long a requeued job waits before it may start again (Slurm default 120 s).
AuthInfo=cred_expire=$CRED_EXPIRE
SlurmctldPort=$CTLD_PORT
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# Look at pending jobs every few seconds (defaults: 60 s main loop, 30 s
# backfill), so a requeued job starts soon after it becomes eligible.
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
MailProg=/bin/true
InactiveLimit=0

NodeName=n[1-${#NODES[@]}] NodeHostname=$host NodeAddr=127.0.0.1 Port=$first_port-$last_port CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
}

# ---------------------------------------------------------------- commands

stop_slurm_daemons() {
    local pid n
    # Cancel whatever still runs so no job steps outlive their slurmd.
    if [[ -n $(live_pid "$(ctld_pidfile)" slurmctld) ]]; then
        if [[ -n $(SLURM_CONF=$CONF timeout 10 squeue -h -o %i 2>/dev/null) ]]; then
            log "cancelling remaining jobs"
            SLURM_CONF=$CONF timeout 10 scancel --full -p debug 2>/dev/null || true
            for ((n = 0; n < 50; n++)); do
                [[ -z $(SLURM_CONF=$CONF timeout 10 squeue -h -o %i 2>/dev/null) ]] && break
                sleep 0.2
            done
        fi
    fi
    for n in "${NODES[@]}"; do
        pid=$(live_pid "$(slurmd_pidfile "$n")" slurmd)
        if [[ -n $pid ]]; then kill_pid "$pid" "slurmd $n"; fi
        rm -f "$(slurmd_pidfile "$n")"
    done
    pid=$(live_pid "$(ctld_pidfile)" slurmctld)
    if [[ -n $pid ]]; then kill_pid "$pid" slurmctld; fi
    rm -f "$(ctld_pidfile)"
}

cmd_stop() {
    stop_slurm_daemons
    stop_munge
    log "stopped"
}

cmd_start() {
    [[ $(id -u) == 0 ]] || die "must run as root (the daemons run as root)"
    if [[ -f $CONF ]] && all_daemons_alive && ctld_answers; then
        log "already running (SLURM_CONF=$CONF)"
        SLURM_CONF=$CONF sinfo -N >&2 || true
        return 0
    fi
    install_packages
    # Whatever is left over from an earlier run (a crashed daemon, stale pid
    # files, old job state) is thrown away: every start is a fresh cluster.
    mkdir -p "$DIR/run"
    stop_slurm_daemons
    rm -rf "$DIR/state" "$DIR/spool" "$DIR/log"
    mkdir -p "$DIR/state" "$DIR/log" "$DIR/run"
    local n
    for n in "${NODES[@]}"; do mkdir -p "$DIR/spool/$n"; done
    write_conf
    start_munge

    local t0=$SECONDS
    log "starting slurmctld"
    slurmctld -i -f "$CONF" || { print_logs; die "slurmctld failed to start"; }
    for n in "${NODES[@]}"; do
        log "starting slurmd $n"
        slurmd -N "$n" -f "$CONF" || { print_logs; die "slurmd $n failed to start"; }
    done

    log "waiting up to ${START_TIMEOUT}s for ${#NODES[@]} idle nodes"
    while (($(idle_nodes) < ${#NODES[@]})); do
        if ((SECONDS - t0 >= START_TIMEOUT)); then
            print_logs
            die "nodes not idle after ${START_TIMEOUT}s"
        fi
        if ! all_daemons_alive; then
            sleep 1 # let the daemons finish writing their logs
            print_logs
            die "a Slurm daemon exited during start-up"
        fi
        sleep 0.5
    done
    log "up in $((SECONDS - t0))s; use: export SLURM_CONF=$CONF"
    SLURM_CONF=$CONF sinfo -N >&2
}

cmd_status() {
    if [[ ! -f $CONF ]] || ! all_daemons_alive || ! ctld_answers; then
        echo "not running (start it with: bash tests/slurm/cluster.sh start)"
        return 1
    fi
    SLURM_CONF=$CONF timeout 10 sinfo -N
}

cmd_env() {
    echo "export SLURM_CONF=$CONF"
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) cmd_env ;;
    *)
        echo "usage: $0 start|stop|status|env" >&2
        exit 2
        ;;
esac
