"""The node tier runs in a session of its own (`make test` starts it as a second pytest
run): its last test takes the cluster down to prove the host is left clean, which the
e2e tier's session-scoped fixtures must not see. Collected together with other tests it
is deselected, and the summary says so.
"""

from __future__ import annotations

import pathlib

import pytest

NODE_DIR = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    node_items = [item for item in items if NODE_DIR in item.path.parents]
    others = [item for item in items if NODE_DIR not in item.path.parents]
    if node_items and others:
        config.hook.pytest_deselected(items=node_items)
        items[:] = others
        config.stash[_deselected_key] = len(node_items)


_deselected_key = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    count = terminalreporter.config.stash.get(_deselected_key, 0)
    if count:
        terminalreporter.write_line(
            f"node tier: {count} tests deselected here; they run in their own session "
            "(`make test` does it; alone: `pytest tests/node`)",
            yellow=True,
        )
