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

from aiohttp import web

from shardcache import errors
from shardcache.inspect import cli, render, session
from shardcache_sidecar.ui import routes

#: One above the sidecar's metrics port, so a local sidecar and this can run together.
DEFAULT_PORT = 8471


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
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any)"
    )
    p.add_argument("--tokenizer", help="a HuggingFace tokenizer.json to decode token ids")
    p.add_argument(
        "--checkpoint-uri",
        help="where a run publishes its checkpoints: adds the lineage view, and steps "
        "honour the run's skips",
    )
    cli.add_plan_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        defaults = routes.Defaults(
            seed=args.seed,
            shuffle=args.shuffle,
            block_size=args.block_size,
            world_size=args.world_size,
            batch_size=args.batch_size,
            granularity=args.granularity,
            window=args.window,
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
    routes.mount(app, lambda: inspector, defaults, decode=decode, checkpoint_uri=checkpoint_uri)
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
