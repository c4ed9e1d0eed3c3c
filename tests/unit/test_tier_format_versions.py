"""Tier format versions 1 and 2 (docs/cache-format.md): a meta file's sha256 may be null
(version 2) in a tier that does not hash, entries with a sha256 stay version 1, and
entries written by older versions are still served."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from shardcache import errors
from shardcache.node import names, tiers
from shardcache.node.tiers import _entries

pytestmark = pytest.mark.unit

KIB = 1024
DATA = bytes(range(256)) * 16


def produce(path: Path) -> None:
    path.write_bytes(DATA)


def tier(root: Path, **kwargs: object) -> tiers.Tier:
    return tiers.Tier(root, limit_bytes=64 * KIB, name="memory", **kwargs)  # type: ignore[arg-type]


def meta_doc(t: tiers.Tier, key: str) -> dict[str, object]:
    doc = json.loads((t.root / (key + names.META_SUFFIX)).read_text())
    assert isinstance(doc, dict)
    return doc


def write_entry(root: Path, key: str, doc: dict[str, object]) -> None:
    """An entry as another shardcache version left it: data, a hand-written meta file
    and the lease lock file its insert created."""
    root.mkdir(parents=True, exist_ok=True)
    (root / key).write_bytes(DATA)
    (root / (key + names.LOCK_SUFFIX)).touch()
    (root / (key + names.META_SUFFIX)).write_text(json.dumps(doc, sort_keys=True) + "\n")


@pytest.fixture
def no_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any read-back hash of an entry fails the test."""

    def refuse(path: Path, *, fsync: bool = False) -> str:
        raise AssertionError(f"{path} was read back to be hashed")

    monkeypatch.setattr(_entries, "sha256_file", refuse)


def test_an_entry_with_a_sha256_is_written_as_version_1_which_older_readers_take(
    tmp_path: Path,
) -> None:
    t = tier(tmp_path / "t")
    t.insert("k", len(DATA), produce).release()
    assert meta_doc(t, "k") == {
        "format_version": 1,
        "key": "k",
        "sha256": hashlib.sha256(DATA).hexdigest(),
        "size": len(DATA),
    }


def test_an_unhashed_tier_writes_a_null_sha256_as_version_2_without_reading_back(
    tmp_path: Path, no_hashing: None
) -> None:
    t = tier(tmp_path / "t", verify="never", hashed=False)
    entry = t.insert("k", len(DATA), produce)
    assert entry.sha256 is None
    entry.release()
    assert meta_doc(t, "k") == {"format_version": 2, "key": "k", "sha256": None, "size": len(DATA)}
    found = t.lookup("k")
    assert found is not None and found.sha256 is None and found.path.read_bytes() == DATA
    found.release()
    assert t.scan().entries == 1


def test_a_declared_sha256_is_kept_without_reading_the_entry_back(
    tmp_path: Path, no_hashing: None
) -> None:
    digest = hashlib.sha256(DATA).hexdigest()
    t = tiers.Tier(tmp_path / "t", limit_bytes=64 * KIB, name="disk", verify="never")
    t.insert("k", len(DATA), produce, sha256=digest).release()
    entry, hit = t.get_or_insert("j", len(DATA), produce, sha256=digest)
    entry.release()
    assert not hit
    assert meta_doc(t, "k")["sha256"] == meta_doc(t, "j")["sha256"] == digest
    assert meta_doc(t, "k")["format_version"] == 1


def test_a_verifying_tier_still_checks_a_declared_sha256(tmp_path: Path) -> None:
    root = tmp_path / "t"
    writing = tiers.Tier(root, limit_bytes=64 * KIB, name="disk", verify="never")
    writing.insert("right", len(DATA), produce, sha256=hashlib.sha256(DATA).hexdigest()).release()
    writing.insert("wrong", len(DATA), produce, sha256="0" * 64).release()
    verifying = tiers.Tier(root, limit_bytes=64 * KIB, name="disk")
    right = verifying.lookup("right")
    assert right is not None
    right.release()
    assert verifying.lookup("wrong") is None
    assert not (root / "wrong").exists()


def test_entries_written_by_format_version_1_are_still_served(tmp_path: Path) -> None:
    root = tmp_path / "t"
    digest = hashlib.sha256(DATA).hexdigest()
    for key in ("a", "b"):
        write_entry(
            root, key, {"format_version": 1, "key": key, "sha256": digest, "size": len(DATA)}
        )
    assert tier(root, verify="never", hashed=False).scan().entries == 2
    for t in (tier(root), tier(root, verify="never", hashed=False)):
        for key in ("a", "b"):
            entry = t.lookup(key)
            assert entry is not None and entry.sha256 == digest
            assert entry.path.read_bytes() == DATA
            entry.release()


def test_a_verifying_tier_does_not_serve_an_entry_without_a_sha256(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "t"
    write_entry(root, "k", {"format_version": 2, "key": "k", "sha256": None, "size": len(DATA)})
    with caplog.at_level(logging.WARNING):
        assert tier(root).lookup("k") is None
    assert "no sha256 to verify it against" in caplog.text
    assert not (root / "k").exists()


def test_a_null_sha256_is_not_valid_in_a_version_1_meta_file(tmp_path: Path) -> None:
    root = tmp_path / "t"
    write_entry(root, "k", {"format_version": 1, "key": "k", "sha256": None, "size": len(DATA)})
    with pytest.raises(errors.CacheError, match="expected a hex sha256, found None"):
        tiers.read_meta(root / ("k" + names.META_SUFFIX), "k")
    assert tier(root, verify="never", hashed=False).lookup("k") is None


def test_an_unhashed_tier_must_never_verify(tmp_path: Path) -> None:
    with pytest.raises(errors.InputError, match="hashed=False needs verify='never'"):
        tier(tmp_path / "t", hashed=False)


@pytest.mark.parametrize("digest", ["", "A" * 64, "0" * 63, "sha256:" + "0" * 64])
def test_a_declared_sha256_must_be_lowercase_hex(tmp_path: Path, digest: str) -> None:
    t = tier(tmp_path / "t")
    with pytest.raises(errors.InputError, match="64 lowercase hex digits"):
        t.insert("k", len(DATA), produce, sha256=digest)
