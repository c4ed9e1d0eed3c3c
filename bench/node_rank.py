"""One rank process of `make bench-node` (bench/node.py starts K of these at once).

    python -m bench.node_rank CONFIG.json

The rank reads its partition of one epoch per pass, either through the sidecar
(`shardcache.open()` with the trainer's environment) or "raw": the same plan
(`plans.rank_runs`) over the decoded Arrow IPC files memory-mapped directly, batched
and stitched the way `Dataset.batches` does, so the two differ only by the control
channel. Every batch is touched the same way: rows counted, uids and every token summed.

The parent drives it over stdin/stdout, one JSON object a line: the rank says
`{"ready": true}` once imported, then for each pass reads `{"go": T0, "epoch": E}`
(T0 on the machine-wide monotonic clock, the same instant for all K ranks), waits for
T0, reads the epoch and answers with what it measured. Control calls are timed on the
client by wrapping `shardcache.unix_http.exchange`, the one function every call to the
sidecar goes through, and classed by route.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

import shardcache
from shardcache import plans, unix_http

#: Seconds for the client's background notifications to go out after a pass.
SETTLE_S = 0.05

#: Names of control calls, by HTTP method and the last segment of the path.
_ROUTES = {
    ("POST", "acquire"): "acquire",
    ("POST", "position"): "position",
    ("POST", "pinned"): "pinned",
    ("POST", "notes"): "notes",
    ("DELETE", "leases"): "release",
    ("PUT", "readers"): "register",
    ("DELETE", "readers"): "unregister",
    ("GET", "manifest"): "manifest",
}


def route_name(method: str, path: str) -> str:
    """`acquire`, `release`, ... for a control request (its method and URL path)."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and (method, parts[-2]) in _ROUTES:  # /v1/leases/<id>
        return _ROUTES[(method, parts[-2])]
    return _ROUTES.get((method, parts[-1] if parts else ""), f"{method} {path}")


#: A control call slower than this has its share of the rank's own collections noted.
SLOW_CALL_S = 0.001


class ControlTimer:
    """Records (route, seconds, on the read path?) of every control request made, and
    of each slower than `SLOW_CALL_S` (route, seconds, seconds of this process's
    collections meanwhile): a client-side outlier may be the rank's own collector."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, bool]] = []
        self.slow: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()
        self._main = threading.main_thread()
        self._gc_s = 0.0
        self._gc_started = 0.0
        gc.callbacks.append(self._collected)

    def _collected(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_started

    def install(self) -> None:
        exchange = unix_http.exchange

        def timed(socket_path: Any, method: str, path: str, *args: Any, **kw: Any) -> Any:
            start, gc_s = time.perf_counter(), self._gc_s
            try:
                return exchange(socket_path, method, path, *args, **kw)
            finally:
                took = time.perf_counter() - start
                blocking = threading.current_thread() is self._main
                route = route_name(method, path)
                with self._lock:
                    self.calls.append((route, took, blocking))
                    if took >= SLOW_CALL_S:
                        self.slow.append((route, took, self._gc_s - gc_s))

        unix_http.exchange = timed

    def take(self) -> tuple[list[tuple[str, float, bool]], list[tuple[str, float, float]]]:
        """The calls and the slow calls since the last `take`."""
        with self._lock:
            calls, self.calls = self.calls, []
            slow, self.slow = self.slow, []
        return calls, slow


class Tally:
    """What a pass read: rows, the sum of their uids, tokens and the sum of the tokens."""

    def __init__(self, keep_uids: bool) -> None:
        self.rows = self.uid_sum = self.tokens = self.token_sum = 0
        self.uids: list[pa.Array] = []
        self._keep = keep_uids

    def add(self, batch: pa.RecordBatch) -> None:
        uid = batch.column("uid")
        values = batch.column("tokens").flatten()
        self.rows += batch.num_rows
        self.uid_sum += pc.sum(uid).as_py() or 0
        self.tokens += len(values)
        self.token_sum += pc.sum(values).as_py() or 0
        if self._keep:
            # A copy: a slice would keep the shard's mapping (and its pages) alive.
            self.uids.append(pa.concat_arrays([uid]))


def pss_bytes() -> int:
    """This process's proportional set size: shared pages count 1/n per sharer."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


class RawReader:
    """The rank's plan over the decoded files, without a sidecar."""

    def __init__(self, config: dict[str, Any]) -> None:
        layout = json.loads(Path(config["layout"]).read_text())
        self._paths = [Path(p) for p in layout["paths"]]
        self._shard_rows = layout["shard_rows"]
        self._digest = layout["digest"]
        self._params = plans.PlanParams(
            seed=config["seed"],
            epoch=0,
            rank=config["rank"],
            world_size=config["world_size"],
            shuffle=config["shuffle"],
            block_size=config["block_size"],
        )
        self._maps: dict[int, pa.RecordBatch] = {}

    def batches(self, epoch: int, batch_size: int) -> Iterator[pa.RecordBatch]:
        params = self._params.with_epoch(epoch)
        pending: list[pa.RecordBatch] = []
        pending_rows = 0
        for run in plans.rank_runs(self._shard_rows, self._digest, params):
            shard = self._maps.get(run.shard)
            if shard is None:
                # Kept, as a trainer's Dataset keeps its mappings of shards it may revisit.
                shard = ipc.open_file(pa.memory_map(str(self._paths[run.shard]))).get_batch(0)
                self._maps[run.shard] = shard
            start = run.start
            while start < run.stop:
                take = min(batch_size - pending_rows, run.stop - start)
                piece = shard.slice(start, take)
                start += take
                if not pending and take == batch_size:
                    yield piece
                    continue
                pending.append(piece)
                pending_rows += take
                if pending_rows == batch_size:
                    yield pa.concat_batches(pending)
                    pending, pending_rows = [], 0
        if pending:
            yield pa.concat_batches(pending)

    def close(self) -> None:
        self._maps.clear()


class SidecarReader:
    """The rank through the sidecar: `shardcache.open()` as a trainer calls it."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config
        self._ds: shardcache.Dataset | None = None

    def batches(self, epoch: int, batch_size: int) -> Iterator[pa.RecordBatch]:
        if self._ds is None:
            c = self._config
            self._ds = shardcache.open(
                rank=c["rank"], world_size=c["world_size"], seed=c["seed"], shuffle=c["shuffle"]
            )
        self._ds.set_epoch(epoch)
        return self._ds.batches(batch_size)

    def close(self) -> None:
        if self._ds is not None:
            self._ds.close()
            self._ds = None


def one_pass(
    reader: RawReader | SidecarReader,
    go: float,
    epoch: int,
    batch_size: int,
    keep_uids: bool,
    timer: ControlTimer | None,
) -> dict[str, Any]:
    while (wait := go - time.monotonic()) > 0:
        time.sleep(wait)
    tally = Tally(keep_uids)
    stream = reader.batches(epoch, batch_size)
    first_s = None
    for batch in stream:
        if first_s is None:
            first_s = time.monotonic() - go
        tally.add(batch)
    end_s = time.monotonic() - go
    if timer is not None:
        # Notifications trail the read path by milliseconds: count them with this pass.
        time.sleep(SETTLE_S)
    calls, slow = timer.take() if timer is not None else ([], [])
    return {
        "epoch": epoch,
        "first_s": first_s if first_s is not None else end_s,
        "end_s": end_s,
        "rows": tally.rows,
        "uid_sum": tally.uid_sum,
        "tokens": tally.tokens,
        "token_sum": tally.token_sum,
        "pss": pss_bytes(),
        "calls": calls,
        "slow_calls": slow,
        "uids": pa.concat_arrays(tally.uids).to_pylist() if keep_uids and tally.uids else [],
    }


def main(argv: list[str]) -> int:
    config = json.loads(Path(argv[0]).read_text())
    timer = None
    reader: RawReader | SidecarReader
    if config["mode"] == "raw":
        reader = RawReader(config)
    else:
        timer = ControlTimer()
        timer.install()
        reader = SidecarReader(config)
    send: Callable[[dict[str, Any]], None] = lambda msg: print(json.dumps(msg), flush=True)  # noqa: E731
    send({"ready": True})
    try:
        for line in sys.stdin:
            order = json.loads(line)
            if order.get("stop"):
                break
            send(
                one_pass(
                    reader,
                    float(order["go"]),
                    int(order["epoch"]),
                    int(config["batch_size"]),
                    bool(config["keep_uids"]),
                    timer,
                )
            )
    finally:
        reader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
