#!/usr/bin/env bash
# `make bench-sample` on the 16-core device machine, as one prepared command (issue 15,
# item 1: sample mode at >= 0.5x block mode's warm tokens/s, measured in one run): 1 GiB
# of bench.peers' token rows (Parquet, generated here first), embedded caches on
# /dev/shm, batch 256, block mode beside sample mode at gather pool sizes
# 0 (inline), 2, 4, 8 and 16 (`Dataset.gather_threads`), 5 warm passes each, the
# passes alternating. One line per pool size with the CPU it used; RESULT last
# (sample at the default pool size vs block, and the best size). Under each sample line
# a timed pass says where a batch's time went: the consumer thread's CPU, and a
# gathering's CPU and wall time per batch (wall well above CPU: it waited for the GIL). That machine has
# python3 with pyarrow and numpy but no network: the project runs from this tree on
# PYTHONPATH. Run from the repository root:   OUT=/some/dir bash bench/sample_device.sh
# Writes $OUT/bench-sample.txt and $OUT/machine.txt. About 60-90 s there (the dataset's
# generation and first decode are most of it); cut at BENCH_SAMPLE_TIMEOUT seconds
# (default 150). Extra arguments go to bench.sample_read (e.g. --size 256MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench-sample-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

. bench/device_machine.sh
machine_report "$PY" pyarrow numpy

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout --signal=INT --kill-after=20 "${BENCH_SAMPLE_TIMEOUT:-150}" \
  "$PY" -m bench.sample_read --size 1GiB --passes 5 --threads 0,2,4,8,16 "$@" 2>&1 \
  | tee "$OUT/bench-sample.txt"
exit "${PIPESTATUS[0]}"
