"""The source tree a benchmark runs, for the processes it starts.

A process a benchmark starts must import this tree's packages, not whichever copy the
virtual environment's editable install points at: a worktree or a `git archive` copy
(a "before" of a before/after run) that shares another tree's `.venv` would otherwise
run that tree's sidecar and operator with its own client library.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python_path() -> str:
    """PYTHONPATH for a child: this tree's client library, sidecar and operator first,
    then the caller's own entries."""
    own = [str(REPO), str(REPO / "sidecar"), str(REPO / "operator")]
    return os.pathsep.join(filter(None, [*own, os.environ.get("PYTHONPATH")]))
