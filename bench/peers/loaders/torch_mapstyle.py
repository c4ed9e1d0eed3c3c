"""A torch DataLoader over a map-style dataset: the do-it-yourself baseline.

The dataset memory-maps one uncompressed Arrow IPC file (the layout Hugging Face
`datasets` uses) lazily in each worker, keeps zero-copy numpy views of each record
batch's uid, offsets and token ids, and implements `__getitems__`, which the
DataLoader's fetcher calls with a whole batch of indices (one call per batch instead of
one per sample, the documented fast path since torch 2.2). Settings: `shuffle=True`
(RandomSampler), `batch_size` as for every loader, `num_workers` = the cores,
`persistent_workers=True`, `collate_fn` passing the already-batched tensors through.
torch's DataLoader has no saved state, so resume is not measured.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from bench.peers.loaders import base, ragged


class ArrowTokens:
    """Map-style dataset: sample i -> {uid, tokens}; a batch of indices -> tensors."""

    def __init__(self, path: Path) -> None:
        self._path = path
        reader = ipc.open_file(pa.memory_map(str(path), "r"))
        self._starts = np.zeros(reader.num_record_batches + 1, dtype=np.int64)
        np.cumsum(
            [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)],
            out=self._starts[1:],
        )
        self._columns: list[tuple[Any, Any, Any]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Workers map the file themselves: pickling mapped buffers would copy them.
        return {**self.__dict__, "_columns": None}

    def _views(self) -> list[tuple[Any, Any, Any]]:
        if self._columns is None:
            reader = ipc.open_file(pa.memory_map(str(self._path), "r"))
            views = []
            for i in range(reader.num_record_batches):
                b = reader.get_batch(i)
                tokens = b.column("tokens")
                views.append(
                    (
                        b.column("uid").to_numpy(),
                        tokens.offsets.to_numpy(),
                        tokens.values.to_numpy(),
                    )
                )
            self._columns = views
        return self._columns

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, index: int) -> tuple[int, int]:
        chunk = int(np.searchsorted(self._starts, index, side="right")) - 1
        return chunk, index - int(self._starts[chunk])

    def __getitem__(self, index: int) -> dict[str, Any]:
        chunk, row = self._locate(index)
        uids, offsets, values = self._views()[chunk]
        return {"uid": int(uids[row]), "tokens": values[offsets[row] : offsets[row + 1]]}

    def __getitems__(self, indices: Sequence[int]) -> tuple[Any, Any, Any]:
        import torch

        idx = np.asarray(indices, dtype=np.int64)
        chunks = np.searchsorted(self._starts, idx, side="right") - 1
        rows = idx - self._starts[chunks]
        views = self._views()
        uids = np.empty(len(idx), dtype=np.int64)
        pieces = []
        for k, (c, r) in enumerate(zip(chunks.tolist(), rows.tolist(), strict=True)):
            u, offsets, values = views[c]
            uids[k] = u[r]
            pieces.append(values[offsets[r] : offsets[r + 1]])
        out_offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in pieces], out=out_offsets[1:])
        return (
            torch.from_numpy(uids),
            torch.from_numpy(np.concatenate(pieces)),
            torch.from_numpy(out_offsets),
        )


def _passthrough(batch: Any) -> Any:
    return batch


class TorchMapStyleLoader:
    kind: base.Kind = "arrays"

    def __init__(self, setup: base.Setup) -> None:
        import torch  # noqa: F401 - imported before the clock starts, as a trainer has it

        self._setup = setup
        self._loader: Any = None
        workers = setup.workers
        self.settings = (
            f"torch.utils.data.DataLoader(map-style Arrow IPC mmap dataset with __getitems__, "
            f"batch_size={setup.batch_size}, shuffle=True, num_workers={workers}, "
            "persistent_workers=True, collate_fn=pass-through)"
        )

    def _make_loader(self) -> Any:
        import torch
        from torch.utils.data import DataLoader

        workers = self._setup.workers
        dataset: Any = ArrowTokens(self._setup.root / "arrow" / "data.arrow")
        return DataLoader(
            dataset,
            batch_size=self._setup.batch_size,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
            collate_fn=_passthrough,
            generator=torch.Generator().manual_seed(self._setup.seed),
        )

    def epoch(self, epoch: int) -> Iterator[Any]:
        if self._loader is None:
            self._loader = self._make_loader()
        yield from ragged.as_arrays(self._loader)

    def state(self, consumed: int) -> Any | None:
        return None

    def resume(self, state: Any) -> Iterator[Any]:
        raise NotImplementedError("torch's DataLoader has no saved-state API")

    def close(self) -> None:
        self._loader = None
