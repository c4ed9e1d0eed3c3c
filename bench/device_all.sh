#!/usr/bin/env bash
# Both open device figures in one call of at most 600 s, for a session lent a 16-core
# machine with 15 minutes of device time in all (a start costs minutes of it):
#   1. issue 15's sample mode against block mode, pool sizes 0-16 (bench/sample_device.sh,
#      1 GiB; about 60-90 s there, cut at 140 s) into $OUT/sample/;
#   2. issue 14's `make bench-node` at K = 1,2,4,8,16 (bench/node_device.sh, 6 GiB in 48
#      shards; about 3-5 minutes there, cut at 330 s), then the cost of an open (cut at
#      60 s) and the sidecar's CPU per request by route (20 s each), into $OUT/node/.
#      The py-spy profile of a second cold epoch is skipped: it does not fit.
# Sample first: it is the shorter, so a run cut short still brings one issue's figures.
# The caps add up to 570 s; run it with the tool's timeout at 600. Extra arguments go to
# bench.node (e.g. --account, for the sidecar's own account of slow requests and loop
# stalls: a second call, if the device time left allows, with `--ks 1,8,16 --account`).
#   OUT=/some/dir bash bench/device_all.sh
# Exits with bench-node's status, or the sample run's where bench-node passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench-device-out}
mkdir -p "$OUT/sample" "$OUT/node"

OUT="$OUT/sample" BENCH_SAMPLE_TIMEOUT=${BENCH_SAMPLE_TIMEOUT:-140} bash bench/sample_device.sh
sample=$?

OUT="$OUT/node" BENCH_NODE_TIMEOUT=${BENCH_NODE_TIMEOUT:-330} \
  BENCH_NODE_OPENS_TIMEOUT=${BENCH_NODE_OPENS_TIMEOUT:-60} \
  BENCH_NODE_REQUESTS_TIMEOUT=${BENCH_NODE_REQUESTS_TIMEOUT:-20} \
  BENCH_NODE_PROFILE_TIMEOUT=${BENCH_NODE_PROFILE_TIMEOUT:-0} \
  bash bench/node_device.sh "$@"
node=$?

echo "sample_device exit $sample, node_device exit $node"
grep -h '^RESULT' "$OUT/sample/bench-sample.txt" "$OUT/node/bench-node.txt" 2>/dev/null || true
[ "$node" != 0 ] && exit "$node"
exit "$sample"
