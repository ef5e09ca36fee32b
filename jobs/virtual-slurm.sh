# jobs/virtual-slurm.sh: `jobs/virtual-cluster.sh slurm`, sourced by that script (not run
# on its own). It starts a Slurm on the virtual cluster: slurmctld on the first node, one
# slurmd on every node, each inside its node's namespace with the node's hostname, and
# munged if none is running. Everything lives in $STATE/slurm (its slurm.conf, spool,
# state, logs, pid files), so it never touches /etc/slurm or a one-node Slurm of
# jobs/local-slurm.sh (the daemons listen inside the namespaces, on their own addresses).
# `jobs/virtual-cluster.sh down` stops what this started.
#
# Submit from the first node, where the controller is reachable (exec sets SLURM_CONF):
#     jobs/virtual-cluster.sh exec vnode1 -- sbatch -N 2 jobs/train-multi-node.sbatch
#     jobs/virtual-cluster.sh exec vnode1 -- squeue

slurm_installed() {
    command -v munged >/dev/null && command -v slurmctld >/dev/null &&
        command -v slurmd >/dev/null && command -v sbatch >/dev/null
}

pid_of() { # a live pid from a pid file, or nothing
    local pid
    [ -f "$1" ] || return 0
    pid=$(cat "$1" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "$pid"; fi
}

wait_pid() { # pid-file name
    local i
    for ((i = 0; i < 150; i++)); do
        [ -n "$(pid_of "$1")" ] && return 0
        sleep 0.2
    done
    die "slurm: $2 did not start (logs in $STATE/slurm)"
}

write_slurm_conf() {
    local sd=$1 cpus=$2 first addr i=0 n
    first=$(head -n1 "$STATE/nodes")
    mkdir -p "$sd/ctld"
    {
        echo "# written by mpidist jobs/virtual-cluster.sh slurm; removed by \`down\`"
        echo "ClusterName=vcluster"
        echo "SlurmctldHost=$first($SUBNET.1)"
        echo "AuthType=auth/munge"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SlurmUser=root"
        echo "SlurmctldPidFile=$sd/slurmctld.pid"
        echo "SlurmdPidFile=$sd/slurmd-%n.pid"
        echo "StateSaveLocation=$sd/ctld"
        echo "SlurmdSpoolDir=$sd/spool-%n"
        echo "SlurmctldLogFile=$sd/slurmctld.log"
        echo "SlurmdLogFile=$sd/slurmd-%n.log"
        echo "TmpFS=$sd/tmp"
        echo "SchedulerType=sched/backfill"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "MpiDefault=none"
        echo "ReturnToService=2"
        echo "SlurmdParameters=config_overrides"
        echo "MinJobAge=600"
        echo "KillWait=10"
        while read -r n; do
            i=$((i + 1))
            echo "NodeName=$n NodeAddr=$SUBNET.$i CPUs=$cpus Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN"
        done <"$STATE/nodes"
        echo "PartitionName=vcluster Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
    } >"$sd/slurm.conf"
}

# Start a daemon on node $1: its network and hostname, the machine's mounts (`ip netns
# exec` would mount a /sys without the cgroup hierarchy that slurmd checks) except for the
# node's own TmpFS, where Slurm's PMIx plugin makes per-step directories whose names would
# clash between the nodes.
in_node() {
    local n=$1 sd=$STATE/slurm; shift
    mkdir -p "$sd/tmp" "$sd/tmp-$n"
    nsenter --net="/run/netns/$n" unshare --uts --mount /bin/sh -c \
        'hostname "$0"; mount --bind "$1" "$2" && shift 2 && exec "$@"' \
        "$n" "$sd/tmp-$n" "$sd/tmp" "$@"
}

cmd_slurm() {
    need_up
    slurm_installed || die "slurm: munged, slurmctld, slurmd or sbatch is missing (\`jobs/local-slurm.sh install\` installs them)"
    local sd=$STATE/slurm n first cpus i st
    [ ! -f "$sd/slurm.conf" ] || die "slurm: already started (SLURM_CONF=$sd/slurm.conf)"
    cpus=$(sed -n 's/^ranks_per_node=//p' "$STATE/config")
    mkdir -p "$sd"
    write_slurm_conf "$sd" "$cpus"
    if [ ! -S /run/munge/munge.socket.2 ] || ! pgrep -x munged >/dev/null; then
        mkdir -p /run/munge && chown munge:munge /run/munge
        su -s /bin/sh munge -c munged
        wait_pid /run/munge/munged.pid munged
        made pid "$(pid_of /run/munge/munged.pid)"
    fi
    first=$(head -n1 "$STATE/nodes")
    in_node "$first" slurmctld -c -f "$sd/slurm.conf"
    wait_pid "$sd/slurmctld.pid" slurmctld
    made pid "$(pid_of "$sd/slurmctld.pid")"
    while read -r n; do
        mkdir -p "$sd/spool-$n"
        in_node "$n" slurmd -f "$sd/slurm.conf" -N "$n"
        wait_pid "$sd/slurmd-$n.pid" "slurmd on $n"
        made pid "$(pid_of "$sd/slurmd-$n.pid")"
    done <"$STATE/nodes"
    export SLURM_CONF=$sd/slurm.conf
    for ((i = 0; i < 60; i++)); do
        st=$(ip netns exec "$first" sinfo -h -o '%T' 2>/dev/null | sort -u | paste -sd, || true)
        case "$st" in
            idle) break ;;
            *down* | *drain*) ip netns exec "$first" scontrol update nodename=ALL state=resume 2>/dev/null || true ;;
        esac
        sleep 1
    done
    [ "$st" = idle ] || die "slurm: nodes are '${st:-unknown}' after 60 s (logs in $sd)"
    say "slurm: $(wc -l <"$STATE/nodes") node(s) idle; SLURM_CONF=$sd/slurm.conf"
    say "submit with: $0 exec $first -- sbatch -N $(wc -l <"$STATE/nodes") jobs/train-multi-node.sbatch"
}
