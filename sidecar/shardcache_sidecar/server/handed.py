"""The shards handed to each reader with `reuse`, for readers that opted into
`skip_handed` (docs/wire-format.md, "Grants ahead of shards handed before").

Such a client pins an entry it was handed with `reuse` again by itself when its reader
gets to that shard (the warm fast path), so a grant ahead of it costs the sidecar a
lookup, a hold, an answer entry and the hold's release in the next `notes`, for a pin
the client would have made anyway. Leaving such shards out of the grants is safe
whatever happened since: a client that forgot the entry (it was evicted and its pin
failed) acquires the shard, which hands it over again.

One byte per manifest shard and opted-in reader: a set of ints costs more per shard,
and a lookup here is on every grant's path. Not thread-safe: the event loop's only.
"""

from __future__ import annotations


class Handed:
    """Per reader: which shards were handed to it with `reuse`."""

    def __init__(self) -> None:
        self._by_reader: dict[str, bytearray] = {}

    def opt_in(self, reader_id: str, shards: int) -> None:
        """The reader's client pins handed entries again itself (`skip_handed`). A
        reader registered again keeps what it was handed (the same manifest)."""
        marks = self._by_reader.get(reader_id)
        if marks is None or len(marks) != shards:
            self._by_reader[reader_id] = bytearray(shards)

    def forget(self, reader_id: str) -> None:
        """The reader is gone, or registered again without opting in."""
        self._by_reader.pop(reader_id, None)

    def of(self, reader_id: str) -> bytearray | None:
        """The reader's marks (a nonzero byte per shard handed), None if it did not
        opt in: then every grant is made."""
        return self._by_reader.get(reader_id)

    def mark(self, reader_id: str, shard: int) -> None:
        marks = self._by_reader.get(reader_id)
        if marks is not None and 0 <= shard < len(marks):
            marks[shard] = 1

    def __len__(self) -> int:
        return len(self._by_reader)
