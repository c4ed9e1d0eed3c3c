"""Events of a pinned mount whose source fails: one per change, none per repeat.

The periodic check and the backoff retries of a kept pin run again and again while a
source stays down; each run must not post the same Warning again (docs/operator.md,
"Status, phases and conditions")."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
from shardcache_operator import reconcile

from shardcache import errors

pytestmark = pytest.mark.unit

DIGEST = "sha256:" + "ab" * 32


@dataclasses.dataclass(frozen=True)
class FakeManifest:
    digest: str = DIGEST
    format: str = "parquet"
    shard_count: int = 1
    total_rows: int = 10
    total_bytes: int = 1000
    largest_shard: None = None


def resolves(uri: str, fmt: str, options: Mapping[str, str] | None) -> FakeManifest:
    return FakeManifest()


async def secret(namespace: str, name: str) -> Mapping[str, str] | None:
    return {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}


def answers(uri: str, options: Mapping[str, str] | None) -> None:
    return None


def refuses(uri: str, options: Mapping[str, str] | None) -> None:
    raise errors.SourceError(f"{uri}: connection refused")


def gone(uri: str, options: Mapping[str, str] | None) -> None:
    raise errors.InputError(f"nothing found at {uri!r} any more")


class Mount:
    """A DatasetMount as the API server keeps it between handler runs."""

    def __init__(self) -> None:
        self.obj: dict[str, Any] = {
            "apiVersion": "shardcache.io/v1alpha1",
            "kind": "DatasetMount",
            "metadata": {"name": "data", "namespace": "ml", "generation": 1},
            "spec": {"source": {"uri": "s3://bucket/data/", "secretRef": {"name": "creds"}}},
        }

    def store(self, result: reconcile.Result | None) -> list[tuple[str, str]]:
        """Apply the result's status as the handlers' merge patch; its Events."""
        assert result is not None
        before = self.obj.get("status") or {}
        merged = {**before, **result.status}
        self.obj["status"] = {k: v for k, v in merged.items() if v is not None}
        return [(event.type, event.reason) for event in result.events]

    async def check(self, probe: reconcile.Prober) -> list[tuple[str, str]]:
        return self.store(
            await reconcile.check_source(self.obj, read_secret=secret, probe=probe, now="t")
        )

    async def reconcile(self, probe: reconcile.Prober, retry: int = 0) -> list[tuple[str, str]]:
        result = await reconcile.reconcile(
            self.obj, read_secret=secret, resolve=resolves, probe=probe, now="t", retry=retry
        )
        return self.store(result)


async def test_a_pinned_mount_posts_one_warning_for_a_failure_that_repeats() -> None:
    mount = Mount()
    assert await mount.reconcile(answers) == [("Normal", "ManifestPinned")]
    assert await mount.check(refuses) == [("Warning", "SourceUnreachable")]
    assert await mount.check(refuses) == [], "the periodic check posted the same failure again"
    assert await mount.reconcile(refuses, retry=1) == [], "a backoff retry posted it again"
    assert await mount.check(refuses) == []


async def test_a_pinned_mount_posts_again_when_its_failure_changes_or_heals() -> None:
    mount = Mount()
    await mount.reconcile(answers)
    assert await mount.check(refuses) == [("Warning", "SourceUnreachable")]
    assert await mount.check(gone) == [("Warning", "SourceGone")]
    assert await mount.check(answers) == [("Normal", "SourceRecovered")]
    assert await mount.check(answers) == []
    assert await mount.check(refuses) == [("Warning", "SourceUnreachable")]
