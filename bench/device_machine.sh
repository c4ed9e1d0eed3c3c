# Sourced by bench/*_device.sh: what the lent machine is, in $OUT/machine.txt and shown,
# so a device run's figures travel with the machine that gave them.
#   machine_report PYTHON MODULE...   the machine, then Python's version and each module's
machine_report() {
  local py=$1
  shift
  {
    date -u
    git rev-parse HEAD 2>/dev/null || echo "(no git metadata in this copy)"
    nproc
    cat /sys/fs/cgroup/cpu.max 2>/dev/null || true
    lscpu 2>/dev/null | grep -E 'Model name|^CPU\(s\)|Thread|Socket|NUMA node\(s\)' || true
    free -g
    df -h /dev/shm /tmp
    nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current \
      --format=csv 2>/dev/null || true
    "$py" -c 'import importlib, sys
print(sys.version, *(m + " " + getattr(importlib.import_module(m), "__version__", "?") for m in sys.argv[1:]))' "$@"
  } >"$OUT/machine.txt" 2>&1
  cat "$OUT/machine.txt"
}
