#!/usr/bin/env bash
# `make bench-node` on a 16-core machine (issue 14's shape: 6 GiB of tokens in 48 shards,
# K = 1,2,4,8,16, file:// on tmpfs), as one prepared command. That machine has no network
# and no MinIO, but pyarrow, aiohttp and prometheus-client: nothing is installed from an
# index. Run from the repository root:   OUT=/some/dir bash bench/node_device.sh
# Writes at most 8 files, none in a folder: $OUT/bench-node.txt (the report, RESULT
# last), $OUT/bench-node.json (figures), $OUT/machine.txt, $OUT/cold-timeline.txt (the
# cold epoch's fetch-slot occupancy and each shard's stage times, bench/node_timeline.py),
# $OUT/logs.tar.gz (sidecar and rank logs), $OUT/bench-opens.txt (the cost of an open),
# $OUT/bench-requests.txt (sidecar CPU per request, by route) and, when py-spy is at
# hand, $OUT/cold-profile.txt (a second cold epoch, sampled: GIL share and stacks; its
# collapsed stacks stay on that machine).
# About 3-5 minutes; bench-node is cut at BENCH_NODE_TIMEOUT seconds (default 420), the
# opens at BENCH_NODE_OPENS_TIMEOUT (default 120), each of the two requests runs at
# BENCH_NODE_REQUESTS_TIMEOUT (default 40) and the profiled cold epoch at
# BENCH_NODE_PROFILE_TIMEOUT (default 150; 0 skips it). The parts' usual times end
# inside a 10-minute slot; the caps add up to more (770 s), so a run that must end
# within 600 s sets BENCH_NODE_TIMEOUT=300 or skips the profile.
#
# py-spy is not installed there and nothing comes from an index: carry its wheel (made
# here with `python -m pip download py-spy==0.4.3 --no-deps --only-binary=:all:
# --platform manylinux2014_x86_64 --python-version 3.12 -d shared/wheels`) and point
# PY_SPY_WHEEL at it (default: the first shared/wheels/py_spy-*.whl); the script unpacks
# its one binary. Without it the profile is skipped and said so.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench-node-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

. bench/device_machine.sh
machine_report "$PY" pyarrow aiohttp prometheus_client

# The project from this tree, without pip: its packages on PYTHONPATH, and the CLI's
# subcommand entry points (`shardcache sidecar`, which the benchmark starts) declared
# by a metadata stub, unless the project is installed already.
export PYTHONPATH="$PWD:$PWD/sidecar:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import importlib.metadata as m, sys; sys.exit(not any(e.name == "sidecar" for e in m.entry_points(group="shardcache.commands")))'; then
  stub=$(mktemp -d)
  info="$stub/shardcache-0.1.0.dist-info"
  mkdir -p "$info"
  printf 'Metadata-Version: 2.1\nName: shardcache\nVersion: 0.1.0\n' >"$info/METADATA"
  printf '[shardcache.commands]\nsidecar = shardcache_sidecar.cli:register\n' >"$info/entry_points.txt"
  export PYTHONPATH="$PYTHONPATH:$stub"
fi

logs=$(mktemp -d)
set +e  # the opens below run whatever bench-node's status, which the script returns
timeout --signal=INT --kill-after=30 "${BENCH_NODE_TIMEOUT:-420}" \
  "$PY" -m bench.node --size 6GiB --shards 48 --ks 1,2,4,8,16 \
    --json "$OUT/bench-node.json" --logs "$logs" --timeline "$OUT/cold-timeline.txt" \
    "$@" 2>&1 | tee "$OUT/bench-node.txt"
status=${PIPESTATUS[0]}
set -e
# One file for the logs: what comes back from the machine is a few files.
tar -czf "$OUT/logs.tar.gz" -C "$logs" . 2>/dev/null || true
rm -rf "$logs"

# Then the cost of an open, K ranks at once (bench/node_opens.py: about 30-60 s here);
# BENCH_NODE_OPENS_TIMEOUT=0 skips it. Its failure never changes the exit status.
if [ "${BENCH_NODE_OPENS_TIMEOUT:-120}" != 0 ]; then
  timeout --signal=INT --kill-after=10 "${BENCH_NODE_OPENS_TIMEOUT:-120}" \
    "$PY" -m bench.node_opens --ks 1,8,16 --rounds 5 >"$OUT/bench-opens.txt" 2>&1 || true
  cat "$OUT/bench-opens.txt"
fi

# The sidecar's CPU per request, by route, one client (bench/node_requests.py: about
# 20 s), back to back and then 2 ms apart (each call finds the sidecar idle, as a rank's
# do); BENCH_NODE_REQUESTS_TIMEOUT=0 skips it, each run is cut at that many seconds. Its
# failure never changes the status.
if [ "${BENCH_NODE_REQUESTS_TIMEOUT:-40}" != 0 ]; then
  for gap in 0 2; do
    echo "-- calls ${gap} ms apart" >>"$OUT/bench-requests.txt"
    timeout --signal=INT --kill-after=10 "${BENCH_NODE_REQUESTS_TIMEOUT:-40}" \
      "$PY" -m bench.node_requests --seconds 2 --gap-ms "$gap" >>"$OUT/bench-requests.txt" 2>&1 || true
  done
  cat "$OUT/bench-requests.txt"
fi

# Then, if py-spy is at hand, a second cold epoch (same dataset shape, K=16 ranks, one
# warm pass; BENCH_NODE_PROFILE_ARGS replaces those arguments) with the sidecar sampled from its start (`--profile-cold`: py-spy --gil at
# 250 Hz): whether its threads queue on the GIL, and where its Python time goes. Its
# cold figures are perturbed by the sampling; the first run's are the ones to report.
wheel=${PY_SPY_WHEEL:-$(ls shared/wheels/py_spy-*.whl 2>/dev/null | head -1 || true)}
if [ "${BENCH_NODE_PROFILE_TIMEOUT:-150}" != 0 ]; then
  if [ -n "$wheel" ] && [ -f "$wheel" ]; then
    spy=$(mktemp -d)
    "$PY" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); n = next(n for n in z.namelist() if n.endswith("/scripts/py-spy")); open(sys.argv[2], "wb").write(z.read(n))' "$wheel" "$spy/py-spy"
    chmod +x "$spy/py-spy"
    PATH="$spy:$PATH" timeout --signal=INT --kill-after=20 "${BENCH_NODE_PROFILE_TIMEOUT:-150}" \
      "$PY" -m bench.node ${BENCH_NODE_PROFILE_ARGS:---size 6GiB --shards 48 --ks 16 --passes 1} \
        --profile-cold "$spy/cold-profile.raw" >"$OUT/cold-profile.txt" 2>&1 || true
    rm -f "$OUT/cold-profile.log"
    tail -n 90 "$OUT/cold-profile.txt"
  else
    echo "no py-spy wheel (PY_SPY_WHEEL, shared/wheels/py_spy-*.whl): cold profile skipped" \
      | tee "$OUT/cold-profile.txt"
  fi
fi
exit "$status"
