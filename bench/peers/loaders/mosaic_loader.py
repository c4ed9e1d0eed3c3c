"""MosaicML Streaming over the MDS conversion, read from a local directory.

Settings (the documented fast path for data already on local disk): `local=` the MDS
directory with no `remote`, uncompressed shards, `shuffle=True` with the default
`py1e` algorithm, `batch_size` given so the shuffle and resume are batch-aware.
Two ways to drive it: iterate the StreamingDataset in the loop process ("mosaic"), or
through `streaming.StreamingDataLoader` with worker processes ("mosaic-dataloader").
Both resume with the library's own `state_dict()` / `load_state_dict()`.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

from bench.peers.loaders import base, ragged


def _dataset(setup: base.Setup) -> Any:
    import streaming

    return streaming.StreamingDataset(
        local=str(setup.root / "mds"),
        shuffle=True,
        shuffle_seed=setup.seed + 1,
        batch_size=setup.batch_size,
    )


def _clean_shared_memory() -> None:
    # A previous run that died leaves named shared memory behind, and a new dataset on
    # the same local directory refuses to start while it exists.
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()


class MosaicLoader:
    kind: base.Kind = "sample"

    def __init__(self, setup: base.Setup) -> None:
        import streaming  # noqa: F401 - imported before the clock starts, as a trainer has it

        _clean_shared_memory()
        self._setup = setup
        self._ds: Any = None
        self.settings = (
            "streaming.StreamingDataset(local=mds_dir, remote=None, shuffle=True, "
            f"shuffle_algo='py1e', batch_size={setup.batch_size}); iterated in the loop process"
        )

    def epoch(self, epoch: int) -> Iterator[Any]:
        # The dataset counts epochs itself: each new iteration is the next epoch.
        if self._ds is None:
            self._ds = _dataset(self._setup)
        yield from self._ds

    def state(self, consumed: int) -> Any | None:
        return self._ds.state_dict(num_samples=consumed, from_beginning=False)

    def resume(self, state: Any) -> Iterator[Any]:
        self._replace()
        self._ds.load_state_dict(state)
        yield from self._ds

    def _replace(self) -> None:
        # Only one StreamingDataset may own a local directory at a time in a process.
        self._ds = None
        gc.collect()
        self._ds = _dataset(self._setup)

    def close(self) -> None:
        self._ds = None
        gc.collect()


class MosaicDataLoader:
    kind: base.Kind = "arrays"

    def __init__(self, setup: base.Setup) -> None:
        import streaming  # noqa: F401 - imported before the clock starts, as a trainer has it

        _clean_shared_memory()
        self._setup = setup
        self._loader: Any = None
        self.settings = (
            f"streaming.StreamingDataLoader(StreamingDataset(as above), batch_size="
            f"{setup.batch_size}, num_workers={setup.workers}, persistent_workers=True, "
            "collate_fn=ragged concat)"
        )

    def _make_loader(self) -> Any:
        import streaming

        workers = self._setup.workers
        return streaming.StreamingDataLoader(
            _dataset(self._setup),
            batch_size=self._setup.batch_size,
            num_workers=workers,
            collate_fn=ragged.collate,
            persistent_workers=workers > 0,
        )

    def epoch(self, epoch: int) -> Iterator[Any]:
        if self._loader is None:
            self._loader = self._make_loader()
        yield from ragged.as_arrays(self._loader)

    def state(self, consumed: int) -> Any | None:
        return self._loader.state_dict()

    def resume(self, state: Any) -> Iterator[Any]:
        self._loader = None  # its workers and shared memory go before the new one starts
        gc.collect()
        self._loader = self._make_loader()
        self._loader.load_state_dict(state)
        yield from ragged.as_arrays(self._loader)

    def close(self) -> None:
        self._loader = None
        gc.collect()
