#!/usr/bin/env bash
# A one-node SLURM cluster on this host, for trying and testing the sbatch scripts.
#
#   scripts/slurm/localhost_slurm.sh start    install if missing, start whichever of munged,
#                                             slurmctld, slurmd is not running; wait until the
#                                             node is idle (idempotent)
#   scripts/slurm/localhost_slurm.sh stop     stop the daemons this script started (and the jobs
#                                             of a slurmd it started); nothing else
#   scripts/slurm/localhost_slurm.sh status   daemons and node state; exit 0 iff all is up
#
# Root only; Debian/Ubuntu packages (slurmctld slurmd slurm-client munge); no systemd needed.
# Writes /etc/slurm/slurm.conf, but never over one it did not write itself.
# What it started is recorded in $STATE as "name pid start-time" (start time: /proc/PID/stat
# field 22, so a recycled PID is never signalled); daemons that were already running are
# not recorded and `stop` leaves them, and their jobs, alone.
# Logs: /var/log/slurm/slurmctld.log, /var/log/slurm/slurmd.log (dumped when start fails).
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARKER="# written by megatron-rrfp scripts/slurm/localhost_slurm.sh"
PIDFILES=(/run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid)  # stop order
STATE=${RRFP_SLURM_STATE:-/run/rrfp-localhost-slurm.started}
LOGS=(/var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log)
READY_TIMEOUT_S=${READY_TIMEOUT_S:-30}

die() { echo "localhost_slurm: $*" >&2; exit 1; }

alive() {  # alive PIDFILE: the process named in the file exists
    local pid
    [[ -s "$1" ]] || return 1
    pid=$(tr -dc '0-9' < "$1")
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null
}

start_time() {  # start_time PID: field 22 of /proc/PID/stat (after the "(comm)" field)
    [[ -r "/proc/$1/stat" ]] || return 1
    sed 's/^.*) //' "/proc/$1/stat" | cut -d' ' -f20
}

remember() {  # remember NAME PIDFILE: record the daemon just started from PIDFILE
    local pid
    for _ in $(seq 1 50); do [[ -s "$2" ]] && break; sleep 0.1; done
    pid=$(tr -dc '0-9' < "$2")
    echo "$1 $pid $(start_time "$pid")" >> "$STATE"
}

dump_logs() {
    local log
    for log in "${LOGS[@]}"; do
        [[ -f "$log" ]] && { echo "----- tail of $log" >&2; tail -n 40 "$log" >&2; }
    done
    echo "----- sinfo" >&2
    sinfo -N -l >&2 2>&1 || true
}

install_packages() {
    local missing=()
    for cmd in slurmctld slurmd sbatch munged; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    echo "localhost_slurm: installing SLURM and munge (missing: ${missing[*]})"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge
}

start_munge() {
    [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    install -d -o munge -g munge -m 0755 /run/munge
    if ! alive /run/munge/munged.pid; then
        runuser -u munge -- /usr/sbin/munged --force  # --force: past a stale socket
        remember munged /run/munge/munged.pid
    fi
    munge -n | unmunge >/dev/null || die "munge does not work (munge -n | unmunge failed)"
}

write_conf() {
    local host node memory
    if [[ -f "$CONF" ]] && ! grep -qxF "$MARKER" "$CONF"; then
        die "$CONF exists and was not written by this script; not touching a real cluster's configuration"
    fi
    host=$(hostname -s)
    node=$(slurmd -C | head -n 1)  # NodeName=HOST CPUs=.. Boards=.. ... RealMemory=N
    memory=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<< "$node")
    # 95% of what slurmd reports: the full value drains the node ("Low RealMemory").
    node=$(sed "s/RealMemory=[0-9]*/RealMemory=$((memory * 95 / 100))/" <<< "$node")
    mkdir -p "$(dirname "$CONF")"
    cat > "$CONF" <<EOF
$MARKER
ClusterName=ci
SlurmctldHost=$host(127.0.0.1)
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
# sbatch --wait polls faster with a small MinJobAge (0 is raised to 2 and can lose the exit code)
MinJobAge=4
KillWait=10
Waittime=0
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

node_state() { sinfo -h -N -o %T 2>/dev/null | head -n 1; }

start() {
    [[ $EUID -eq 0 ]] || die "start needs root (it installs packages and starts daemons)"
    if alive /run/munge/munged.pid && alive /run/slurmctld.pid && alive /run/slurmd.pid \
            && [[ "$(node_state)" =~ ^(idle|mixed|allocated) ]]; then
        echo "localhost_slurm: already running (node $(node_state))"
        return 0
    fi
    install_packages
    start_munge
    alive /run/slurmctld.pid && alive /run/slurmd.pid || write_conf
    install -d -o slurm -g slurm -m 0755 /var/spool/slurmctld /var/log/slurm
    install -d -m 0755 /var/spool/slurmd
    if ! alive /run/slurmctld.pid; then
        slurmctld -c  # -c: no jobs carried over from a previous run of this cluster
        remember slurmctld /run/slurmctld.pid
    fi
    if ! alive /run/slurmd.pid; then
        slurmd
        remember slurmd /run/slurmd.pid
    fi
    local deadline=$((SECONDS + READY_TIMEOUT_S)) state=""
    while (( SECONDS < deadline )); do
        state=$(node_state)
        if [[ "$state" =~ ^(idle|mixed|allocated) ]]; then
            echo "localhost_slurm: up (node $(hostname -s) $state; pids: $(cat /run/slurmctld.pid) slurmctld," \
                 "$(cat /run/slurmd.pid) slurmd, $(cat /run/munge/munged.pid) munged)"
            return 0
        fi
        sleep 0.5
    done
    echo "localhost_slurm: node not idle after ${READY_TIMEOUT_S}s (state: ${state:-none})" >&2
    dump_logs
    return 1
}

cancel_jobs() {  # the jobs of a slurmd we started: their slurmstepd would outlive it otherwise
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
    [[ -n "${jobs// /}" ]] || return 0
    echo "localhost_slurm: cancelling jobs $jobs (on the slurmd this script started)"
    # shellcheck disable=SC2086
    scancel $jobs || true
    for _ in $(seq 1 30); do [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && return 0; sleep 0.5; done
    echo "localhost_slurm: jobs still listed after 15 s: $(squeue -h -o '%i %T' | tr '\n' ' ')" >&2
}

started() {  # started NAME: "pid" if this script started NAME and it is still that process
    local name pid when
    [[ -f "$STATE" ]] || return 1
    while read -r name pid when; do
        if [[ "$name" == "$1" && -n "$pid" && "$(start_time "$pid" 2>/dev/null)" == "$when" ]]; then
            echo "$pid"
            return 0
        fi
    done < "$STATE"
    return 1
}

stop() {
    local name pid pidfile
    if [[ ! -f "$STATE" ]]; then
        echo "localhost_slurm: nothing to stop (no daemon was started by this script)"
        return 0
    fi
    if started slurmd >/dev/null && alive /run/slurmctld.pid; then
        cancel_jobs
    fi
    for name in slurmd slurmctld munged; do
        pid=$(started "$name") || continue
        kill -TERM "$pid"
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "localhost_slurm: $name (pid $pid) ignored TERM for 10 s; KILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
        echo "localhost_slurm: stopped $name (pid $pid)"
        for pidfile in "${PIDFILES[@]}"; do  # its pid file, if it still names it
            [[ -f "$pidfile" && "$(tr -dc '0-9' < "$pidfile")" == "$pid" ]] && rm -f "$pidfile"
        done
    done
    rm -f "$STATE"
}

status() {
    local pidfile up=0
    for pidfile in "${PIDFILES[@]}"; do
        if alive "$pidfile"; then echo "$pidfile: running (pid $(tr -dc '0-9' < "$pidfile"))"
        else echo "$pidfile: not running"; up=1; fi
    done
    echo "node: $(node_state || true)"
    return $up
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 {start|stop|status}" >&2; exit 2 ;;
esac
