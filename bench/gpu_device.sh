#!/usr/bin/env bash
# `make bench-gpu` on a GPU machine, as one prepared command (issue 16): 8 GiB of
# tokens in 32 shards on tmpfs (so a steady pass at the link's rate lasts about 0.16 s
# and per-pass fixed costs weigh little), batches of 16,384 rows, K = 1 and 8 local
# ranks, the pinned host-to-device limit measured in the same run, and first a check
# (VERIFY) that the device batches of every path it times (windows, ordered,
# torch-copies, per-batch, staged) equal the plain path's; a path that fails is reported
# and left out, and the main runs fall back to the per-batch path if the window path
# fails. Then the CPU side (thread CPU us per batch, no bytes copied), the K=1 and K=8
# window-path runs, K=1 on the other paths for comparison (ordered: the dataset in
# manifest order, about one copy a window instead of one a shuffle block), K=1 at
# 65,536 rows, and then sample mode at K=1: sample-device (each window copied once,
# every batch gathered on the GPU) against sample-cpu-gather (today's path), both
# verified against the plain sample path first, two passes of 128 batches each,
# printed as extra lines (SAMPLE ...), left out if the run is already 150 s in
# (--sample-after), so RESULT stays last and in time. Four passes a run: pass 1
# registers the mappings, the steady figure (and RESULT) is the median of passes 2-4.
# Each run prints its copies a batch and bytes copied / bytes handed over.
# That machine has python3 with torch (CUDA), numpy and pyarrow but no network and no
# package index: the project runs from this tree on PYTHONPATH, and torchdata is not
# needed.
# Run from the repository root:   OUT=/some/dir bash bench/gpu_device.sh
# Writes $OUT/bench-gpu.txt (the report, RESULT last), $OUT/bench-gpu.json and
# $OUT/machine.txt. About 2.5-4 minutes on the H200 machine (runs 5 and 6 on
# 2026-11-26: writing 8 GiB ~21 s, warming ~7 s, then the timed runs); cut at
# BENCH_GPU_TIMEOUT seconds (default 290).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench-gpu-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

. bench/device_machine.sh
machine_report "$PY" torch pyarrow numpy
"$PY" -c 'import torch; print("cuda", torch.version.cuda, torch.cuda.is_available())' \
  2>&1 | tee -a "$OUT/machine.txt"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout --signal=INT --kill-after=20 "${BENCH_GPU_TIMEOUT:-290}" \
  "$PY" -m bench.gpu --size 8GiB --shards 32 --rows 16384,65536 --ranks 1,8 --passes 4 \
    --sample-batches 128 \
    --json "$OUT/bench-gpu.json" "$@" 2>&1 | tee "$OUT/bench-gpu.txt"
exit "${PIPESTATUS[0]}"
