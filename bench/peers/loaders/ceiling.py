"""The ceiling: the loop's own work over batches already in memory, with no loader.

All Parquet files are decoded into memory before the clock starts, cut into batches of
the common batch size, and each epoch hands those batches to the loop in a shuffled
order. What remains is exactly the per-batch work every loader's loop does (touching
every token and folding the checksum), so no loader can deliver faster than this row;
a goal ratio above ceiling ÷ peer cannot be met by any loader on this machine.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from bench.peers import dataset
from bench.peers.loaders import base


class CeilingLoader:
    kind: base.Kind = "arrow"

    def __init__(self, setup: base.Setup) -> None:
        self._setup = setup
        spec = dataset.load_spec(setup.root)
        assert spec is not None
        tables = [pq.read_table(p) for p in dataset.parquet_files(setup.root, spec)]
        table = pa.concat_tables(tables).combine_chunks()
        self._batches = table.to_batches(max_chunksize=setup.batch_size)
        self.settings = (
            f"all rows decoded into memory before timing, batches of {setup.batch_size} in "
            "shuffled order: the loop's own work only"
        )

    def epoch(self, epoch: int) -> Iterator[Any]:
        order = list(range(len(self._batches)))
        random.Random(epoch).shuffle(order)
        for i in order:
            yield self._batches[i]

    def state(self, consumed: int) -> Any | None:
        return None

    def resume(self, state: Any) -> Iterator[Any]:
        raise NotImplementedError("the ceiling has no state")

    def close(self) -> None:
        self._batches = []
