"""Which entries a sole-writer tier holds, answered from memory (`Tier(sole_writer=True)`).

Why: the sidecar asks the memory tier "is shard X resident?" on its event loop, for
every shard ahead of a reader at every request and for every shard of an epoch when a
reader enters it. Each answer was two `stat` calls, and every system call lets go of
the GIL: with a fetch thread or the thread pool wanting it, the loop waited up to the
switch interval (CPython's 5 ms then; the sidecar sets 0.5 ms since) to take it back.
On the 16-core machine the loop was held 8-12 ms at a time inside exactly these stats
(docs/benchmarks.md, "16 cores, run D").

Why it stays exact. The set changes where the files change, in this process, under the
tier-wide lock `.tier.lock` held exclusively: a commit adds its key after the meta
file's rename (the commit point); an eviction (`_remove_unleased`) and the removal of a
bad entry (`_discard`) discard it when the meta file goes. Those are the only ways an
entry of a tier directory appears or disappears (docs/cache-format.md), so while this
object is the only one that commits or removes entries, the set is the directory's
committed entries at every moment the tier lock is free. Who else could remove one?

* Trainers only lease and read the memory tier's files (`shardcache.node.leases.pin`
  takes a shared flock and maps the file; `mark_used` touches its time); they never
  unlink or rename an entry.
* The memory tier is the pod's own volume (an emptyDir per pod: the webhook,
  `shardcache_operator.pod_volumes`), written by the one sidecar of that pod; mixtures
  give each source its own directory. Embedded mode (`shardcache.open` in the trainer)
  does not declare itself the sole writer: several processes may share a cache dir.
* A sidecar restart is a new process: it builds the set from a listing when its tier
  is made, after the old process is gone (the kubelet starts a container again only
  once it has exited). A start-up `scan` rebuilds it from what it keeps.

If the promise is broken anyway (a second process evicting in the same directory), the
answers stay safe, only slower: a lookup still takes the lease and stats the meta and
data files for a key it believes committed, so an entry removed behind our back is a
miss, never a wrong hit; that miss checks the files under the tier lock and forgets the
key (`lost`), so the caller's next `contains` is false and the shard is made again.
(`Tier.hold` stats the data file of a key it holds in memory, and falls back to that
lookup when it is gone or of another size; such a second writer does not see those
holds, so it may evict a held entry: the trainer's pin then fails its check and the
client asks again, as for any entry gone before it pinned it.)
An entry committed by another process is not seen until this one commits it too
(the same bytes: keys are content identities): a wasted decode, never a wrong answer.
And every listing made under the tier lock (`Tier.resident_bytes`, `used_bytes`: each
metrics scrape, the fill's top-up) is the committed entries exactly, so the set takes
it: whatever another writer changed is seen there at the latest.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from shardcache.node import _locks
from shardcache.node.tiers import _directory


class Membership:
    """The committed keys of a tier whose only writer is this object's tier."""

    def __init__(self, files: _directory.Directory) -> None:
        self._files = files
        with files.tier_locked(_locks.SHARED):
            #: Read without a lock (a set lookup is atomic under the GIL); changed only
            #: while `.tier.lock` is held exclusively, or by `lost` under it shared.
            self.keys: set[str] = set(files.listing().committed())
        #: Counts the changes that took a key out of the set: while it stays the same,
        #: every key the set had is still in it (`CacheNode`'s warm epoch start checks
        #: every shard of the manifest once, not at every reader's epoch start).
        self.removals = 0
        # `lost` runs under the tier lock held shared, by any thread: the count must
        # never go back, so its changes are serialised here.
        self._counting = threading.Lock()

    def discard(self, key: str) -> None:
        """`key`'s entry is gone: call with the tier lock held exclusively."""
        if key in self.keys:
            self.keys.discard(key)
            self._removed()

    def replace(self, keys: Iterable[str]) -> None:
        """The committed keys are `keys`, from a listing under the tier lock."""
        listed = set(keys)
        if not self.keys <= listed:
            self._removed()
        self.keys = listed

    def lost(self, key: str) -> None:
        """A lookup missed `key` although the set has it: forget it if its files are
        gone. Under the tier lock, so a commit of the key by another thread of this
        process is either wholly before (kept) or wholly after (it adds it again)."""
        with self._files.tier_locked(_locks.SHARED):
            if not self._files.committed(key):
                self.discard(key)

    def _removed(self) -> None:
        with self._counting:
            self.removals += 1
