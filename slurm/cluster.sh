#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests, CI and trying sweeps on a laptop (run as root).
#   bash slurm/cluster.sh start   # prints `export SLURM_CONF=...`; idempotent
#   bash slurm/cluster.sh stop    # cancels its jobs, then stops the daemons
# Debian's slurm-wlm and munge (scripts/setup.sh installs them); proctrack/linuxproc and task/none, so no
# cgroups are needed; select/cons_tres with cores and memory as consumable resources. No accounting
# daemon: `sacct` is unavailable and `mlbench sweep status` reads squeue and the run folders instead.
set -euo pipefail
STATE=${MLBENCH_SLURM_DIR:-/tmp/mlbench-slurm}
CONF=$STATE/slurm.conf
cmd=${1:-start}

need() { command -v "$1" >/dev/null || { echo "cluster: $1 not found; install Debian's slurm-wlm and munge (bash scripts/setup.sh does, as root)" >&2; exit 1; }; }

stop() {
  pkill -f "slurmctld -f $CONF" 2>/dev/null || true
  pkill -f "slurmd -f $CONF" 2>/dev/null || true
  # munged too, when this script started it (a system's own munged is left alone)
  if [ -f "$STATE/munged.ours" ]; then pkill -x munged 2>/dev/null || true; rm -f "$STATE/munged.ours"; fi
  sleep 1
}

if [ "$cmd" = stop ]; then
  # cancel the jobs first: a running job's slurmstepd and processes outlive the daemons (a test that failed
  # mid-sweep left them running), and a pending one would start with the next `start`, which recovers the queue
  if SLURM_CONF=$CONF timeout 10 scontrol ping 2>/dev/null | grep -q UP; then
    SLURM_CONF=$CONF timeout 10 scancel --partition=debug 2>/dev/null || true
    for _ in $(seq 45); do  # KillWait (30 s) and some
      [ -z "$(SLURM_CONF=$CONF timeout 10 squeue -h -t RUNNING,COMPLETING,CONFIGURING -o %i 2>/dev/null)" ] && break
      sleep 1
    done
  fi
  stop; exit 0
fi
[ "$cmd" = start ] || { echo "usage: cluster.sh start|stop" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "cluster: run as root (slurmd starts jobs as their users)" >&2; exit 1; }
need munged; need slurmctld; need slurmd

if SLURM_CONF=$CONF scontrol ping 2>/dev/null | grep -q UP && SLURM_CONF=$CONF sinfo -h -o %T 2>/dev/null | grep -qxE '(idle|mixed|allocated)'; then
  echo "cluster: already running ($CONF)" >&2
  echo "export SLURM_CONF=$CONF"; exit 0
fi
stop
mkdir -p "$STATE"/{ctld,spool,log} /run/munge
if ! pgrep -x munged >/dev/null; then
  [ -s /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
  chown -R root /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
  chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key
  munged --force
  touch "$STATE/munged.ours"
fi
HOST=$(hostname -s)
CPUS=$(nproc)
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048 ))
cat > "$CONF" <<CONF
ClusterName=mlbench
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
GresTypes=gpu
KillWait=30
MailProg=/bin/true
MinJobAge=600
SchedulerParameters=bf_interval=1,sched_interval=1
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
# Eight GPUs on paper only (no device files): lets `sbatch --test-only` check GPU job scripts here; jobs
# that ask for GPUs are never started by the tests.
for i in 0 1 2 3 4 5 6 7; do [ -c "$STATE/fakegpu$i" ] || { rm -f "$STATE/fakegpu$i"; mknod "$STATE/fakegpu$i" c 1 3; }; done  # /dev/null twins
printf "AutoDetect=off
NodeName=$HOST Name=gpu File=$STATE/fakegpu[0-7]\n" > "$STATE/gres.conf"
slurmctld -f "$CONF"
slurmd -f "$CONF"
for _ in $(seq 60); do
  # a node drained by an earlier, broken configuration keeps that state across restarts: return it to service
  SLURM_CONF=$CONF sinfo -h -o %T 2>/dev/null | grep -qE '^(drain|drained|down)' &&
    SLURM_CONF=$CONF scontrol update nodename="$HOST" state=resume 2>/dev/null || true
  if SLURM_CONF=$CONF sinfo -h -o %T 2>/dev/null | grep -qxE '(idle|mixed|allocated)'; then
    echo "export SLURM_CONF=$CONF"; exit 0
  fi
  sleep 1
done
echo "cluster: the node did not come up; logs in $STATE/log" >&2
tail -n 5 "$STATE"/log/*.log >&2
exit 1
