#!/usr/bin/env bash
# A real two-node SLURM 22.05 cluster on this machine, for levers9's `slurm` tests and benchmarks.
#
#   compat_tests/slurm_cluster.sh start     # idempotent: a running cluster is left as it is ("already running")
#   compat_tests/slurm_cluster.sh status    # the daemons, then `sinfo`; exit 1 when not running
#   compat_tests/slurm_cluster.sh stop      # stops every daemon it started; the folder stays
#   compat_tests/slurm_cluster.sh env       # prints `export SLURM_CONF=...` for `eval "$(...)"`
#
# Needs root and Debian's packages: apt-get install -y slurm-wlm munge slurmdbd mariadb-server
# One slurmctld and two slurmd (Debian's build has MULTIPLE_SLURMD, so `slurmd -N l9node1` and
# `slurmd -N l9node2` are two nodes with their own port), each node with 2 fake GPUs declared as GRES of type h100
# (character devices with NVIDIA's major number 195, made with mknod in the cluster's folder, so SLURM
# sets CUDA_VISIBLE_DEVICES as it would on a GPU node), and a munged of its own.
# Accounting as a site has it: a slurmdbd on a MariaDB of its own (listening on 127.0.0.1 only), associations and
# QOS enforced; root may charge accounts l9lab (its default) and l9spare with QOS normal or l9fast, and account
# l9other exists without root in it.
#
# Everything lives in $LEVERS9_SLURM_DIR (default /tmp/levers9-slurm, 0700): slurm.conf, gres.conf,
# the munge key and socket, state, spool, pid files and logs. The daemons get `-f slurm.conf`, the
# clients SLURM_CONF (see `env`). Machine files touched: /etc/hosts only, two lines ending in
# "# levers9-slurm" (127.0.0.2 l9node1, 127.0.0.3 l9node2: node names must resolve for the ranks to
# meet), added by start and removed by stop. The system munged, /etc/munge and /etc/slurm are not used.
# AuthInfo's cred_expire=20 (SLURM's default 120): a requeued job starts again 20 s after it left its node,
# where the old run's credential is revoked until then (started sooner there, it fails "credential revoked").
# `start` and `stop` hold $DIR/lock while they run, so callers at the same time (several pytest workers) take
# turns: the second `start` finds the daemons the first started, and no `stop` interleaves with a `start`.
set -euo pipefail

DIR="${LEVERS9_SLURM_DIR:-/tmp/levers9-slurm}"
CONF="$DIR/slurm.conf"
NODES=(l9node1 l9node2)
ADDRS=(127.0.0.2 127.0.0.3)
CTLD_PORT="${LEVERS9_SLURM_PORT:-16817}"  # slurmd ports follow: +1, +2; slurmdbd +3, MariaDB +4
DBD_PORT=$((CTLD_PORT + 3))
DB_PORT=$((CTLD_PORT + 4))
DB_SOCKET="$DIR/run/mariadb.sock"
MARK="# levers9-slurm"
SOCKET="$DIR/munge/munge.socket"
GPU_TYPE=h100  # the cards' GRES type (gres.conf Type=): @job(gpu="H100") asks for --gres=gpu:h100:N
CPUS_PER_NODE=8  # more than the machine has (config_overrides): a 200-cell map needs room, not cores

die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }

take_lock() {
    # $DIR sits at a predictable path: it must be a real folder of root's, never a link another user placed there
    mkdir -p -m 0700 "$DIR"
    [[ -d "$DIR" && ! -L "$DIR" && $(stat -c %u "$DIR") == 0 ]] \
        || die "$DIR is not a folder owned by root (a link, or another user's); remove it or set LEVERS9_SLURM_DIR"
    chmod 0700 "$DIR"
    exec 9>>"$DIR/lock"
    flock -w 200 9 || die "another start or stop has held $DIR/lock for 200 s; see $DIR/log/ and who holds it: fuser $DIR/lock"
}

pid_alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

need_tools() {
    [[ $(id -u) == 0 ]] || die "must run as root (the daemons run as root); seen uid $(id -u)"
    local missing=()
    for tool in slurmctld slurmd slurmdbd sacctmgr mariadbd mariadb-install-db mariadb munged mungekey srun sinfo mknod flock; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    ((${#missing[@]} == 0)) || die "${missing[*]} not found; install them with: apt-get install -y slurm-wlm munge slurmdbd mariadb-server"
}

write_hosts() {
    local i
    for i in "${!NODES[@]}"; do
        grep -qE "^${ADDRS[$i]}[[:space:]]+${NODES[$i]}[[:space:]]" /etc/hosts \
            || echo "${ADDRS[$i]} ${NODES[$i]} $MARK" >>/etc/hosts
    done
}

remove_hosts() {
    # /etc/hosts is often a bind mount (containers): rewrite it in place, never replace the file.
    if grep -q "$MARK\$" /etc/hosts; then
        local kept
        kept="$(grep -v "$MARK\$" /etc/hosts)"
        printf '%s\n' "$kept" >/etc/hosts
    fi
}

write_config() {
    mkdir -p "$DIR/state" "$DIR/log" "$DIR/run" "$DIR/munge" "$DIR/dev"
    chmod 0700 "$DIR/munge"
    [[ -s "$DIR/munge/munge.key" ]] || mungekey --create --keyfile="$DIR/munge/munge.key" --force
    chmod 0600 "$DIR/munge/munge.key"
    local i n gres=""
    for i in "${!NODES[@]}"; do
        n="${NODES[$i]}"
        mkdir -p "$DIR/spool/$n" "$DIR/dev/$n"
        for card in 0 1; do
            [[ -c "$DIR/dev/$n/nvidia$card" ]] || mknod "$DIR/dev/$n/nvidia$card" c 195 "$((2 * i + card))"
        done
        gres+="NodeName=$n Name=gpu Type=$GPU_TYPE File=$DIR/dev/$n/nvidia[0-1]"$'\n'
    done
    printf '%s' "$gres" >"$DIR/gres.conf"
    # SLURM 24 and later start a cgroup plugin even under proctrack/linuxproc; this cluster uses none (a chroot or a
    # container may have no cgroup file system at all). 22.05 knows no CgroupPlugin=disabled, and needs no file.
    rm -f "$DIR/cgroup.conf"
    if (($(slurmd -V | grep -oE '[0-9]+' | head -n 1) >= 24)); then
        echo "CgroupPlugin=disabled" >"$DIR/cgroup.conf"
    fi
    cat >"$CONF" <<EOF
# Written by compat_tests/slurm_cluster.sh; rewritten on every start.
ClusterName=levers9
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET,cred_expire=20
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
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$SOCKET
AccountingStorageEnforce=associations,limits,qos
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MessageTimeout=10
KillWait=5
MinJobAge=60
InactiveLimit=0
MaxArraySize=1001
PrologFlags=Alloc
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
EOF
    for i in "${!NODES[@]}"; do
        echo "NodeName=${NODES[$i]} NodeAddr=${ADDRS[$i]} Port=$((CTLD_PORT + 1 + i)) CPUs=$CPUS_PER_NODE RealMemory=4000 Gres=gpu:$GPU_TYPE:2 State=UNKNOWN" >>"$CONF"
    done
    # l9urgent is l9's nodes at a higher priority tier: a job there preempts (cancels) l9's jobs in its way, as a
    # cluster's preemptible partition does; only a test that means to preempt submits there
    echo "PartitionName=l9 Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=1" >>"$CONF"
    echo "PartitionName=l9urgent Nodes=$(IFS=,; echo "${NODES[*]}") MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=2" >>"$CONF"
    # slurmd and slurmctld refuse a slurm.conf others can write
    chmod 0644 "$CONF" "$DIR/gres.conf"
    [[ -s "$DIR/db.pass" ]] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$DIR/db.pass")
    (umask 077; cat >"$DIR/slurmdbd.conf" <<EOF
# Written by compat_tests/slurm_cluster.sh; rewritten on every start. slurmdbd reads it beside SLURM_CONF.
AuthType=auth/munge
AuthInfo=socket=$SOCKET
DbdAddr=127.0.0.1
DbdHost=$(hostname -s)
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$DIR/db.pass")
StorageLoc=levers9_acct
EOF
    )
}

start_accounting() {
    # MariaDB (its own data folder, 127.0.0.1 only), slurmdbd on it, then the cluster's accounts, users and QOS
    if [[ ! -d "$DIR/mariadb/mysql" ]]; then
        mariadb-install-db --user=root --datadir="$DIR/mariadb" --auth-root-authentication-method=socket \
            --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed; see $DIR/log/mariadb-install.log"
    fi
    setsid mariadbd --user=root --datadir="$DIR/mariadb" --socket="$DB_SOCKET" --pid-file="$DIR/run/mariadbd.pid" \
        --bind-address=127.0.0.1 --port="$DB_PORT" --log-error="$DIR/log/mariadbd.log" </dev/null >/dev/null 2>&1 9>&- &
    local i
    for i in $(seq 1 60); do
        mariadb --socket="$DB_SOCKET" -e "select 1" >/dev/null 2>&1 && break
        ((i < 60)) || die "MariaDB did not answer on $DB_SOCKET within 30 s; see $DIR/log/mariadbd.log"
        sleep 0.5
    done
    local pass
    pass="$(cat "$DIR/db.pass")"
    mariadb --socket="$DB_SOCKET" -e "CREATE DATABASE IF NOT EXISTS levers9_acct;
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
        ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
        GRANT ALL ON levers9_acct.* TO 'slurm'@'127.0.0.1';"
    SLURM_CONF="$CONF" slurmdbd 9>&-
    for i in $(seq 1 60); do
        SLURM_CONF="$CONF" sacctmgr -n list cluster >/dev/null 2>&1 && break
        ((i < 60)) || die "slurmdbd did not answer within 30 s; see $DIR/log/slurmdbd.log"
        sleep 0.5
    done
    local manage=(env SLURM_CONF="$CONF" sacctmgr -i)
    # an `add` of what exists says "Nothing new added" and exits 1: the association list below checks the outcome
    "${manage[@]}" add cluster levers9 >/dev/null 2>&1 || true
    "${manage[@]}" add qos l9fast >/dev/null 2>&1 || true
    "${manage[@]}" add account l9lab,l9spare,l9other Cluster=levers9 Description=levers9-tests Organization=levers9 >/dev/null 2>&1 || true
    "${manage[@]}" add user root Account=l9lab,l9spare DefaultAccount=l9lab Cluster=levers9 >/dev/null 2>&1 || true
    "${manage[@]}" modify user root set QOS=normal,l9fast >/dev/null 2>&1 || true
    local assoc
    assoc="$(SLURM_CONF="$CONF" sacctmgr -nP show assoc where user=root format=account,qos 2>&1)"
    grep -q '^l9lab|.*l9fast' <<<"$assoc" || die "root's associations are not as written (sacctmgr: $assoc); see $DIR/log/slurmdbd.log"
}

start() {
    need_tools
    take_lock
    write_hosts
    if pid_alive "$DIR/run/slurmctld.pid" && all_slurmd_alive && pid_alive "$DIR/run/slurmdbd.pid" \
        && pid_alive "$DIR/run/mariadbd.pid" && pid_alive "$DIR/run/munged.pid"; then
        echo "slurm_cluster.sh: already running in $DIR"
        wait_nodes_idle
        return 0
    fi
    stop_daemons
    write_config
    # the daemons never get the lock's descriptor (9>&-): one that kept it would hold the lock for its life
    munged --force --socket="$SOCKET" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/run/munged.pid" \
        --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" 9>&-
    start_accounting
    slurmctld -f "$CONF" -i 9>&-
    local n
    for n in "${NODES[@]}"; do
        slurmd -f "$CONF" -N "$n" 9>&-
    done
    wait_nodes_idle
    echo "slurm_cluster.sh: running in $DIR; use it with: export SLURM_CONF=$CONF"
}

all_slurmd_alive() {
    local n
    for n in "${NODES[@]}"; do pid_alive "$DIR/run/slurmd-$n.pid" || return 1; done
}

wait_nodes_idle() {
    local i states=""
    for i in $(seq 1 60); do
        states="$(SLURM_CONF="$CONF" sinfo -h -N -o '%N %t' 2>/dev/null || true)"
        if [[ -n "$states" ]] && ! grep -qvE ' (idle|mix|alloc)$' <<<"$states"; then
            return 0
        fi
        # a node left down/drained by an earlier run comes back at once
        SLURM_CONF="$CONF" scontrol update NodeName="$(IFS=,; echo "${NODES[*]}")" State=RESUME >/dev/null 2>&1 || true
        sleep 1
    done
    die "nodes not idle after 60 s (sinfo: ${states:-no answer}); see $DIR/log/"
}

stop_daemons() {
    local pidfile pid i
    if pid_alive "$DIR/run/slurmctld.pid"; then  # jobs first, so no step outlives its slurmd
        SLURM_CONF="$CONF" scancel --partition=l9,l9urgent --full >/dev/null 2>&1 || true
        for i in $(seq 1 30); do
            [[ -z "$(SLURM_CONF="$CONF" squeue -h -o %i 2>/dev/null)" ]] && break
            sleep 0.5
        done
    fi
    for pidfile in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid" "$DIR/run/slurmdbd.pid" "$DIR/run/mariadbd.pid" \
        "$DIR/run/munged.pid"; do
        [[ -f "$pidfile" ]] || continue
        pid="$(cat "$pidfile")"
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid"
            for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid"; fi
        fi
        rm -f "$pidfile"
    done
    # a job step left behind (its slurmd killed first) holds a socket in this cluster's spool
    for pid in $(pgrep -x slurmstepd || true); do
        if ls -l "/proc/$pid/fd" 2>/dev/null | grep -qF "$DIR/"; then kill -9 "$pid" 2>/dev/null || true; fi
    done
}

stop() {
    if [[ -d "$DIR" ]]; then take_lock; fi
    stop_daemons
    remove_hosts
    echo "slurm_cluster.sh: stopped (state and logs kept in $DIR)"
}

status() {
    local ok=0 f
    for f in munged mariadbd slurmdbd slurmctld "${NODES[@]/#/slurmd-}"; do
        if pid_alive "$DIR/run/$f.pid"; then echo "$f: running (pid $(cat "$DIR/run/$f.pid"))"; else echo "$f: not running"; ok=1; fi
    done
    ((ok == 0)) && SLURM_CONF="$CONF" sinfo -N -o '%N %t %G %c'
    return $ok
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) die "usage: $0 start|stop|status|env (seen: '${1:-}')" ;;
esac
