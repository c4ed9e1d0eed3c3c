"""`python -m shardcache_sidecar.checkpoint`: the checkpoint agent alone, configured by env.

For laptops and tests: the agent the sidecar runs, without the data path. It restores,
prints `ready` (or the restore error) on stdout, publishes commits until SIGTERM or
SIGINT, then publishes what is still committed and exits: 0 when everything committed
went up, 1 when the drain ran past `$SHARDCACHE_CHECKPOINT_DRAIN_SECONDS` (an upload
stuck on a store that does not answer), after logging each step it did not upload.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from shardcache import contract, errors
from shardcache_sidecar.checkpoint import agent, agent_config


def main() -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = agent_config.CheckpointSettings.from_env()
    except errors.InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if settings is None:
        print(
            f"error: set {contract.ENV_CHECKPOINT_URI} and {contract.ENV_CHECKPOINT_DIR}",
            file=sys.stderr,
        )
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    running = agent.Agent(settings)
    running.start()
    while not stop.is_set():
        if running.wait_ready(0.1):
            print("ready", flush=True)
            break
        ready, why = running.readiness()
        if not ready and why.startswith("checkpoint restore failed"):
            print(why, flush=True)
            break
    stop.wait()
    if running.drain():
        return 0
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # The drain thread is still inside the store's client: a normal exit would wait on
    # it in the interpreter's shutdown (pyarrow's S3 finalizer), which is the hang the
    # bound is for. The markers stay, so the next agent uploads those steps.
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
