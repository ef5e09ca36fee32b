#!/usr/bin/env bash
# jobs/local-slurm.sh: a real one-node Slurm on this machine, for testing the jobs/ scripts.
#
#   jobs/local-slurm.sh check     print "ok" when Slurm is usable here (installed, or can be
#                                 installed: root with apt-get), otherwise "skip: <reason>";
#                                 always exits 0, so Makefiles can branch on the word
#   jobs/local-slurm.sh install   install munge, slurmctld, slurmd and slurm-client from the
#                                 distribution's packages if missing (root with apt-get only)
#   jobs/local-slurm.sh start     install if needed, write /etc/slurm/slurm.conf for this host,
#                                 start munged, slurmctld and slurmd (those not already
#                                 running) and wait until `sinfo` shows the node idle
#   jobs/local-slurm.sh stop      stop the daemons that `start` started, and only those
#   jobs/local-slurm.sh status    sinfo and squeue, and which daemons this script started
#
# The node declares LOCAL_SLURM_CPUS CPUs (default 4) whatever the hardware has
# (SlurmdParameters=config_overrides), so 4-task jobs run on a 2-core machine. A
# /etc/slurm/slurm.conf that this script did not write is left alone: `start` then fails
# unless LOCAL_SLURM_FORCE=1 (it keeps a copy as slurm.conf.bak-mpidist).
#
# This is for workstations and CI, never for a real cluster: there, submit the jobs/ scripts
# with the site's sbatch.

set -euo pipefail

CPUS=${LOCAL_SLURM_CPUS:-4}
STATE=${LOCAL_SLURM_STATE:-/run/mpidist-local-slurm}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# written by mpidist jobs/local-slurm.sh"
PACKAGES=(munge slurmctld slurmd slurm-client)
TIMEOUT=${LOCAL_SLURM_TIMEOUT:-60}

say() { echo "local-slurm: $*"; }
die() { echo "local-slurm: error: $*" >&2; exit 1; }

installed() {
    command -v munged >/dev/null && command -v slurmctld >/dev/null &&
        command -v slurmd >/dev/null && command -v sbatch >/dev/null
}

cmd_check() {
    if [ "$(uname -s)" != Linux ]; then echo "skip: not Linux"; return 0; fi
    if [ "$(id -u)" != 0 ]; then
        echo "skip: not root (starting slurmctld/slurmd/munged needs root)"; return 0
    fi
    if installed; then echo ok; return 0; fi
    if command -v apt-get >/dev/null; then echo ok; return 0; fi
    echo "skip: Slurm is not installed and apt-get is absent"
}

cmd_install() {
    installed && return 0
    [ "$(id -u)" = 0 ] || die "Slurm is not installed and installing it needs root"
    command -v apt-get >/dev/null || die "Slurm is not installed and apt-get is absent"
    say "installing ${PACKAGES[*]} (Debian packages)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${PACKAGES[@]}" >/dev/null
    installed || die "the packages installed but munged/slurmctld/slurmd/sbatch are missing"
}

write_conf() {
    local host
    host=$(hostname -s)
    if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        [ "${LOCAL_SLURM_FORCE:-0}" = 1 ] ||
            die "$CONF exists and was not written by this script (LOCAL_SLURM_FORCE=1 replaces it)"
        cp -p "$CONF" "$CONF.bak-mpidist"
    fi
    mkdir -p "$CONF_DIR" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    cat >"$CONF.tmp" <<EOF
$MARK
# A one-node cluster for testing jobs/ scripts; \`jobs/local-slurm.sh stop\` stops it.
ClusterName=local
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmdParameters=config_overrides
# Finished jobs stay visible to squeue/scontrol for a while (there is no accounting database).
MinJobAge=600
KillWait=10
NodeName=$host CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    mv "$CONF.tmp" "$CONF"
}

# Alive and not a zombie (in a container nothing may reap a daemon that has exited).
pid_alive() {
    [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null || return 1
    [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}

# The pid of a running daemon from its pid file, or nothing.
running_pid() {
    local f=$1 pid
    [ -f "$f" ] || return 0
    pid=$(cat "$f" 2>/dev/null || true)
    if pid_alive "$pid"; then echo "$pid"; fi
}

wait_pidfile() {
    local f=$1 name=$2 i
    for ((i = 0; i < TIMEOUT * 5; i++)); do
        [ -n "$(running_pid "$f")" ] && return 0
        sleep 0.2
    done
    die "$name did not start (see /var/log/slurm/ or syslog)"
}

record() { echo "$2" >"$STATE/$1.pid"; }

node_state() { sinfo -h -N -o '%T' 2>/dev/null | head -n1 || true; }

cmd_start() {
    cmd_install
    mkdir -p "$STATE"
    write_conf

    # munge: the package generated /etc/munge/munge.key; munged runs as the munge user.
    mkdir -p /run/munge
    chown munge:munge /run/munge
    if [ -z "$(running_pid /run/munge/munged.pid)" ]; then
        su -s /bin/sh munge -c munged
        wait_pidfile /run/munge/munged.pid munged
        record munged "$(running_pid /run/munge/munged.pid)"
        say "started munged"
    fi
    if [ -z "$(running_pid /run/slurmctld.pid)" ]; then
        # -c: forget jobs of an earlier run of this throwaway cluster.
        slurmctld -c
        wait_pidfile /run/slurmctld.pid slurmctld
        record slurmctld "$(running_pid /run/slurmctld.pid)"
        say "started slurmctld"
    fi
    if [ -z "$(running_pid /run/slurmd.pid)" ]; then
        slurmd
        wait_pidfile /run/slurmd.pid slurmd
        record slurmd "$(running_pid /run/slurmd.pid)"
        say "started slurmd"
    fi

    local i st host
    host=$(hostname -s)
    for ((i = 0; i < TIMEOUT; i++)); do
        st=$(node_state)
        case "$st" in
            idle | mixed | allocated) say "node $host is $st"; return 0 ;;
            down* | drain* | fail*) scontrol update nodename="$host" state=resume 2>/dev/null || true ;;
        esac
        sleep 1
    done
    die "node $host did not become idle within ${TIMEOUT}s (state: ${st:-unknown})"
}

cmd_stop() {
    local name pid i
    [ -d "$STATE" ] || { say "nothing to stop"; return 0; }
    # Reverse order of start: jobs end with slurmd, then the controller, then munge.
    for name in slurmd slurmctld munged; do
        [ -f "$STATE/$name.pid" ] || continue
        pid=$(cat "$STATE/$name.pid")
        if pid_alive "$pid"; then
            kill -TERM "$pid" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do pid_alive "$pid" || break; sleep 0.2; done
            pid_alive "$pid" && kill -KILL "$pid" 2>/dev/null || true
            say "stopped $name ($pid)"
        fi
        rm -f "$STATE/$name.pid"
    done
    rmdir "$STATE" 2>/dev/null || true
}

cmd_status() {
    local name
    for name in munged slurmctld slurmd; do
        if [ -f "$STATE/$name.pid" ] && pid_alive "$(cat "$STATE/$name.pid")"; then
            say "$name running (pid $(cat "$STATE/$name.pid"), started by this script)"
        fi
    done
    sinfo && squeue
}

case "${1:-}" in
    check) cmd_check ;;
    install) cmd_install ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 check|install|start|stop|status" >&2; exit 2 ;;
esac
