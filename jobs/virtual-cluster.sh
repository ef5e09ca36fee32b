#!/usr/bin/env bash
# jobs/virtual-cluster.sh: a cluster of N "nodes" inside one Linux machine, for trying and
# testing mpidist across nodes without a real cluster.
#
#   jobs/virtual-cluster.sh check
#       print "ok" when a virtual cluster can be built here, otherwise "skip: <reason>";
#       always exits 0 (Makefiles branch on the word)
#   jobs/virtual-cluster.sh up [--nodes N] [--ranks-per-node K] [--link-gbit G] [--mtu M]
#       build N nodes (default 2) of K slots (default 2) joined by a switch; each node's
#       link is limited to G Gbit/s each way (default 1; 0 = unlimited); frames of M bytes
#       (default 9000, the jumbo frames of cluster networks; 1500 is plain Ethernet)
#   jobs/virtual-cluster.sh mpirun -n R [--map-by node|slot] [--ranks-per-node K]
#                                  [MPIRUN-OPTION...] -- COMMAND...
#       run an MPI job across the nodes from the current directory, with the project's
#       environment; ranks fill node by node (slot) unless --map-by node (round-robin);
#       --ranks-per-node K puts K ranks on each node whatever the slots. The exit status
#       is the job's. MPIDIST_VCLUSTER_HOSTFILE replaces the cluster's hostfile (lines
#       "NODE slots=K"), e.g. to leave out a node. The "--" may be left out, so the script
#       can serve as a launcher that is called as `LAUNCHER -n N COMMAND...`.
#       $MPIDIST_VCLUSTER_DIR/mpirun is the same as a launcher of its own, for tools that
#       call `LAUNCHER -n N COMMAND...` (e.g. `mpidist run --elastic --launcher ...`).
#   jobs/virtual-cluster.sh exec NODE -- COMMAND...     run COMMAND on one node
#   jobs/virtual-cluster.sh slurm          start a Slurm with one slurmd per node (see
#                                          jobs/virtual-slurm.sh); then submit with
#       jobs/virtual-cluster.sh exec vnode1 -- sbatch -N 2 jobs/train-multi-node.sbatch
#   jobs/virtual-cluster.sh status         what `up` made, and the node names
#   jobs/virtual-cluster.sh down           remove everything `up` (and `slurm`) made
#
# How: each node is a network namespace (`ip netns`) with its own hostname (a UTS
# namespace per process started on it) and a veth port on a bridge in a "switch"
# namespace; `tc tbf` limits every port to G Gbit/s in each direction, like a NIC. Shared
# memory inside a node works as on a real node; between nodes Open MPI uses TCP over the
# veths. mpirun runs on the first node and starts its daemons on the others through an
# rsh agent that enters the node's namespace (no ssh). Needs root, iproute2 (`ip`, `tc`),
# util-linux (`unshare`) and Open MPI.
#
# State (what was made, the hostfile, the rsh agent, Slurm's files) lives in
# MPIDIST_VCLUSTER_DIR (default $TMPDIR/mpidist-vcluster, or /tmp/mpidist-vcluster);
# namespaces are named MPIDIST_VCLUSTER_NAME (default "vnode") plus the node number, and the
# nodes' addresses are MPIDIST_VCLUSTER_SUBNET.1, .2, ... (default 10.77.0, a /24 that only
# exists inside these namespaces). Two clusters can coexist with different values of all three.
#
# Where the cluster cannot be built (not root, no `ip`, namespaces refused by the kernel),
# `up` prints one line with the reason and exits 2, leaving nothing behind.

set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${MPIDIST_VCLUSTER_DIR:-${TMPDIR:-/tmp}/mpidist-vcluster}
NAME=${MPIDIST_VCLUSTER_NAME:-vnode}
SUBNET=${MPIDIST_VCLUSTER_SUBNET:-10.77.0}
SWITCH=${NAME}-sw

say() { echo "virtual-cluster: $*"; }
die() { echo "virtual-cluster: error: $*" >&2; exit 1; }
cannot() { echo "virtual-cluster: cannot build a virtual cluster here: $*" >&2; exit 2; }

# The first reason why no cluster can be built here, or nothing.
why_not() {
    [ "$(uname -s)" = Linux ] || { echo "not Linux"; return; }
    [ "$(id -u)" = 0 ] || { echo "not root (network namespaces need root)"; return; }
    local c
    for c in ip tc unshare mpirun; do
        command -v "$c" >/dev/null || { echo "no \`$c\` on PATH"; return; }
    done
    local probe="${NAME}-probe$$"
    if ! ip netns add "$probe" 2>/dev/null; then
        echo "the kernel refused a network namespace (ip netns add)"; return
    fi
    ip netns del "$probe" 2>/dev/null || true
}

cmd_check() {
    local reason
    reason=$(why_not)
    if [ -z "$reason" ]; then echo ok; else echo "skip: $reason"; fi
}

node_names() { cat "$STATE/nodes"; }

# Record a thing made, so that `down` removes exactly it (and nothing else).
made() { echo "$1 $2" >>"$STATE/made"; }

# Undo everything recorded in $STATE/made, last first; quiet about what is already gone.
teardown() {
    [ -f "$STATE/made" ] || return 0
    local kind what pid
    tac "$STATE/made" | while read -r kind what; do
        case "$kind" in
            pid)
                if kill -0 "$what" 2>/dev/null; then
                    kill -TERM "$what" 2>/dev/null || true
                    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$what" 2>/dev/null || break; sleep 0.3; done
                    kill -KILL "$what" 2>/dev/null || true
                fi ;;
            netns)
                # Processes still running on the node are the cluster's own (jobs, daemons).
                for pid in $(ip netns pids "$what" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
                ip netns del "$what" 2>/dev/null || true ;;
            etcdir) rm -rf "/etc/netns/$what" ;;
            etcroot) rmdir /etc/netns 2>/dev/null || true ;;
        esac
    done
    rm -f "$STATE/made"
}

cmd_up() {
    local nodes=2 rpn=2 gbit=1 mtu=9000
    while [ $# -gt 0 ]; do
        case "$1" in
            --mtu) mtu=${2:?--mtu needs a value}; shift 2 ;;
            --nodes) nodes=${2:?--nodes needs a value}; shift 2 ;;
            --ranks-per-node) rpn=${2:?--ranks-per-node needs a value}; shift 2 ;;
            --link-gbit) gbit=${2:?--link-gbit needs a value}; shift 2 ;;
            *) die "up: unknown option $1 (see the header of $0)" ;;
        esac
    done
    [[ "$nodes" =~ ^[0-9]+$ ]] && [ "$nodes" -ge 1 ] || die "--nodes=$nodes must be an integer >= 1"
    [[ "$rpn" =~ ^[0-9]+$ ]] && [ "$rpn" -ge 1 ] || die "--ranks-per-node=$rpn must be an integer >= 1"
    [[ "$mtu" =~ ^[0-9]+$ ]] && [ "$mtu" -ge 576 ] && [ "$mtu" -le 65535 ] || die "--mtu=$mtu must be an integer in [576, 65535]"
    [[ "$gbit" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--link-gbit=$gbit must be a number (0 = unlimited)"
    local octet='(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])'
    [[ "$SUBNET" =~ ^$octet\.$octet\.$octet$ ]] ||
        die "MPIDIST_VCLUSTER_SUBNET=$SUBNET must be the first three numbers of an IPv4 address (e.g. 10.77.0)"
    [ "$nodes" -le 250 ] || die "--nodes=$nodes: at most 250 nodes fit in $SUBNET.0/24"
    local reason
    reason=$(why_not)
    [ -z "$reason" ] || cannot "$reason"
    [ ! -e "$STATE/made" ] || die "a virtual cluster is already up (state in $STATE); run \`$0 down\` first"
    local i n
    for ((i = 1; i <= nodes; i++)); do
        ! ip netns list | grep -qw "^$NAME$i" || die "a namespace $NAME$i exists that this script did not make here (set MPIDIST_VCLUSTER_NAME)"
    done
    mkdir -p "$STATE"
    : >"$STATE/made"
    # Anything failing from here on undoes what was made and reports the reason.
    trap 'teardown; rm -rf "$STATE"; cannot "step failed: ${BASH_COMMAND}"' ERR
    [ -d /etc/netns ] || { mkdir /etc/netns; made etcroot /etc/netns; }
    ip netns add "$SWITCH"; made netns "$SWITCH"
    ip -n "$SWITCH" link set lo up
    ip -n "$SWITCH" link add br0 type bridge
    ip -n "$SWITCH" link set br0 up
    : >"$STATE/nodes"; : >"$STATE/hostfile"
    local hosts="127.0.0.1 localhost"$'\n'
    for ((i = 1; i <= nodes; i++)); do hosts+="$SUBNET.$i $NAME$i"$'\n'; done
    for ((i = 1; i <= nodes; i++)); do
        n=$NAME$i
        ip netns add "$n"; made netns "$n"
        mkdir -p "/etc/netns/$n"; made etcdir "$n"
        printf '%s' "$hosts" >"/etc/netns/$n/hosts"
        echo "$n" >"/etc/netns/$n/hostname"
        ip -n "$n" link set lo up
        ip link add eth1 netns "$n" type veth peer name "p$i" netns "$SWITCH"
        ip -n "$n" addr add "$SUBNET.$i/24" dev eth1
        ip -n "$n" link set eth1 mtu "$mtu"
        ip -n "$SWITCH" link set "p$i" mtu "$mtu"
        ip -n "$n" link set eth1 up
        ip -n "$SWITCH" link set "p$i" master br0
        ip -n "$SWITCH" link set "p$i" up
        if [ "$gbit" != 0 ]; then
            # Out of the node (its NIC sending) and into it (the switch port sending).
            local rate="$(awk -v g="$gbit" 'BEGIN{printf "%d", g*1000}')mbit"
            ip netns exec "$n" tc qdisc add dev eth1 root tbf rate "$rate" burst 256kb latency 50ms
            ip netns exec "$SWITCH" tc qdisc add dev "p$i" root tbf rate "$rate" burst 256kb latency 50ms
        fi
        echo "$n" >>"$STATE/nodes"
        echo "$n slots=$rpn" >>"$STATE/hostfile"
    done
    trap - ERR
    write_agent
    # A launcher for tools that call `LAUNCHER -n N COMMAND...` (mpidist run --launcher).
    printf '#!/bin/sh\n# mpirun on the virtual cluster in %s\nMPIDIST_VCLUSTER_DIR=%q MPIDIST_VCLUSTER_NAME=%q MPIDIST_VCLUSTER_SUBNET=%q exec %q mpirun "$@"\n' \
        "$STATE" "$STATE" "$NAME" "$SUBNET" "$REPO/jobs/virtual-cluster.sh" >"$STATE/mpirun"
    chmod +x "$STATE/mpirun"
    printf 'nodes=%s\nranks_per_node=%s\nlink_gbit=%s\nmtu=%s\nsubnet=%s\n' "$nodes" "$rpn" "$gbit" "$mtu" "$SUBNET" >"$STATE/config"
    say "up: $nodes node(s) [$(paste -sd, "$STATE/nodes")] x $rpn slot(s), link ${gbit} Gbit/s (0 = unlimited), state in $STATE"
}

# The rsh agent Open MPI uses to start its daemon on a node: enter the node's namespace,
# take its hostname, run the command line (a string for a shell, as ssh would pass it).
write_agent() {
    cat >"$STATE/netns-rsh" <<'EOF'
#!/bin/sh
# Open MPI's rsh agent for the virtual cluster: netns-rsh NODE COMMAND...
h=$1; shift
exec ip netns exec "$h" unshare --uts /bin/sh -c "hostname $h; $*"
EOF
    chmod +x "$STATE/netns-rsh"
}

need_up() {
    [ -f "$STATE/config" ] || die "no virtual cluster is up (state dir $STATE); run \`$0 up\` first"
}

# Run COMMAND... on node $1 with that node's hostname.
on_node() {
    local n=$1; shift
    exec ip netns exec "$n" unshare --uts /bin/sh -c 'hostname "$0"; exec "$@"' "$n" "$@"
}

cmd_exec() {
    need_up
    local n=${1:?exec needs a node name}; shift
    grep -qx "$n" "$STATE/nodes" || die "exec: no node $n (nodes: $(paste -sd' ' "$STATE/nodes"))"
    [ "${1:-}" = -- ] && shift
    [ $# -gt 0 ] || die "exec: no command"
    # The virtual Slurm's clients (sbatch, squeue, ...) find it through SLURM_CONF.
    [ -f "$STATE/slurm/slurm.conf" ] && export SLURM_CONF="$STATE/slurm/slurm.conf"
    on_node "$n" "$@"
}

cmd_mpirun() {
    need_up
    local np="" map=slot extra=() ppn=""
    while [ $# -gt 0 ]; do
        case "$1" in
            -n | -np) np=${2:?-n needs a value}; shift 2 ;;
            --ranks-per-node) ppn=${2:?--ranks-per-node needs a value}; shift 2 ;;
            --map-by) map=${2:?--map-by needs a value}; shift 2 ;;
            --mca | -mca) extra+=("$1" "${2:?$1 needs two values}" "${3:?$1 needs two values}"); shift 3 ;;
            -x) extra+=("$1" "${2:?-x needs a value}"); shift 2 ;;
            --) shift; break ;;
            -*) extra+=("$1"); shift ;;
            *) break ;; # the command starts (as \`mpiexec -n N COMMAND\` has it)
        esac
    done
    [[ "$np" =~ ^[0-9]+$ ]] && [ "$np" -ge 1 ] || die "mpirun: -n R is required (got '${np}')"
    [ "$map" = node ] || [ "$map" = slot ] || [ -n "$ppn" ] || die "mpirun: --map-by $map is not node or slot"
    [ $# -gt 0 ] || die "mpirun: no command after --"
    if [ -n "$ppn" ]; then
        [[ "$ppn" =~ ^[0-9]+$ ]] && [ "$ppn" -ge 1 ] || die "mpirun: --ranks-per-node $ppn is not an integer >= 1"
        [ "$map" = slot ] || die "mpirun: --ranks-per-node fills nodes in blocks; it does not combine with --map-by $map"
        map=ppr:$ppn:node
    fi
    # The project's environment: its venv first on PATH when there is one, the variables a
    # run needs, and every MPIDIST_* variable.
    [ -x "$REPO/.venv/bin/python" ] && export PATH="$REPO/.venv/bin:$PATH"
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
    export NUMBA_NUM_THREADS=${NUMBA_NUM_THREADS:-1} PYTHONUNBUFFERED=1
    local xs=() v
    for v in PATH PYTHONPATH VIRTUAL_ENV HOME OMPI_ALLOW_RUN_AS_ROOT OMPI_ALLOW_RUN_AS_ROOT_CONFIRM \
        OMP_NUM_THREADS OPENBLAS_NUM_THREADS NUMBA_NUM_THREADS NUMBA_CACHE_DIR PYTHONUNBUFFERED \
        $(compgen -e | grep -E '^(MPIDIST_|OMPI_MCA_)' || true); do
        [ -n "${!v+x}" ] && xs+=(-x "$v")
    done
    local first
    first=$(awk 'NF {print $1; exit}' "${MPIDIST_VCLUSTER_HOSTFILE:-$STATE/hostfile}")
    # --bind-to none: every node of this cluster shares the same cores, so binding would
    # put two nodes' rank 0 on one core.
    # --oversubscribe: slots are a placement hint here, not cores.
    on_node "$first" mpirun --hostfile "${MPIDIST_VCLUSTER_HOSTFILE:-$STATE/hostfile}" -n "$np" --map-by "$map" --bind-to none \
        --oversubscribe \
        --mca plm_rsh_agent "$STATE/netns-rsh" \
        --mca btl self,vader,tcp \
        --mca btl_tcp_if_include "$SUBNET.0/24" --mca oob_tcp_if_include "$SUBNET.0/24" \
        "${xs[@]}" "${extra[@]}" "$@"
}

cmd_status() {
    if [ ! -f "$STATE/config" ]; then say "down (state dir $STATE)"; return 0; fi
    say "up, state in $STATE"
    sed 's/^/  /' "$STATE/config"
    say "nodes: $(paste -sd' ' "$STATE/nodes")"
    if [ -f "$STATE/slurm/slurm.conf" ]; then say "slurm: SLURM_CONF=$STATE/slurm/slurm.conf"; fi
}

cmd_down() {
    if [ ! -d "$STATE" ]; then say "nothing to remove (no $STATE)"; return 0; fi
    teardown
    rm -rf "$STATE"
    say "down: removed the namespaces, their /etc/netns entries, daemons and $STATE"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    check) cmd_check ;;
    up) cmd_up "$@" ;;
    mpirun) cmd_mpirun "$@" ;;
    exec) cmd_exec "$@" ;;
    slurm) # shellcheck source=jobs/virtual-slurm.sh
        source "$REPO/jobs/virtual-slurm.sh"; cmd_slurm "$@" ;;
    status) cmd_status ;;
    down) cmd_down ;;
    *) echo "usage: $0 check | up [--nodes N] [--ranks-per-node K] [--link-gbit G] |" \
        "mpirun -n R [--map-by node|slot] -- CMD... | exec NODE -- CMD... | slurm | status | down" >&2
       exit 2 ;;
esac
