"""The interface every loader adapter implements, and what it is given."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Protocol

#: How a loader delivers samples to the loop (see `tallies.Tally.add_*`):
#: "arrow" - pyarrow RecordBatches; "sample" - {uid, tokens} dicts one by one;
#: "arrays" - (uids, flat token ids, offsets) tensors or arrays per batch.
Kind = Literal["arrow", "sample", "arrays"]


@dataclasses.dataclass(frozen=True)
class Setup:
    #: The benchmark's work directory: parquet/, mds/, litdata/, arrow/ under it.
    root: Path
    #: A fresh directory for this loader's caches (removed by the harness afterwards).
    scratch: Path
    #: A fresh directory on a memory-backed filesystem, for memory tiers.
    shm_scratch: Path
    #: Rows per batch handed to the loop; the same for every loader.
    batch_size: int
    #: DataLoader worker processes, for the loaders that use them.
    workers: int
    seed: int = 0


class Loader(Protocol):
    kind: Kind
    #: One line on the settings used, for the docs.
    settings: str

    def epoch(self, epoch: int) -> Iterator[Any]:
        """Everything the loop gets in one epoch (a generator; closing it stops it)."""
        ...

    def state(self, consumed: int) -> Any | None:
        """Saved state after `consumed` samples of the current epoch were handed to the
        loop, or None when the loader cannot resume mid-epoch."""
        ...

    def resume(self, state: Any) -> Iterator[Any]:
        """A new loader instance (what a restarted trainer makes) resumed from `state`,
        delivering the rest of that epoch."""
        ...

    def close(self) -> None: ...
