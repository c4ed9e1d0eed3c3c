"""`shardcache web URI`: the web inspector on this machine, no cluster needed.

Reads the dataset through the embedded cache (as `shardcache.open(URI)` does) and
serves the same /ui the sidecar serves on its metrics port. Binds 127.0.0.1 unless told
otherwise: the page shows data, so exposing it is a decision for the user.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from aiohttp import web

from shardcache import errors
from shardcache.contract import parsers
from shardcache.inspect import cli, render, session
from shardcache.lineage import published
from shardcache_sidecar.ui import routes

#: One above the sidecar's metrics port, so a local sidecar and this can run together.
DEFAULT_PORT = 8471
_PORT = parsers.integer(minimum=0, maximum=65535)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "web",
        help="serve the web inspector for a dataset URI locally",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("uri", help="dataset URI (file://, s3://, ...)")
    p.add_argument("--cache-dir", help="embedded cache directory (default ~/.cache/shardcache)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=_PORT.flag_type,
        default=DEFAULT_PORT,
        help=f"port (default {DEFAULT_PORT}; 0: any)",
    )
    p.add_argument("--tokenizer", help="a HuggingFace tokenizer.json to decode token ids")
    p.add_argument(
        "--checkpoint-uri",
        type=published.uri_argument,
        help="where a run publishes its checkpoints: adds the lineage view, and steps "
        "honour the run's skips",
    )
    # No default: the page says when the batch size is assumed (`routes.FROM_DEFAULT`).
    cli.add_plan_arguments(p, batch_size=None, recorded_by="--checkpoint-uri")
    p.set_defaults(func=run)


def _check_plan_arguments(args: argparse.Namespace) -> None:
    """The plan options every page would otherwise refuse, request after request."""
    for flag in ("--batch-size", "--world-size", "--block-size", "--window"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            raise errors.InputError(f"{flag} must be >= 1, got {value}")


def _make_cache_dir(cache_dir: str | None) -> None:
    if cache_dir is None:
        return  # the default, which the embedded cache creates
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise errors.InputError(
            f"--cache-dir {cache_dir}: cannot create it: {exc.strerror or exc}"
        ) from exc


def run(args: argparse.Namespace) -> int:
    try:
        _check_plan_arguments(args)
        _make_cache_dir(args.cache_dir)
        defaults = routes.Defaults(
            seed=args.seed,
            shuffle=args.shuffle,
            block_size=args.block_size,
            world_size=args.world_size,
            batch_size=routes.DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size,
            granularity=args.granularity,
            window=args.window,
            batch_size_from=routes.FROM_DEFAULT if args.batch_size is None else routes.FROM_FLAG,
        )
        decode = render.load_tokenizer(args.tokenizer) if args.tokenizer else None
        inspector = session.open_uri(args.uri, cache_dir=args.cache_dir)
    except errors.ShardcacheError as exc:
        print(f"shardcache web: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(inspector, defaults, decode, args.host, args.port, args.checkpoint_uri))
    except OSError as exc:
        print(f"shardcache web: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    finally:
        inspector.close()
    return 0


async def _serve(
    inspector: session.Inspector,
    defaults: routes.Defaults,
    decode: render.Decode | None,
    host: str,
    port: int,
    checkpoint_uri: str | None = None,
) -> None:
    app = web.Application()
    # The name it was started for is a Host it answers (routes.host_allowed).
    routes.mount(
        app, lambda: inspector, defaults, decode=decode, checkpoint_uri=checkpoint_uri, hosts=[host]
    )
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        # Tests and scripts read this line to learn the port (with --port 0).
        print(
            f"serving the inspector at http://{bound_host}:{bound_port}{routes.PREFIX}", flush=True
        )
        await stop.wait()
    finally:
        await runner.cleanup()
