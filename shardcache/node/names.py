"""Names of the node cache's own files (docs/cache-format.md), defined once.

Only the cache tiers (`shardcache.node`) create and read these; what crosses a process
boundary between the webhook, the sidecar and the trainer is `shardcache.contract`.
"""

from __future__ import annotations

LOCK_SUFFIX = ".lock"
META_SUFFIX = ".meta.json"
TMP_PREFIX = ".tmp-"
#: The tier-wide lock: held exclusively while counting, evicting, reserving and committing.
TIER_LOCK_NAME = ".tier.lock"
#: Per-key lock held exclusively by the one process producing that key in get_or_insert.
FILL_LOCK_SUFFIX = ".fill.lock"
