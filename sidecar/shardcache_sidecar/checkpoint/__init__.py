"""The sidecar's checkpoint agent: restore before the trainer starts, upload without stalling it.

The trainer commits a directory in the shared checkpoint volume (`shardcache.checkpoint`,
or a marker file); the agent uploads it to the checkpoint URI, writes its manifest last
and moves the `latest` pointer; retention keeps the last N. The bucket layout is
specified in docs/checkpoints.md.

    agent.py      the loop: restore at start, then scan for commits and publish them,
                  and restore the older published steps the trainer requests
    uploader.py   one directory -> objects in parallel, sha256 each, manifest last
    restorer.py   manifest -> verified files in the volume, reusing intact local copies
    retention.py  keep the last N, move the pointer forward
    layout.py     object names, the manifest and pointer formats (versioned)
    nofollow.py   files of the volume opened without following the trainer's links
    agent_config.py  typed settings from the environment (contract rows)
    metrics.py    Prometheus series and the hooks the transfer code calls

Run it alone (laptops, tests) with `python -m shardcache_sidecar.checkpoint`.
"""

from __future__ import annotations

from shardcache.checkpoint.layout import CorruptCheckpointError, DuplicateStepError
from shardcache_sidecar.checkpoint.agent import Agent
from shardcache_sidecar.checkpoint.agent_config import CheckpointSettings
from shardcache_sidecar.checkpoint.metrics import Metrics

__all__ = ["Agent", "CheckpointSettings", "CorruptCheckpointError", "DuplicateStepError", "Metrics"]
