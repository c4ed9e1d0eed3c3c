#!/usr/bin/env bash
# `make bench-gpu` on a GPU machine, as one prepared command (issue 16): 4 GiB of
# tokens in 32 shards on tmpfs, batches of 16,384 rows, K = 1 and 8 local ranks, the
# pinned host-to-device limit measured in the same run, and first a check (VERIFY) that
# the device batches of every path it times (windows, per-batch, staged) equal the
# plain path's; a path that fails is reported and left out, and the main runs fall back
# to the per-batch path if the window path fails. Then the CPU side (thread CPU us per
# batch, no bytes copied), the K=1 and K=8 window-path runs, K=1 on the per-batch and
# staged paths for comparison, K=1 at 65,536 rows, and then sample mode at K=1:
# sample-device (each window copied once, every batch gathered on the GPU) against
# sample-cpu-gather (today's path), both verified against the plain sample path first,
# two passes each, printed as extra lines (SAMPLE ...), left out if the run is already
# 150 s in (--sample-after), so RESULT stays last and in time. That machine has
# python3 with torch (CUDA), numpy and pyarrow but no network and no package index: the project
# runs from this tree on PYTHONPATH, and torchdata is not needed.
# Run from the repository root:   OUT=/some/dir bash bench/gpu_device.sh
# Writes $OUT/bench-gpu.txt (the report, RESULT last), $OUT/bench-gpu.json and
# $OUT/machine.txt. Meant to stay under 3 minutes (not timed on a GPU since the sample
# runs were added); cut at BENCH_GPU_TIMEOUT seconds (default 290).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench-gpu-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

{
  date -u
  git rev-parse HEAD 2>/dev/null || echo "(no git metadata in this copy)"
  nproc; free -g; df -h /dev/shm
  nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv 2>/dev/null || true
  "$PY" -c 'import sys, torch, pyarrow, numpy; print(sys.version, "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(), "pyarrow", pyarrow.__version__)'
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout --signal=INT --kill-after=20 "${BENCH_GPU_TIMEOUT:-290}" \
  "$PY" -m bench.gpu --size 4GiB --shards 32 --rows 16384,65536 --ranks 1,8 --passes 3 \
    --json "$OUT/bench-gpu.json" "$@" 2>&1 | tee "$OUT/bench-gpu.txt"
exit "${PIPESTATUS[0]}"
