# CPU quotas for bench/request_kinds.sh's saturation runs (sourced). Each proxy gets a cgroup of
# its own whose CFS bandwidth is a share of one core: with PROXY_QUOTA=4, 1 ms of CPU in every
# 25 ms period (QUOTA_PERIOD_US). The proxy is then the bound of the run, not the store and the
# client on the other core (on a two-core machine those cap every proxy at about 1,300 requests
# per second, ~17% of the proxies' core): requests per second at saturation are the proxy's
# own, on a fraction of a core. quota_hook.sh records how many periods of a phase were
# throttled: the evidence that the proxy, not the rest, was the bound. Needs root and a cgroup
# `cpu` controller (v1 or v2).
#   quota_start NAME PERCENT PID...   # the cgroup's directory in QUOTA_DIR[NAME]
#   quota_stop                        # every process back to the root cgroup; cgroups removed
declare -A QUOTA_DIR
QUOTA_PERIOD_US=${QUOTA_PERIOD_US:-25000}
quota_root() {
  if [ -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then echo /sys/fs/cgroup/cpu
  elif [ -f /sys/fs/cgroup/cgroup.controllers ] && grep -qw cpu /sys/fs/cgroup/cgroup.controllers; then echo /sys/fs/cgroup
  else return 1; fi
}
quota_start() {  # name percent pid...
  local name=$1 percent=$2 root dir quota p; shift 2
  root=$(quota_root) || { echo "quota: no cgroup cpu controller here" >&2; return 1; }
  quota=$(( percent * QUOTA_PERIOD_US / 100 ))
  [ "$quota" -ge 1000 ] || { echo "quota: ${percent}% of ${QUOTA_PERIOD_US} µs is under the kernel's 1 ms minimum" >&2; return 1; }
  dir=$root/tensorgate-bench-$$-${name//@/-}
  mkdir -p "$dir" || return 1
  if [ -f "$dir/cpu.cfs_quota_us" ]; then
    echo "$QUOTA_PERIOD_US" > "$dir/cpu.cfs_period_us"; echo "$quota" > "$dir/cpu.cfs_quota_us"
  else
    echo "$quota $QUOTA_PERIOD_US" > "$dir/cpu.max"
  fi
  for p in "$@"; do echo "$p" > "$dir/cgroup.procs"; done
  QUOTA_DIR[$name]=$dir
}
quota_stop() {
  local root dir p
  root=$(quota_root) || return 0
  for dir in "${QUOTA_DIR[@]}"; do
    [ -d "$dir" ] || continue
    while read -r p; do echo "$p" > "$root/cgroup.procs" 2>/dev/null || true; done < "$dir/cgroup.procs"
    rmdir "$dir" 2>/dev/null || true
  done
}
