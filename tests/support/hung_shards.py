"""A store that took the request and never answers, for one shard of a file:// dataset.

`HungShard` puts a FIFO nobody writes in the shard's place: a fetch of it blocks in its
open, as on an object store that accepted the connection and sends nothing, or an NFS
mount that hangs. `answer()` lets it go and puts the shard's bytes back.
"""

from __future__ import annotations

import os
from pathlib import Path


class HungShard:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._kept = path.with_name(path.name + ".kept")
        path.rename(self._kept)
        os.mkfifo(path)

    def answer(self) -> None:
        """The store answers at last: the blocked open fails (pyarrow cannot seek a
        FIFO, an error the fetch retries) and the retry finds the shard's real bytes.
        Idempotent."""
        if not self._kept.exists():
            return
        wake = os.open(self.path, os.O_RDWR)  # never blocks, and wakes the opener
        os.replace(self._kept, self.path)
        os.close(wake)
