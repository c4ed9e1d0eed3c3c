"""See the data a rank actually receives.

The reading plan is deterministic, so the exact samples of any (epoch, rank, step) can
be computed and shown with their provenance (shard, row, global index), and the
reverse: where a given sample is seen. `shardcache inspect` prints them, `--tui` pages
through them, and the sidecar's `/ui` (or `shardcache web`) shows them in a browser.
Pure pyarrow + stdlib; the TUI (textual) and token decoding (tokenizers) are imported
only when asked for.
"""

from __future__ import annotations

from shardcache.inspect.locate import Provenance, Query, Sighting
from shardcache.inspect.render import RenderOptions
from shardcache.inspect.session import Inspector, ProviderRows, StepView, WhereResult, open_uri

__all__ = [
    "Inspector",
    "Provenance",
    "ProviderRows",
    "Query",
    "RenderOptions",
    "Sighting",
    "StepView",
    "WhereResult",
    "open_uri",
]
