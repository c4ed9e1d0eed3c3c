"""Shared fixtures. Real processes only: fixtures start them on loopback."""

from __future__ import annotations

# Fixture modules live in tests/support; each registers its fixtures here.
pytest_plugins: list[str] = [
    "tests.support.s3server",
    "tests.support.sidecar",
    "tests.support.cluster",
    "tests.support.checkpoints",
    "tests.support.web_inspector",
    "tests.support.listener",
]
