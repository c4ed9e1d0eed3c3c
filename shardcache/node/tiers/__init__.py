"""A storage tier: a byte-limited, LRU, checksummed directory of immutable files.

The disk tier (source bytes, shared by every sidecar on the node) and the memory tier
(decoded Arrow IPC on a memory-backed volume, memory-mapped by trainers) are both a
`Tier`. Several processes may use one directory at once; everything that must agree
between them is on disk and guarded by flock (see `_locks`), never in process memory:

* an entry is a data file `<key>` plus a meta file `<key>.meta.json` (size, sha256,
  format version); it is visible once its meta file is renamed into place. A tier with
  `hashed=False` (the memory tier, which never verifies) writes a null sha256;
* a lease is a shared flock on `<key>.lock`, held by `Entry` until released; eviction
  needs an exclusive flock on it, so a leased entry is never evicted, and a dead
  process's leases vanish with it. (A sole writer, the only process that evicts in its
  directory, may hold its own entries in memory instead: `Tier.hold`.);
* an insert first reserves its bytes as a temp file `.tmp-<pid>-<token>-<size>-<key>`,
  under the tier-wide lock `.tier.lock` that also guards counting and evicting, so the
  total of entries plus reservations never exceeds the limit (the largest limit of
  the processes inserting there, each declared in `.limits/`);
* least recently used is the data file's mtime, which a lookup touches;
* every file is opened without following a link or waiting on a FIFO, and only a
  regular file is used (`shardcache.node.regular_files`): anything else at a tier
  file's name is removed as a bad entry.

The format is specified in docs/cache-format.md; `FORMAT_VERSION` is its version.
The modules, by what they hold:

* `_entries`: an entry's key, meta file and checksum, and `Entry`, the lease on one;
* `_errors`: what an insert raises when an entry does not fit;
* `_directory`: the tier's files by name, the directory listing, reservations;
* `_eviction`: which entries make room, least recently used first;
* `_no_space`: a volume full below the limit (ENOSPC): what holds the room, and when
  evicting more would free nothing; a limit clamped to its volume's size
  (`limit_within`, `volume_under`), said at the level `clamp_level` gives;
* `_membership`: a sole writer's committed keys, kept in memory (`Tier(sole_writer=True)`);
* `_tier`: `Tier`, which does lookups, inserts, eviction and start-up repair with them;
* `_access`: whether this process may use a tier directory at all (`unusable`), tried
  up front rather than found out by the first insert;
* `_other_users`: files of another user this process may not open or remove (a
  sidecar's user changed), handled as files in the way rather than raised;
* `_limits`: the limits of the processes inserting into a directory, the largest of
  which every insert counts against;
* `_retire`: a whole tier directory taken out of use (renamed aside under its tier
  lock while no process holds a lock in it), for the node-cache DaemonSet's reclaim.
"""

from __future__ import annotations

from shardcache.node._locks import LockTimeout
from shardcache.node.names import FILL_LOCK_SUFFIX, TIER_LOCK_NAME
from shardcache.node.tiers._access import Owner, Unusable, unusable
from shardcache.node.tiers._entries import (
    FORMAT_VERSION,
    Entry,
    EntryMeta,
    check_key,
    mark_used,
    read_meta,
    sha256_file,
)
from shardcache.node.tiers._errors import (
    EntryTooLargeError,
    IncompatibleFormatError,
    RoomHeldError,
    TierFullError,
)
from shardcache.node.tiers._no_space import (
    Volume,
    clamp_level,
    limit_within,
    needed,
    volume,
    volume_under,
)
from shardcache.node.tiers._other_users import Unremovable
from shardcache.node.tiers._retire import move_aside_unused
from shardcache.node.tiers._tier import LOCK_TIMEOUT_S, ScanReport, Tier, TierObserver

__all__ = [
    "FILL_LOCK_SUFFIX",
    "FORMAT_VERSION",
    "LOCK_TIMEOUT_S",
    "TIER_LOCK_NAME",
    "Entry",
    "EntryMeta",
    "EntryTooLargeError",
    "IncompatibleFormatError",
    "LockTimeout",
    "Owner",
    "RoomHeldError",
    "ScanReport",
    "Tier",
    "TierFullError",
    "TierObserver",
    "Unremovable",
    "Unusable",
    "Volume",
    "check_key",
    "clamp_level",
    "limit_within",
    "mark_used",
    "move_aside_unused",
    "needed",
    "read_meta",
    "sha256_file",
    "unusable",
    "volume",
    "volume_under",
]
