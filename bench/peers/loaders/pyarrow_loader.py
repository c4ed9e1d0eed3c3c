"""Plain pyarrow: `ParquetFile.iter_batches` over the Parquet files, file order shuffled.

Row order inside a file cannot be shuffled by this reader; the file order is shuffled
per epoch, which is what people do with it. There is no saved-state API, so resume is
not measured.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pyarrow.parquet as pq

from bench.peers import dataset
from bench.peers.loaders import base


class PyarrowLoader:
    kind: base.Kind = "arrow"

    def __init__(self, setup: base.Setup) -> None:
        self._setup = setup
        spec = dataset.load_spec(setup.root)
        assert spec is not None
        self._files = dataset.parquet_files(setup.root, spec)
        self.settings = (
            f"ParquetFile(pre_buffer=True).iter_batches(batch_size={setup.batch_size}, "
            "use_threads=True), file order shuffled per epoch"
        )

    def epoch(self, epoch: int) -> Iterator[Any]:
        files = list(self._files)
        random.Random(self._setup.seed * 1000 + epoch).shuffle(files)
        for path in files:
            with pq.ParquetFile(path, pre_buffer=True) as f:
                yield from f.iter_batches(batch_size=self._setup.batch_size, use_threads=True)

    def state(self, consumed: int) -> Any | None:
        return None

    def resume(self, state: Any) -> Iterator[Any]:
        raise NotImplementedError("pyarrow has no saved-state API")

    def close(self) -> None:
        pass
