"""What the main process tells DataLoader workers that outlive one pass.

A DataLoader worker reads its own copy of the dataset, made when the worker starts. With
`persistent_workers=True` a worker serves every later pass of the loader from that copy,
so what the training loop does to the dataset between passes in the main process
(`set_epoch(e)`, `load_state_dict(state)`) never reaches it. The few facts a worker
needs at the start of each pass live in one small tensor in shared memory, which the
workers' copies share with the main process's dataset: a forked worker maps the same
memory, and a spawned one receives it through torch's multiprocessing pickler (the one
DataLoader sends the dataset with), the way torch users share an epoch counter. The
main process writes the epoch and the loads; a worker reads them when a pass starts.

The other way, a worker counts the passes it starts: the main process's copy of the
dataset never sees the batches its workers read, so its own `state_dict()` is not the
loader's position once they have read, and it refuses rather than say "epoch start".
Workers only ever raise that count, so two racing increments may lose one but never
leave it where the main process last saw it. A dataset pickled any other way carries a
copy of the values, not the shared memory.
"""

from __future__ import annotations

import torch
import torch.utils.data

_EPOCH, _LOADS, _WORKER_PASSES, _CHOSEN = 0, 1, 2, 3


def in_worker() -> bool:
    """Whether this process is a DataLoader worker (not the main process)."""
    return torch.utils.data.get_worker_info() is not None


class Notes:
    """The epoch the main process set last (and whether the loop chose it), how many
    states it has loaded, and how many passes DataLoader workers have started."""

    def __init__(self, epoch: int) -> None:
        # int64 like the epochs and counts it holds; shared before any worker starts.
        values = torch.tensor([epoch, 0, 0, 0], dtype=torch.int64)
        # torch declares no types for share_memory_ (it returns the tensor itself).
        values.share_memory_()  # type: ignore[no-untyped-call]
        self._values = values

    @property
    def epoch(self) -> int:
        return int(self._values[_EPOCH])

    @property
    def loads(self) -> int:
        return int(self._values[_LOADS])

    @property
    def worker_passes(self) -> int:
        return int(self._values[_WORKER_PASSES])

    @property
    def chosen(self) -> bool:
        """Whether the training loop has called `set_epoch` (the epoch is its choice,
        not the default or a loaded state's)."""
        return bool(self._values[_CHOSEN])

    def set_epoch(self, epoch: int) -> None:
        self._values[_EPOCH] = epoch

    def choose(self) -> None:
        self._values[_CHOSEN] = 1

    def count_load(self) -> int:
        """Count one more state loaded in the main process; the new count."""
        self._values[_LOADS] += 1
        return self.loads

    def count_worker_pass(self) -> None:
        """Count one more pass started in a DataLoader worker."""
        self._values[_WORKER_PASSES] += 1
