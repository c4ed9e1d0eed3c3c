"""Routes of the web inspector: the page at /ui and its read-only JSON API.

    GET /ui                   the page (its state lives in the query string, so a URL
                              like /ui?rank=3&step=1200 restores a view)
    GET /ui/static/{name}     the page's script and style sheet
    GET /ui/api/info          dataset (public URI, digest, shards, rows, columns), defaults
    GET /ui/api/step          the samples of ?epoch&rank&world_size&step&batch_size&seed...
                              [&pass=K: of an epoch the followed run read more than
                              once, pass K (from 1; the newest by default)]
    GET /ui/api/image         the bytes of an image cell (?shard&row&column), typed
    GET /ui/api/stats         column statistics and length histograms
    GET /ui/api/where         ?expr=...: at which (epoch, rank, step) matches are seen
                              (`pass` as for step: of the first epoch looked in)
    GET /ui/api/lineage       ?expr=...[&limit=N]: which steps, ranks and checkpoints of the run
                              read the matches; ?consumed=STEP: what that checkpoint
                              consumed (only with a run's checkpoint URI configured)

With a run's checkpoint URI, the step and where views follow the streams its ranks
recorded (their skips, and after an elastic resume their segments), whenever the
view's plan (world size included) is one the run had. A checkpoint without a data
state (model only) is left out of those views; a run that cannot be followed (a
mixture's states, a rewound run) leaves them on the plan. Either way the answer says
so in `run_notes`; only /ui/api/lineage refuses.

Reading shards may block on a cold fetch, so the inspector runs in a small executor of
its own. Bad input is a 400 with a JSON message; the server keeps serving.

Every request has a bounded cost (docs/security.md): at most `MAX_BATCH_SIZE` rows and
`MAX_CELLS` cells per step, whose values are clipped in Arrow before they become Python
(`PAGE_OPTIONS`) and convert at most `MAX_CONVERT_BYTES` in all; a `block_size` floor (a
tiny block makes the plan hold one entry per row) and in sample mode a `window` floor
(a permutation is computed per window); `MAX_WORLD_SIZE` ranks and
`MAX_RANK_EPOCHS` ranks x epochs per lookup (each rank's stream is placed);
`MAX_IMAGE_BYTES` per image, checked before it is copied; `WHERE_SCAN_ROWS` rows scanned
per lookup (where and lineage; the answer says how far it got); `MAX_RESPONSE_BYTES`
per JSON answer. Over a limit is a 4xx naming the limit.

The inspector listens on loopback only (`shardcache_sidecar.server.running`), and
answers only requests whose `Host` is a loopback name, an IP address or a host it was
started for (`host_allowed`): a web page whose name was rebound to 127.0.0.1 (DNS
rebinding) sends its own name, and is refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import importlib.resources
import ipaddress
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import urlencode, urlsplit

import pyarrow as pa
from aiohttp import web

from shardcache import errors, plans
from shardcache.inspect import images, locate, render, session
from shardcache.lineage import history, published, queries

T = TypeVar("T")
log = logging.getLogger(__name__)
#: By this name in `_UI`, whose `history` method shadows the module.
History = history.History

PREFIX = "/ui"
_STATIC = {"app.js": "text/javascript", "app.css": "text/css"}
# Same-origin only: the page loads nothing from elsewhere, and nothing may frame it.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
#: What the page shows per cell: enough to read a sample, bounded so a step of long
#: documents stays a small response.
PAGE_OPTIONS = render.RenderOptions(
    max_chars=2000,
    max_tokens=256,
    max_turns=50,
    max_cell_chars=500,
    max_items=256,
    # A longer text clipped for the page reports its size in bytes: counting its
    # characters would read all of it.
    max_count_bytes=64 << 10,
)
#: Bytes of (clipped) values one step answer may convert to Python: about what
#: `MAX_RESPONSE_BYTES` lets through anyway.
MAX_CONVERT_BYTES = 32 << 20
#: Rows the statistics look at: a few shards' worth, computed once and kept.
STATS_ROWS = 100_000
#: And no shard more once those read hold this much (decoded): wide rows (images,
#: long documents) reach it long before `STATS_ROWS`.
STATS_BYTES = 256 << 20
#: Samples a reverse lookup reports.
WHERE_LIMIT = 50
#: Samples a lineage query may ask to follow (?limit=): a response stays small.
LINEAGE_LIMIT = 1000
#: Rows in one step's answer: a large training batch, far below "the whole dataset".
MAX_BATCH_SIZE = 1024
#: Cells (rows x columns) in one step's answer; with PAGE_OPTIONS' per-cell bound this
#: keeps an answer to a few MiB even for wide tables.
MAX_CELLS = 16_384
#: Smallest block size a query may ask for (unless the job itself uses a smaller one):
#: the plan holds one entry per block, so block_size=1 costs memory per row.
MIN_BLOCK_SIZE = 256
#: Bytes of one image cell served as is.
MAX_IMAGE_BYTES = 16 << 20
#: Rows a reverse lookup scans before it stops and says the answer is truncated.
WHERE_SCAN_ROWS = 2_000_000
#: Ranks a view may ask for: a reverse lookup places every rank's stream.
MAX_WORLD_SIZE = 65_536
#: Ranks x epochs one reverse lookup places (about two seconds of work).
MAX_RANK_EPOCHS = 262_144
#: Seconds a read of the followed run's checkpoints is reused: a click must not list
#: and read every manifest of every rank again, and new checkpoints still show soon.
HISTORY_TTL_S = 5.0
#: Host names every inspector answers (with any IP address): loopback's.
LOOPBACK_NAMES = frozenset({"localhost"})
#: Bytes of one JSON answer (the last guard; the limits above keep answers far below).
MAX_RESPONSE_BYTES = 16 << 20

InspectorSource = Callable[[], session.Inspector]


#: Where the opening view's batch size came from (`Defaults.batch_size_from`, the
#: page's `info.defaults`): given (`shardcache web --batch-size`), the followed run's
#: data states (`--checkpoint-uri`), or assumed (the default, which the page says, as
#: `shardcache inspect` does: step N is other samples at another batch size).
FROM_FLAG, FROM_RUN, FROM_DEFAULT = "--batch-size", "--checkpoint-uri", session.BATCH_SIZE_ASSUMED
#: The batch size a view opens with when nothing says the run's.
DEFAULT_BATCH_SIZE = 32


@dataclasses.dataclass(frozen=True)
class Defaults:
    """The view the page opens with: the job's plan, as the sidecar was configured."""

    seed: int = 0
    shuffle: bool = True
    block_size: int = plans.DEFAULT_BLOCK_SIZE
    world_size: int = 1
    batch_size: int = DEFAULT_BATCH_SIZE
    granularity: str = plans.BLOCK
    window: int = plans.DEFAULT_WINDOW
    batch_size_from: str = FROM_FLAG

    @classmethod
    def from_plan(cls, params: plans.PlanParams, *, batch_size: int | None = None) -> Defaults:
        """The job's plan; a sidecar never learns the trainer's batch size, so without
        `batch_size` it is assumed (and the page says so)."""
        return cls(
            seed=params.seed,
            shuffle=params.shuffle,
            block_size=params.block_size,
            world_size=params.world_size,
            batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
            granularity=params.granularity,
            window=params.window,
            batch_size_from=FROM_DEFAULT if batch_size is None else FROM_FLAG,
        )


class _UI:
    def __init__(
        self,
        source: InspectorSource,
        defaults: Defaults,
        decode: render.Decode | None,
        checkpoint_uri: str | None = None,
    ) -> None:
        self.source = source
        self.defaults = defaults
        self.decode = decode
        self.checkpoint_uri = checkpoint_uri
        #: The followed run's block size, once its history was read: the run's own
        #: plan is always viewable, even under the inspector's block-size floor.
        self.run_block_size: int | None = None
        #: The same for its sample-shuffle window.
        self.run_window: int | None = None
        self.executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="shardcache-ui")
        self._stats: dict[str, dict[str, Any]] = {}
        self._history_lock = threading.Lock()
        #: (digest, read at, history, checkpoints left out) of the last read.
        self._history: tuple[str, float, History, list[str]] | None = None

    def inspector(self) -> session.Inspector:
        """The inspector, or the host's reason it has none (the sidecar's "starting"),
        which goes to the host app's error middleware as it was raised."""
        try:
            return self.source()
        except errors.ShardcacheError:
            raise
        except Exception as exc:
            raise _NotServing(exc) from exc

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    # --- request parsing ----------------------------------------------------------
    def query(self, request: web.Request, insp: session.Inspector | None = None) -> locate.Query:
        """The view a request asks for; what it leaves out is the opening view's (with
        `insp`, at the followed run's batch size)."""
        q = request.query
        d = self.defaults if insp is None else self.opening_view(insp)
        world_size = _int(q, "world_size", d.world_size)
        if world_size > MAX_WORLD_SIZE:
            raise errors.InputError(
                f"world_size {world_size} is over the inspector's limit of {MAX_WORLD_SIZE} ranks"
            )
        batch_size = _int(q, "batch_size", d.batch_size)
        if batch_size > MAX_BATCH_SIZE:
            raise errors.InputError(
                f"batch_size {batch_size} is over the inspector's limit of {MAX_BATCH_SIZE} "
                "rows per answer: ask for a smaller batch"
            )
        block_size = _int(q, "block_size", d.block_size)
        floor = min(MIN_BLOCK_SIZE, d.block_size, self.run_block_size or MIN_BLOCK_SIZE)
        if block_size < floor:
            raise errors.InputError(
                f"block_size {block_size} is under the inspector's floor of {floor} rows "
                f"(the smallest of the job's block size, the followed run's and "
                f"{MIN_BLOCK_SIZE})"
            )
        granularity = q.get("granularity") or d.granularity
        if granularity not in plans.GRANULARITIES:
            raise errors.InputError(
                f"query parameter 'granularity': expected one of {list(plans.GRANULARITIES)}, "
                f"found {granularity!r}"
            )
        window = _int(q, "window", d.window)
        # A window's permutation is computed per window: a tiny window over a large
        # epoch is a Python step per few rows, as a tiny block is a plan entry per row.
        floor = min(MIN_BLOCK_SIZE, d.window, self.run_window or MIN_BLOCK_SIZE)
        if granularity == plans.SAMPLE and window < floor:
            raise errors.InputError(
                f"window {window} is under the inspector's floor of {floor} rows "
                f"(the smallest of the job's window, the followed run's and "
                f"{MIN_BLOCK_SIZE})"
            )
        return locate.Query(
            epoch=_int(q, "epoch", 0),
            rank=_int(q, "rank", 0),
            world_size=world_size,
            step=_int(q, "step", 0),
            batch_size=batch_size,
            seed=_int(q, "seed", d.seed),
            shuffle=_bool(q, "shuffle", d.shuffle),
            block_size=block_size,
            granularity=granularity,
            window=window,
        )

    # --- handlers -----------------------------------------------------------------
    async def page(self, request: web.Request) -> web.StreamResponse:
        return _file("index.html", "text/html")

    async def static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in _STATIC:
            raise web.HTTPNotFound(text=f"no static file {name!r}")
        return _file(name, _STATIC[name])

    async def info(self, request: web.Request) -> web.StreamResponse:
        def work() -> dict[str, Any]:
            insp = self.inspector()
            return {
                "dataset": session.dataset_json(insp.manifest),
                "columns": [{"name": f.name, "type": str(f.type)} for f in insp.schema],
                "defaults": dataclasses.asdict(self.opening_view(insp)),
                "tokenizer": self.decode is not None,
                "lineage": self.checkpoint_uri is not None,
            }

        return await self._answer(work)

    async def step(self, request: web.Request) -> web.StreamResponse:
        def work() -> dict[str, Any]:
            columns = _names(request.query.get("columns"))
            insp = self.inspector()
            query = self.query(request, insp)
            width = len(insp.columns(columns))
            if query.batch_size * width > MAX_CELLS:
                raise errors.InputError(
                    f"{query.batch_size} rows x {width} columns is over the inspector's limit "
                    f"of {MAX_CELLS} cells per answer: ask for fewer rows or columns"
                )
            notes: list[str] = []
            chosen = _pass(request.query)
            run = self.run_states(insp, query, notes, pass_index=chosen)
            view = insp.step(query, columns, run=run)
            # Each answer its own budget: what it converts to Python is bounded.
            options = dataclasses.replace(PAGE_OPTIONS, budget=render.Budget(MAX_CONVERT_BYTES))
            data = session.step_json(view, insp.manifest, options=options, decode=self.decode)
            if notes:
                data["run_notes"] = notes
            for sample in data["samples"]:
                p = sample["provenance"]
                for name, cell in sample["values"].items():
                    if cell["kind"] == "image":
                        args = {"shard": p["shard_index"], "row": p["row"], "column": name}
                        cell["src"] = f"{PREFIX}/api/image?{urlencode(args)}"
            return data

        return await self._answer(work)

    async def image(self, request: web.Request) -> web.StreamResponse:
        def work() -> tuple[bytes, str]:
            q = request.query
            column = q.get("column", "")
            cell = self.inspector().scalar(_int(q, "shard", 0), _int(q, "row", 0), column)
            binary = isinstance(cell, pa.BinaryScalar) and not isinstance(cell, pa.StringScalar)
            buffer = cell.as_buffer() if binary else None
            if buffer is None:
                raise errors.InputError(f"column {column!r} is not binary: expected an image cell")
            # Measured in place, before a copy: a huge cell costs nothing to refuse.
            if buffer.size > MAX_IMAGE_BYTES:
                raise _TooLarge(
                    f"the cell is {buffer.size} bytes, over the inspector's limit of "
                    f"{MAX_IMAGE_BYTES} bytes per image"
                )
            value = buffer.to_pybytes()
            info = images.sniff(value)
            if info is None:
                raise errors.InputError(
                    f"the cell is {len(value)} bytes that are no image this inspector knows"
                )
            return value, info.mime

        try:
            body, mime = await self.run(work)
        except _NotServing as exc:
            raise exc.reason from None
        except _TooLarge as exc:
            return _error(413, str(exc))
        except errors.InputError as exc:
            return _error(400, str(exc))
        return web.Response(body=body, content_type=mime, headers=_HEADERS)

    async def stats(self, request: web.Request) -> web.StreamResponse:
        def work() -> dict[str, Any]:
            insp = self.inspector()
            key = insp.manifest.digest
            if key not in self._stats:
                self._stats[key] = insp.stats(max_rows=STATS_ROWS, max_bytes=STATS_BYTES)
            return self._stats[key]

        return await self._answer(work)

    async def where(self, request: web.Request) -> web.StreamResponse:
        def work() -> dict[str, Any]:
            expr = request.query.get("expr", "")
            epochs = _int(request.query, "epochs", 1)
            if not 1 <= epochs <= 100:
                raise errors.InputError(f"epochs must be in [1, 100], got {epochs}")
            insp = self.inspector()
            query = self.query(request, insp)
            if query.world_size * epochs > MAX_RANK_EPOCHS:
                raise errors.InputError(
                    f"world_size {query.world_size} x epochs {epochs} is over the inspector's "
                    f"limit of {MAX_RANK_EPOCHS} rank-epochs per lookup: ask for fewer epochs"
                )
            notes: list[str] = []
            result = insp.where(
                expr,
                query,
                epochs=epochs,
                limit=WHERE_LIMIT,
                run=self.run_states(insp, query, notes, pass_index=_pass(request.query)),
                max_rows=WHERE_SCAN_ROWS,
            )
            data = session.where_json(result)
            if notes:
                data["run_notes"] = notes
            return data

        return await self._answer(work)

    async def lineage(self, request: web.Request) -> web.StreamResponse:
        def work() -> dict[str, Any]:
            insp = self.inspector()
            hist = self.history(insp)
            if hist is None:
                raise errors.InputError(
                    "no run to follow: start the inspector with the run's checkpoints "
                    "(shardcache web URI --checkpoint-uri CKPT)"
                )
            if request.query.get("consumed"):
                return queries.consumed(hist, _int(request.query, "consumed", 0))
            expr = request.query.get("expr", "")
            limit = _int(request.query, "limit", WHERE_LIMIT)
            if not 1 <= limit <= LINEAGE_LIMIT:
                raise errors.InputError(f"limit must be in [1, {LINEAGE_LIMIT}], got {limit}")
            scan = insp.scan(expr, limit=limit, max_rows=WHERE_SCAN_ROWS)
            found = queries.reads(hist, scan.indices)
            data = queries.reads_json(hist, expr, scan.indices, scan.truncated, found)
            data.update(stopped=scan.stopped, scanned_rows=scan.scanned, dataset_rows=scan.rows)
            return data

        return await self._answer(work)

    # --- the run's checkpoints ----------------------------------------------------
    def history(self, insp: session.Inspector) -> history.History | None:
        """The run, every checkpoint with its data state (lineage refuses a model-only
        one), read afresh: it publishes checkpoints while the page is open."""
        if self.checkpoint_uri is None:
            return None
        hist = published.history_of(insp.manifest, self.checkpoint_uri)
        self._remember(hist)
        return hist

    def data_history(self, insp: session.Inspector) -> tuple[History, list[str]] | None:
        """The run for the data views: model-only checkpoints left out (and named),
        read at most every `HISTORY_TTL_S` seconds."""
        if self.checkpoint_uri is None:
            return None
        digest = insp.manifest.digest
        with self._history_lock:
            kept = self._history
            if (
                kept is not None
                and kept[0] == digest
                and time.monotonic() - kept[1] < HISTORY_TTL_S
            ):
                return kept[2], kept[3]
        stateless: list[str] = []
        hist = published.history_of(insp.manifest, self.checkpoint_uri, stateless=stateless)
        self._remember(hist)
        with self._history_lock:
            self._history = (digest, time.monotonic(), hist, stateless)
        return hist, stateless

    def _remember(self, hist: History) -> None:
        self.run_block_size = hist.params.block_size
        self.run_window = hist.params.window

    def run_states(
        self,
        insp: session.Inspector,
        query: locate.Query,
        notes: list[str] | None = None,
        *,
        pass_index: int | None = None,
    ) -> locate.States:
        """The followed run's newest data states by rank, of the world size and plan
        `query` views (`run_states`), with pass `pass_index`'s skips of the viewed epoch
        (None: the newest pass's); none without a run or for another plan. What was
        left out, why the run is not followed, or which pass of an epoch read more
        than once is shown, goes to `notes`."""
        try:
            found = self.data_history(insp)
        except errors.InputError as exc:
            # The data views stay usable on the plan; only lineage refuses such a run.
            if notes is not None:
                notes.append(
                    f"the run's checkpoints are not followed ({exc}): steps follow the plan"
                )
            return {}
        if found is None:
            return {}
        hist, stateless = found
        if stateless and notes is not None:
            notes.append(
                f"left out {len(stateless)} checkpoint(s) without a data state (model only): "
                + ", ".join(stateless[:5])
                + (", …" if len(stateless) > 5 else "")
            )
        found_states = run_states(hist, query, pass_index)
        note = hist.pass_note(query.params(), query.epoch, pass_index)
        if note and notes is not None:
            notes.append(note)
        return found_states

    def opening_view(self, insp: session.Inspector) -> Defaults:
        """The view the page opens with: the job's plan, at the followed run's batch
        size when the run read that plan (its step N is a batch of that size)."""
        try:
            found = self.data_history(insp)
        except errors.InputError:
            return self.defaults
        if found is None:
            return self.defaults
        hist = found[0]
        d = self.defaults
        view = locate.Query(
            world_size=d.world_size,
            batch_size=d.batch_size,
            seed=d.seed,
            shuffle=d.shuffle,
            block_size=d.block_size,
            granularity=d.granularity,
            window=d.window,
        )
        sizes = {s.batch_size for s in run_states(hist, view).values() if s.batch_size}
        if len(sizes) != 1:
            return d
        return dataclasses.replace(d, batch_size=sizes.pop(), batch_size_from=FROM_RUN)

    async def _answer(self, work: Callable[[], dict[str, Any]]) -> web.StreamResponse:
        try:
            data = await self.run(work)
        except errors.InputError as exc:
            return _error(400, str(exc))
        except (errors.SourceError, errors.CacheError) as exc:
            return _error(503, str(exc))
        except _NotServing as exc:
            raise exc.reason from None
        except Exception as exc:
            # A bug, not bad input: the page still gets a JSON answer it can show.
            log.exception("the inspector failed to answer")
            return _error(500, f"the inspector failed: {type(exc).__name__}: {exc}")
        text = json.dumps(data)
        if len(text) > MAX_RESPONSE_BYTES:
            return _error(
                413,
                f"the answer is {len(text)} bytes, over the inspector's limit of "
                f"{MAX_RESPONSE_BYTES}: ask for fewer rows or columns",
            )
        return web.Response(text=text, content_type="application/json", headers=_HEADERS)


class _NotServing(Exception):
    """The host's inspector source refused (`reason`): not the inspector's failure."""

    def __init__(self, reason: Exception) -> None:
        super().__init__(str(reason))
        self.reason = reason


class _TooLarge(errors.InputError):
    """A well-formed request whose answer would be over a size limit (HTTP 413)."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=_HEADERS)


def _file(name: str, content_type: str) -> web.Response:
    data = importlib.resources.files(__package__).joinpath("static", name).read_bytes()
    return web.Response(body=data, content_type=content_type, headers=_HEADERS)


def run_states(
    hist: history.History, query: locate.Query, pass_index: int | None = None
) -> locate.States:
    """Each rank's newest data state (its skips, and its segments after an elastic
    resume) in the generation of `hist` whose plan `query` views, so a step is what
    that rank was handed; none when no generation has that plan.

    A run that went back to an earlier world size (4 -> 2 -> 4) has two generations
    of one plan: the view's epoch picks the latest that had started by then
    (`History.newest_states`, which `shardcache inspect --checkpoint-uri` reads too).

    An epoch the run read more than once: the skips of that epoch are pass
    `pass_index`'s (the run's, 0 the first; None the newest), so a step of an earlier
    pass is what was handed then; a pass the run did not make is refused (HTTP 400)."""
    return hist.newest_states(query.params(), query.epoch, pass_index)


def _pass(query: Any) -> int | None:
    """The `pass` query parameter (counted from 1, as `shardcache inspect --pass`) as
    the run's pass index; None (the newest pass) when absent or empty."""
    text = query.get("pass")
    if text is None or text == "":
        return None
    number = _int(query, "pass", 0)
    if number < 1:
        raise errors.InputError(
            f"query parameter 'pass': counts from 1, expected >= 1, found {number}"
        )
    return number - 1


def _int(query: Any, name: str, default: int) -> int:
    text = query.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise errors.InputError(
            f"query parameter {name!r}: expected an integer, found {text!r}"
        ) from None


def _bool(query: Any, name: str, default: bool) -> bool:
    text = query.get(name)
    if text is None or text == "":
        return default
    if text in ("1", "true", "on"):
        return True
    if text in ("0", "false", "off"):
        return False
    raise errors.InputError(f"query parameter {name!r}: expected true or false, found {text!r}")


def _names(text: str | None) -> list[str] | None:
    if not text:
        return None
    return [c for c in text.split(",") if c]


def host_allowed(host: str | None, extra: Iterable[str] = ()) -> bool:
    """Whether a request's `Host` header names this inspector: a loopback name, an IP
    address (a rebound page sends its own name, never an address), or one of `extra`
    (the names it was started for). No header (HTTP/1.0) is no browser's request."""
    if not host:
        return True
    try:
        name = urlsplit("//" + host).hostname
    except ValueError:
        return False
    if not name:
        return False
    name = name.rstrip(".")
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return name in {_bare(h) for h in extra}


def allowed_hosts(extra: Iterable[str] = ()) -> list[str]:
    """What `host_allowed` takes, in words, for the 403 that refuses a Host: the one
    list, so the message never disagrees with the check."""
    return [*sorted(LOOPBACK_NAMES), "*.localhost", "an IP address", *extra]


def _bare(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()


def _host_guard(extra: Iterable[str]) -> Callable[..., Awaitable[web.StreamResponse]]:
    hosts = tuple(extra)
    expected = ", ".join(allowed_hosts(hosts))

    @web.middleware
    async def guard(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        host = request.headers.get("Host")
        if not host_allowed(host, hosts):
            return _error(
                403,
                f"Host {host!r} is not a name this inspector serves: expected "
                f"{expected} (a guard against DNS rebinding; start it with "
                "--host NAME to serve a name)",
            )
        return await handler(request)

    return guard


def mount(
    app: web.Application,
    source: InspectorSource,
    defaults: Defaults,
    *,
    decode: render.Decode | None = None,
    checkpoint_uri: str | None = None,
    hosts: Iterable[str] = (),
) -> None:
    """Add the inspector's GET routes under /ui to `app`; with `checkpoint_uri` (where a
    run publishes its checkpoints) the lineage view follows that run.

    Also guards all of `app` (the inspector's own app) against DNS rebinding: a request
    whose Host is not loopback's, an IP address or one of `hosts` gets a 403."""
    app.middlewares.insert(0, _host_guard(hosts))
    ui = _UI(source, defaults, decode, checkpoint_uri)
    app.add_routes(
        [
            web.get(PREFIX, ui.page),
            web.get(PREFIX + "/", ui.page),
            web.get(PREFIX + "/static/{name}", ui.static),
            web.get(PREFIX + "/api/info", ui.info),
            web.get(PREFIX + "/api/step", ui.step),
            web.get(PREFIX + "/api/image", ui.image),
            web.get(PREFIX + "/api/stats", ui.stats),
            web.get(PREFIX + "/api/where", ui.where),
            web.get(PREFIX + "/api/lineage", ui.lineage),
        ]
    )

    async def stop_executor(_: web.Application) -> None:
        ui.executor.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_executor)


class NodeInspector:
    """An inspector over the sidecar's own cache node, made when the node is up.

    `serving` is the sidecar's accessor: it returns the node, or raises why data is not
    served yet (the sidecar's error middleware answers that)."""

    def __init__(self, serving: Callable[[], Any]) -> None:
        self._serving = serving
        self._lock = threading.Lock()
        self._made: tuple[Any, session.Inspector] | None = None

    def __call__(self) -> session.Inspector:
        from shardcache import embedded

        node = self._serving()
        # Called from the UI's executor threads: one inspector per node.
        with self._lock:
            if self._made is None or self._made[0] is not node:
                rows = session.ProviderRows(embedded.EmbeddedProvider(node), owns=False)
                self._made = (node, session.Inspector(rows))
            return self._made[1]
