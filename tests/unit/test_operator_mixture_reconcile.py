"""Reconciling a multi-source DatasetMount: every source pinned before it is Ready."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
from shardcache_operator import reconcile, sources, specs, status

from shardcache import errors, manifests
from tests.support import datasets

pytestmark = pytest.mark.unit

NOW = "2026-01-01T00:00:00Z"


async def no_secret(namespace: str, name: str) -> Mapping[str, str] | None:
    raise AssertionError("no Secret is named")


def never_probe(uri: str, options: Mapping[str, str] | None, **_: object) -> None:
    raise AssertionError("a new pin is resolved, not probed")


class Resolver:
    """The real `manifests.resolve`, counting its calls per URI."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, uri: str, fmt: str, options: Mapping[str, str] | None) -> manifests.Manifest:
        self.calls.append(uri)
        return manifests.resolve(uri, format=fmt, storage_options=options)


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name, shards in {"web": [30, 20], "code": [15], "math": [9, 9, 9]}.items():
        datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / name), shards)
        out[name] = f"file://{tmp_path / name}"
    return out


def mix(roots: dict[str, str], **override: Any) -> dict[str, Any]:
    sources = [
        {"name": "code", "weight": 1, "uri": roots["code"]},
        {"name": "math", "weight": 2, "uri": roots["math"]},
    ]
    return {
        "apiVersion": "shardcache.io/v1alpha1",
        "kind": "DatasetMount",
        "metadata": {"name": "mix", "namespace": "ml", "generation": 1},
        "spec": {
            "source": {"uri": roots["web"]},
            "mixture": {"name": "web", "weight": 3, "sources": sources, **override},
        },
    }


def answers(uri: str, options: Mapping[str, str] | None, **_: object) -> None:
    """A source that answers the reachability probe of a kept pin."""


async def run(
    obj: dict[str, Any], resolver: Resolver, probe: reconcile.Prober = never_probe
) -> reconcile.Result:
    return await reconcile.reconcile(
        obj, read_secret=no_secret, resolve=resolver, probe=probe, now=NOW
    )


async def test_every_source_is_pinned_in_status_and_read_back_for_injection(
    roots: dict[str, str],
) -> None:
    resolver = Resolver()
    result = await run(mix(roots), resolver)
    assert result.status["phase"] == status.Phase.READY
    pins = {p["name"]: p for p in result.status["mixture"]}
    assert set(pins) == {"code", "math"}
    assert pins["math"]["shards"] == 3 and pins["math"]["rows"] == 27
    assert pins["code"]["manifestDigest"] == manifests.resolve(roots["code"]).digest
    loaded = specs.load({**mix(roots), "status": result.status})
    assert loaded.source_digests == {n: p["manifestDigest"] for n, p in pins.items()}
    assert sorted(resolver.calls) == sorted(roots.values())


async def test_pins_are_kept_and_only_a_changed_source_resolves_again(
    roots: dict[str, str], tmp_path: Path
) -> None:
    first = await run(mix(roots), Resolver())
    # The bucket changes under the pin: a kept pin does not move.
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "code"), [15, 4])
    obj = {**mix(roots), "status": first.status}
    again = Resolver()
    kept = await run(obj, again, probe=answers)
    assert kept.status["phase"] == status.Phase.READY
    assert kept.status["mixture"] == first.status["mixture"]
    # Nothing listed again: the primary's pin is probed and kept, the others kept.
    assert again.calls == []
    # A changed source (another uri) is resolved again, the others stay.
    moved = mix(roots)
    moved["spec"]["mixture"]["sources"][0]["uri"] = roots["math"]
    changed = await run({**moved, "status": first.status}, again, probe=answers)
    assert again.calls == [roots["math"]]
    assert changed.status["phase"] == status.Phase.READY


async def test_a_failing_source_keeps_the_mount_from_ready_naming_the_source(
    roots: dict[str, str], tmp_path: Path
) -> None:
    obj = mix(roots)
    obj["spec"]["mixture"]["sources"][1]["uri"] = f"file://{tmp_path / 'nothing-here'}"
    result = await run(obj, Resolver())
    # Missing data is retried (slowly), not Invalid: it may yet be uploaded.
    assert result.status["phase"] == status.Phase.DEGRADED
    ready = {c["type"]: c for c in result.status["conditions"]}["Ready"]
    assert ready["reason"] == "InvalidData"
    assert ready["message"].startswith("spec.mixture.sources[1] (math): nothing found at")
    assert "mixture" not in result.status


def stored_after(stored: Mapping[str, Any], written: Mapping[str, Any]) -> dict[str, Any]:
    """The status the API server keeps after the handlers' merge patch of `written`:
    keys left out stay, a key set to None is deleted."""
    merged = {**stored, **written}
    return {key: value for key, value in merged.items() if value is not None}


def unreachable_at(uri: str, resolver: Resolver) -> reconcile.Resolver:
    def resolve(at: str, fmt: str, options: Mapping[str, str] | None) -> manifests.Manifest:
        if at == uri:
            raise errors.SourceError(f"{at}: connection refused")
        return resolver(at, fmt, options)

    return resolve


def edited(obj: dict[str, Any], uri: str) -> None:
    obj["spec"]["mixture"]["sources"][0]["uri"] = uri


def added(obj: dict[str, Any], uri: str) -> None:
    obj["spec"]["mixture"]["sources"].append({"name": "more", "weight": 1, "uri": uri})


@pytest.mark.parametrize("change", [edited, added])
async def test_the_periodic_check_leaves_a_mount_unready_while_a_source_lacks_its_pin(
    roots: dict[str, str], tmp_path: Path, change: Callable[[dict[str, Any], str], None]
) -> None:
    first = await run(mix(roots), Resolver())
    # The periodic check keeps a fully pinned mixture as it is.
    kept = await reconcile.check_source(
        {**mix(roots), "status": first.status}, read_secret=no_secret, probe=answers, now=NOW
    )
    assert kept is not None and kept.status["mixture"] == first.status["mixture"]
    # A source edited or added, whose new uri does not answer: Degraded, old pins kept.
    obj = mix(roots)
    new_uri = f"file://{tmp_path / 'moved'}"
    change(obj, new_uri)
    obj["metadata"]["generation"] = 2
    failed = await reconcile.reconcile(
        {**obj, "status": first.status},
        read_secret=no_secret,
        resolve=unreachable_at(new_uri, Resolver()),
        probe=answers,
        now=NOW,
    )
    assert failed.status["phase"] == status.Phase.DEGRADED
    stored = stored_after(first.status, failed.status)
    # spec.source still answers, but the new source has no pin: not the check's to mend.
    checked = await reconcile.check_source(
        {**obj, "status": stored}, read_secret=no_secret, probe=answers, now=NOW
    )
    assert checked is None, (
        f"the check made the mount {checked.status['phase']} with pins "
        f"{[p['resolvedSource']['uri'] for p in checked.status['mixture']]} for {new_uri}"
    )


async def test_the_periodic_check_looks_at_every_source_and_names_the_one_whose_data_is_gone(
    roots: dict[str, str], tmp_path: Path
) -> None:
    first = await run(mix(roots), Resolver())
    obj = {**mix(roots), "status": first.status}
    asked: list[tuple[str, object]] = []

    def records(uri: str, options: Mapping[str, str] | None, **kwargs: object) -> None:
        asked.append((uri, kwargs.get("shard")))

    kept = await reconcile.check_source(obj, read_secret=no_secret, probe=records, now=NOW)
    assert kept is not None and kept.status["phase"] == status.Phase.READY
    # spec.source first, then each further source in its order, each at its own shard.
    pins = {p["name"]: p["largestShard"] for p in first.status["mixture"]}
    assert asked == [
        (roots["web"], tuple(first.status["largestShard"].values())),
        (roots["code"], tuple(pins["code"].values())),
        (roots["math"], tuple(pins["math"].values())),
    ]
    # The real check, on the real files: the math source's pinned shard deleted.
    files = sources.Access(file_sources=True)

    def probe(uri: str, options: Mapping[str, str] | None, **kwargs: Any) -> None:
        sources.probe_source(uri, options, access=files, **kwargs)

    (tmp_path / "math" / pins["math"]["path"]).unlink()
    gone = await reconcile.check_source(obj, read_secret=no_secret, probe=probe, now=NOW)
    assert gone is not None and gone.status["phase"] == status.Phase.DEGRADED
    ready = {c["type"]: c for c in gone.status["conditions"]}["Ready"]
    assert ready["reason"] == "SourceGone"
    assert ready["message"].startswith(
        f"spec.mixture.sources[1] (math): the pinned shard {pins['math']['path']!r} of "
        f"{roots['math']!r} is not there any more: the pinned data is gone; "
    )
    # What to do about it, not only what was found.
    fix = "restore the pinned data, or pin anew by changing the source's uri or version"
    assert fix in ready["message"]
    assert gone.status["mixture"] == first.status["mixture"]  # the pins stay


async def test_removing_the_mixture_deletes_its_pins_from_the_stored_status(
    roots: dict[str, str],
) -> None:
    first = await run(mix(roots), Resolver())
    single = mix(roots)
    del single["spec"]["mixture"]
    single["metadata"]["generation"] = 2
    again = await run({**single, "status": first.status}, Resolver(), probe=answers)
    assert again.status["phase"] == status.Phase.READY
    assert "mixture" not in stored_after(first.status, again.status)
