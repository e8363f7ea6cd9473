#!/usr/bin/env bash
# A single-node SLURM cluster from Debian's packages (slurm-wlm, slurmdbd, munge, mariadb-server),
# for tests: a `cpu` and a `gpu` partition (Gres=gpu:8 on 8 stand-in character devices), accounting
# through slurmdbd and a private MariaDB so that `sacct` works as on a production cluster.
#
#   tests/slurm/cluster.sh start STATE_DIR   # writes /etc/slurm/*.conf, starts the daemons
#   tests/slurm/cluster.sh stop STATE_DIR    # stops every daemon by its pidfile, removes its configs
#
# Needs root. SLURM reads /etc/slurm/slurm.conf (SLURM_CONF alone is lost in the executor's job
# steps); a slurm.conf not written by this script is never overwritten.
set -euo pipefail

MARKER="# written by eagle3-datagen tests/slurm/cluster.sh"
ACTION=${1:?usage: cluster.sh start|stop STATE_DIR}
STATE=$(realpath -m "${2:?usage: cluster.sh start|stop STATE_DIR}")
NODE=$(hostname -s)
DB_PORT=3307
# Daemons in the order they start; stop goes in reverse.
DAEMONS=(munged mariadbd slurmdbd slurmctld slurmd)

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2
    shift 2
    for _ in $(seq $((limit * 5))); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    echo "cluster.sh: $what did not come up within ${limit}s; logs in $STATE/log" >&2
    tail -n 20 "$STATE"/log/*.log >&2 || true
    return 1
}

stop() {
    for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
        local pidfile="$STATE/run/${DAEMONS[i]}.pid"
        [[ -s $pidfile ]] || continue
        local pid
        pid=$(<"$pidfile")
        if kill -TERM "$pid" 2>/dev/null; then
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
    done
    # With a slurm.conf and no controller, every snakemake call waits 10 s: the slurm executor
    # plugin runs `scontrol show config` when it is loaded, whichever executor the run uses.
    for conf in slurm gres slurmdbd cgroup; do
        if grep -qsF "$MARKER" "/etc/slurm/$conf.conf"; then rm -f "/etc/slurm/$conf.conf"; fi
    done
}

write_configs() {
    local cpus mem_mb
    cpus=$(nproc)
    # Leave the OS 2 GiB; jobs ask for what the test config sets.
    mem_mb=$(($(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) - 2048))
    if [[ -e /etc/slurm/slurm.conf ]] && ! grep -qF "$MARKER" /etc/slurm/slurm.conf; then
        echo "cluster.sh: /etc/slurm/slurm.conf exists and is not ours; refusing to overwrite it" >&2
        exit 1
    fi
    mkdir -p /etc/slurm "$STATE"/{run,log,spool,ctld,dev,db}
    # Process tracking as production clusters have it, where the machine allows: proctrack/cgroup kills
    # whatever a job step leaves behind when the step ends (the workflow's node services run in steps of
    # their own for that reason). It needs a writable cgroup v1 freezer hierarchy (SLURM 22.05's cgroup/v2
    # needs systemd); without one, processes are tracked by parentage (proctrack/linuxproc).
    local proctrack=linuxproc
    if [[ -w /sys/fs/cgroup/freezer && -w /sys/fs/cgroup/devices ]]; then
        proctrack=cgroup
        cat >/etc/slurm/cgroup.conf <<EOF
$MARKER
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
    fi
    for i in $(seq 0 7); do
        [[ -c $STATE/dev/nvidia$i ]] || mknod "$STATE/dev/nvidia$i" c 195 "$i"
    done
    cat >/etc/slurm/slurm.conf <<EOF
$MARKER
ClusterName=ci
SlurmctldHost=$NODE
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/$proctrack
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$NODE
# sacct shows the GPUs a job held and its comment (the executor writes the rule's name there).
AccountingStorageTRES=gres/gpu
AccountingStoreFlags=job_comment
# A job's account and QoS must be the user's (sacctmgr's associations), as on production clusters.
AccountingStorageEnforce=associations,qos
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
ReturnToService=2
# A requeued job waits one credential lifetime before it may start again (cred_expire, 120 s by default:
# slurm.conf(5)); 30 s is still ample for a step launch on this node.
AuthInfo=cred_expire=30
# A job past its time limit, or cancelled, gets SIGKILL this long after SIGTERM (30 s by default): the
# stopped-run tests wait it out for a runner that ignores SIGTERM.
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$NODE CPUs=$cpus RealMemory=$mem_mb Gres=gpu:8 State=UNKNOWN
# docs/slurm.md's four 8-GPU nodes: this node and three that never start (down, at an address nothing answers), in
# a partition of the walk-through's name, with its QoS and account (below), for its config's dry-run and fit check.
NodeName=e3dg-gpu[2-4] NodeAddr=192.0.2.1 CPUs=96 RealMemory=2000000 Gres=gpu:8 State=DOWN Reason=stand-in
PartitionName=cpu Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$NODE MaxTime=INFINITE State=UP
PartitionName=h200 Nodes=$NODE,e3dg-gpu[2-4] MaxTime=2-00:00:00 State=UP
EOF
    # Without File= the node goes INVAL; the devices are stand-ins (no GPU is used).
    cat >/etc/slurm/gres.conf <<EOF
$MARKER
AutoDetect=off
NodeName=$NODE Name=gpu File=$STATE/dev/nvidia[0-7]
EOF
    cat >/etc/slurm/slurmdbd.conf <<EOF
$MARKER
AuthType=auth/munge
DbdHost=$NODE
SlurmUser=root
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StorageLoc=slurm_acct_db
EOF
    chmod 600 /etc/slurm/slurmdbd.conf
}

start() {
    write_configs
    # A munged the package's service already runs is used (and left running).
    if ! (munge -n | unmunge) >/dev/null 2>&1; then
        # munged refuses a socket directory others cannot traverse.
        mkdir -p /run/munge
        chown munge:munge /run/munge
        chmod 0755 /run/munge
        rm -f /run/munge/munged.pid
        runuser -u munge -- /usr/sbin/munged >"$STATE/log/munged.log" 2>&1
        wait_for 10 munged test -s /run/munge/munged.pid
        cp /run/munge/munged.pid "$STATE/run/munged.pid"
    fi

    # A private MariaDB (its own socket and port, beside any the package's service runs) with a
    # passwordless user for slurmdbd on 127.0.0.1.
    local sql=(mariadb --socket="$STATE/run/mysqld.sock" -uroot)
    [[ -d $STATE/db/mysql ]] || mariadb-install-db --datadir="$STATE/db" --user=root \
        --auth-root-authentication-method=normal >"$STATE/log/mariadb-install.log" 2>&1
    /usr/sbin/mariadbd --no-defaults --datadir="$STATE/db" --user=root \
        --bind-address=127.0.0.1 --port="$DB_PORT" --socket="$STATE/run/mysqld.sock" \
        --pid-file="$STATE/run/mariadbd.pid" --log-error="$STATE/log/mariadbd.log" \
        </dev/null >/dev/null 2>&1 &
    wait_for 30 mariadbd "${sql[@]}" -e "select 1"
    "${sql[@]}" -e "CREATE USER IF NOT EXISTS slurm@'127.0.0.1';
        GRANT ALL ON slurm_acct_db.* TO slurm@'127.0.0.1';"

    /usr/sbin/slurmdbd
    wait_for 30 slurmdbd sacctmgr -n list cluster
    sacctmgr -i add cluster ci >/dev/null 2>&1 || true
    # docs/slurm.md's account and QoS, root's (jobs without them run under root's own account and QoS normal)
    sacctmgr -i add qos gpu-week >/dev/null 2>&1 || true
    sacctmgr -i add account llm-team cluster=ci >/dev/null 2>&1 || true
    sacctmgr -i add user root account=llm-team cluster=ci >/dev/null 2>&1 || true
    sacctmgr -i modify user root set qos=normal,gpu-week >/dev/null
    /usr/sbin/slurmctld
    wait_for 30 slurmctld scontrol ping
    /usr/sbin/slurmd -N "$NODE"
    wait_for 30 "node $NODE" sh -c "sinfo -h -N -o %T | grep -qx idle"
    # Accounting answers (the executor's status queries read sacct).
    wait_for 30 sacct sacct -n -X -a
}

case $ACTION in
start) start ;;
stop) stop ;;
*)
    echo "usage: cluster.sh start|stop STATE_DIR" >&2
    exit 2
    ;;
esac
