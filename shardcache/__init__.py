"""shardcache: a node-local dataset cache that hands trainers zero-copy Arrow batches."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
