"""What a tier raises when an entry does not fit, or was written in another format."""

from __future__ import annotations

from shardcache import errors


class TierFullError(errors.CacheError):
    """An insert with evict=False found no free room (readahead backs off on this)."""


class EntryTooLargeError(errors.CacheError):
    """An entry is bigger than the whole tier: no eviction or wait can ever make room."""

    def __init__(self, message: str, *, size: int, limit: int) -> None:
        super().__init__(message)
        self.size, self.limit = size, limit

    def about(self, what: str) -> EntryTooLargeError:
        """The same error, its message prefixed with what the entry is (e.g. a shard)."""
        return EntryTooLargeError(f"{what}: {self}", size=self.size, limit=self.limit)


class RoomHeldError(TierFullError):
    """An entry does not fit beside the entries its caller holds leases on (`held`).

    Raised at once rather than after `wait_timeout`: only the caller could free that
    room, and it said it will not while it waits.
    """

    def __init__(self, message: str, *, size: int, held: int, limit: int) -> None:
        super().__init__(message)
        self.size, self.held, self.limit = size, held, limit

    def about(self, what: str) -> RoomHeldError:
        """The same error, its message prefixed with what the entry is (e.g. a shard)."""
        return RoomHeldError(f"{what}: {self}", size=self.size, held=self.held, limit=self.limit)


class IncompatibleFormatError(errors.CacheError):
    """A meta file was written in another format version than this code reads."""
