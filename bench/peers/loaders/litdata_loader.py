"""LitData over the `litdata.optimize` conversion, read from a local directory.

Settings: `StreamingDataset(input_dir=local dir, shuffle=True)` with the library's
defaults for everything else (`batch_decode="auto"`, which decodes 256 text items at
a time, and the default in-chunk shuffle window). The version check that calls out to
the package index on every dataset is switched off (LITDATA_DISABLE_VERSION_CHECK=1, set
by the runner) so it is not timed. Two ways to drive it: iterate the dataset in the loop
process ("litdata"), or through `litdata.StreamingDataLoader` with workers
("litdata-dataloader"). Both resume with the library's own state dicts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from bench.peers.loaders import base, ragged


def _dataset(setup: base.Setup) -> Any:
    import litdata

    return litdata.StreamingDataset(
        input_dir=str(setup.root / "litdata"),
        cache_dir=str(setup.scratch / "litdata-cache"),
        shuffle=True,
        seed=setup.seed,
    )


class LitdataLoader:
    kind: base.Kind = "sample"

    def __init__(self, setup: base.Setup) -> None:
        import litdata  # noqa: F401 - imported before the clock starts, as a trainer has it

        self._setup = setup
        self._ds: Any = None
        self.settings = (
            "litdata.StreamingDataset(input_dir=local dir, shuffle=True, batch_decode='auto'); "
            "iterated in the loop process"
        )

    def epoch(self, epoch: int) -> Iterator[Any]:
        if self._ds is None:
            self._ds = _dataset(self._setup)
        self._ds.set_epoch(epoch + 1)  # litdata counts epochs from 1
        yield from self._ds

    def state(self, consumed: int) -> Any | None:
        return self._ds.state_dict(num_samples_yielded=consumed, num_workers=1, batch_size=1)

    def resume(self, state: Any) -> Iterator[Any]:
        self._ds = _dataset(self._setup)
        self._ds.load_state_dict(state)
        yield from self._ds

    def close(self) -> None:
        pass


class LitdataDataLoader:
    kind: base.Kind = "arrays"

    def __init__(self, setup: base.Setup) -> None:
        import litdata  # noqa: F401 - imported before the clock starts, as a trainer has it

        self._setup = setup
        self._loader: Any = None
        self.settings = (
            f"litdata.StreamingDataLoader(StreamingDataset(as above), batch_size="
            f"{setup.batch_size}, num_workers={setup.workers}, collate_fn=ragged concat)"
        )

    def _make_loader(self) -> Any:
        import litdata

        return litdata.StreamingDataLoader(
            _dataset(self._setup),
            batch_size=self._setup.batch_size,
            num_workers=self._setup.workers,
            collate_fn=ragged.collate,
        )

    def epoch(self, epoch: int) -> Iterator[Any]:
        if self._loader is None:
            self._loader = self._make_loader()
        yield from ragged.as_arrays(self._loader)

    def state(self, consumed: int) -> Any | None:
        return self._loader.state_dict()

    def resume(self, state: Any) -> Iterator[Any]:
        self._loader = self._make_loader()
        self._loader.load_state_dict(state)
        yield from ragged.as_arrays(self._loader)

    def close(self) -> None:
        pass
