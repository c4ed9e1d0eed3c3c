"""Debugging a run's data: which checkpoints saw a sample, what a checkpoint consumed,
and where two runs' data differ.

Everything is computed from the reading plan and the data states stored in the
checkpoints (`shardcache.states`), never by replaying the run. docs/debugging.md walks
through a loss spike with these tools.
"""

from __future__ import annotations

from shardcache.lineage.history import Checkpoint, History, Span, build
from shardcache.lineage.queries import Read, consumed, reads

__all__ = ["Checkpoint", "History", "Read", "Span", "build", "consumed", "reads"]
