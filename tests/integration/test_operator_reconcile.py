"""Reconcile against a real S3-compatible server (MinIO on loopback).

The reconcile core gets the real `shardcache.manifests.resolve`; the Secret comes from a
small in-memory stand-in for the API read (the real API server arrives with the e2e
tier), holding the server's real credentials.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shardcache_operator import endpoint_policy, read_workers, reconcile, sources

from shardcache import manifests, source
from tests.support.s3server import S3Server

pytestmark = pytest.mark.integration

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"
FAST_RETRY = source.RetryPolicy(attempts=2, initial_delay=0.05, max_delay=0.1)


def quick_resolve(uri: str, fmt: str, options: Mapping[str, str] | None) -> manifests.Manifest:
    return manifests.resolve(uri, format=fmt, storage_options=options, retry=FAST_RETRY)


def listing(options: Mapping[str, str] | None) -> sources.Access:
    """The platform's list naming the endpoint `options` point at: the server (or the
    dead port) on loopback, which the operator refuses unless listed
    (policy.sourceEndpoints)."""
    endpoint = (options or {}).get("AWS_ENDPOINT_URL")
    return sources.Access(source_endpoints=(endpoint_policy.entry(endpoint),) if endpoint else ())


def quick_probe(
    uri: str, options: Mapping[str, str] | None, *, shard: reconcile.PinnedShard | None = None
) -> None:
    sources.probe_source(uri, options, access=listing(options), retry=FAST_RETRY, shard=shard)


class WorkerProbe:
    """`quick_probe` in the operator's read workers (`read_workers.Pool`, as `app.run`
    gives it), one pool per endpoint list."""

    def __init__(self) -> None:
        self.pools: dict[tuple[endpoint_policy.Origin, ...], read_workers.Pool] = {}

    def __call__(
        self,
        uri: str,
        options: Mapping[str, str] | None,
        *,
        shard: reconcile.PinnedShard | None = None,
    ) -> None:
        access = listing(options)
        pool = self.pools.get(access.source_endpoints)
        if pool is None:
            pool = read_workers.Pool(memory=256 << 20, access=access, retry=FAST_RETRY)
            self.pools[access.source_endpoints] = pool
        pool.probe(uri, options, shard=shard)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


@pytest.fixture(params=["in-process", "read-worker"])
def probe(request: pytest.FixtureRequest) -> Iterator[reconcile.Prober]:
    """The source check in the operator's process, and in a read worker: the same
    status for each way a source fails."""
    if request.param == "in-process":
        yield quick_probe
        return
    workers = WorkerProbe()
    try:
        yield workers
    finally:
        workers.close()


def write_shards(server: S3Server, bucket: str, prefix: str, count: int, *, start: int = 0) -> None:
    fs = server.filesystem()
    for i in range(start, start + count):
        table = pa.table({"id": list(range(i * 100, i * 100 + 100)), "text": ["x" * 10] * 100})
        with fs.open_output_stream(f"{bucket}/{prefix}/part-{i:03d}.parquet") as out:
            pq.write_table(table, out)


def secrets_of(server: S3Server, *, name: str = "s3-creds") -> reconcile.SecretReader:
    store = {("ml", name): server.env()}

    async def read_secret(namespace: str, secret: str) -> Mapping[str, str] | None:
        return store.get((namespace, secret))

    return read_secret


def dsm(uri: str, *, name: str = "data", generation: int = 1, **spec: Any) -> dict[str, Any]:
    source_spec: dict[str, Any] = {"uri": uri, "secretRef": {"name": "s3-creds"}}
    source_spec.update(spec.pop("source", {}))
    return {
        "apiVersion": "shardcache.io/v1alpha1",
        "kind": "DatasetMount",
        "metadata": {"name": name, "namespace": "ml", "generation": generation},
        "spec": {"source": source_spec, **spec},
    }


def conditions(result: reconcile.Result) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in result.status["conditions"]}


async def run(obj: dict[str, Any], server: S3Server, **kwargs: Any) -> reconcile.Result:
    return await reconcile.reconcile(
        obj,
        read_secret=kwargs.pop("read_secret", secrets_of(server)),
        resolve=kwargs.pop("resolve", quick_resolve),
        probe=quick_probe,
        now=kwargs.pop("now", NOW),
        **kwargs,
    )


async def test_reconcile_pins_the_digest_of_the_real_bucket(
    s3_server: S3Server, s3_bucket: str
) -> None:
    write_shards(s3_server, s3_bucket, "train", 3)
    uri = f"s3://{s3_bucket}/train/"
    result = await run(dsm(uri), s3_server)
    expected = manifests.resolve(uri, storage_options=s3_server.env())
    assert result.status["phase"] == "Ready"
    assert result.status["manifestDigest"] == expected.digest
    assert result.status["shards"] == 3
    assert result.status["rows"] == 300
    assert result.status["bytes"] == expected.total_bytes
    assert result.status["observedGeneration"] == 1
    assert result.status["resolvedSource"] == {
        "uri": uri,
        "format": "parquet",
        "manifestVersion": str(manifests.MANIFEST_VERSION),
    }
    assert {t: c["status"] for t, c in conditions(result).items()} == {
        "SourceReachable": "True",
        "ManifestResolved": "True",
        "Ready": "True",
        # Small shards against the default 1Gi limit (`shard_room`).
        "ShardTooLargeToDecode": "False",
    }
    assert all(c["reason"] and c["message"] for c in conditions(result).values())
    # The pin records the bucket's largest shard, which the condition judges again
    # while the pin is kept.
    largest = max(expected.shards, key=lambda shard: shard.size)
    assert result.status["largestShard"] == {"path": largest.path, "bytes": largest.size}
    assert [e.reason for e in result.events] == ["ManifestPinned"]
    assert result.retry_in is None


async def test_pin_holds_when_the_bucket_changes_and_other_spec_fields_change(
    s3_server: S3Server, s3_bucket: str
) -> None:
    write_shards(s3_server, s3_bucket, "train", 2)
    obj = dsm(f"s3://{s3_bucket}/train/")
    first = await run(obj, s3_server)
    write_shards(s3_server, s3_bucket, "train", 1, start=2)  # the bucket moves on
    obj["status"] = first.status
    obj["metadata"]["generation"] = 2
    obj["spec"]["cache"] = {"memory": "8Gi"}
    second = await run(obj, s3_server, now=LATER)
    assert second.status["manifestDigest"] == first.status["manifestDigest"]
    assert second.status["shards"] == 2
    assert second.status["observedGeneration"] == 2
    assert second.events == ()
    # Unchanged condition statuses keep their transition time.
    assert conditions(second)["Ready"]["lastTransitionTime"] == NOW


async def test_a_memory_limit_lowered_on_a_kept_pin_posts_one_shard_too_large_warning(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """The pin recorded the real bucket's largest shard; a limit lowered later is judged
    against it without listing the bucket again, and warned once (`shard_room`)."""
    write_shards(s3_server, s3_bucket, "train", 2)
    obj = dsm(f"s3://{s3_bucket}/train/", sidecar={"resources": {"limits": {"memory": "2Gi"}}})
    first = await run(obj, s3_server)
    assert conditions(first)["ShardTooLargeToDecode"]["status"] == "False"
    obj["status"] = first.status
    # 256Mi is all the sidecar process's base: no room is left for any shard.
    obj["spec"]["sidecar"] = {"resources": {"limits": {"memory": "256Mi"}}}
    obj["metadata"]["generation"] = 2
    write_shards(s3_server, s3_bucket, "train", 1, start=2)  # the bucket moves on
    lowered = await run(obj, s3_server, now=LATER)
    assert lowered.status["manifestDigest"] == first.status["manifestDigest"]
    found = conditions(lowered)["ShardTooLargeToDecode"]
    assert (found["status"], found["reason"]) == ("True", "OverDecodeRoom")
    assert found["lastTransitionTime"] == LATER
    assert [(e.type, e.reason, e.message) for e in lowered.events] == [
        ("Warning", "ShardTooLargeToDecode", found["message"])
    ]
    obj["status"] = lowered.status
    again = await run(obj, s3_server, now=LATER)
    assert conditions(again)["ShardTooLargeToDecode"] == found
    assert again.events == ()


async def test_a_changed_source_resolves_again(s3_server: S3Server, s3_bucket: str) -> None:
    write_shards(s3_server, s3_bucket, "a", 2)
    write_shards(s3_server, s3_bucket, "b", 4)
    obj = dsm(f"s3://{s3_bucket}/a/")
    first = await run(obj, s3_server)
    obj["status"] = first.status
    obj["spec"]["source"]["uri"] = f"s3://{s3_bucket}/b/"
    second = await run(obj, s3_server)
    assert second.status["shards"] == 4
    assert second.status["manifestDigest"] != first.status["manifestDigest"]


async def test_a_pin_of_an_older_manifest_version_is_resolved_again(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """Manifest version 2 pins had no per-shard sha256; their digests never match what
    sidecars of version 3 resolve, so the operator re-pins instead of handing them on."""
    write_shards(s3_server, s3_bucket, "train", 2)
    uri = f"s3://{s3_bucket}/train/"
    obj = dsm(uri)
    first = await run(obj, s3_server)
    old = "sha256:" + "1" * 64
    obj["status"] = {
        **first.status,
        "manifestDigest": old,
        "resolvedSource": {"uri": uri, "format": "parquet"},  # as version 2 wrote it
    }
    again = await run(obj, s3_server, now=LATER)
    assert again.status["manifestDigest"] == first.status["manifestDigest"] != old
    assert [e.reason for e in again.events] == ["ManifestPinned"]


async def test_explicit_version_pin_is_checked_against_the_source(
    s3_server: S3Server, s3_bucket: str
) -> None:
    write_shards(s3_server, s3_bucket, "train", 2)
    uri = f"s3://{s3_bucket}/train/"
    digest = manifests.resolve(uri, storage_options=s3_server.env()).digest
    ok = await run(dsm(uri, source={"version": digest}), s3_server)
    assert ok.status["phase"] == "Ready"
    wrong = "sha256:" + "0" * 64
    bad = await run(dsm(uri, source={"version": wrong}), s3_server)
    # The data may be restored: tried again at the longest backoff, not only on a spec edit.
    assert bad.status["phase"] == "Degraded"
    ready = conditions(bad)["Ready"]
    assert ready["reason"] == "DigestMismatch"
    assert wrong in ready["message"] and digest in ready["message"]
    assert bad.retry_in == reconcile.Backoff().max_seconds


async def test_unreachable_source_degrades_with_growing_backoff_and_keeps_the_pin(
    s3_server: S3Server, s3_bucket: str
) -> None:
    write_shards(s3_server, s3_bucket, "train", 1)
    obj = dsm(f"s3://{s3_bucket}/train/")
    first = await run(obj, s3_server)
    # The same object, but the Secret now points at a port nobody listens on.
    from tests.support.s3server import free_port

    dead = {**s3_server.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}

    async def read_secret(namespace: str, name: str) -> Mapping[str, str] | None:
        return dead

    obj["status"] = first.status
    obj["spec"]["source"]["uri"] = f"s3://{s3_bucket}/train/"  # same source ...
    obj["status"]["resolvedSource"] = {}  # ... but force a new resolution
    backoff = reconcile.Backoff(initial_seconds=5, max_seconds=60)
    delays = []
    for retry in range(5):
        result = await run(obj, s3_server, read_secret=read_secret, retry=retry, backoff=backoff)
        assert result.status["phase"] == "Degraded"
        delays.append(result.retry_in)
    assert delays == [5, 10, 20, 40, 60]
    reachable = conditions(result)["SourceReachable"]
    assert (reachable["status"], reachable["reason"]) == ("False", "SourceUnreachable")
    assert conditions(result)["Ready"]["status"] == "False"
    # Pods already running keep the digest they were given.
    assert result.status["manifestDigest"] == first.status["manifestDigest"]
    assert [e.type for e in result.events] == ["Warning"]


async def test_invalid_datasetmounts_get_clear_messages_and_others_still_resolve(
    s3_server: S3Server, s3_bucket: str
) -> None:
    write_shards(s3_server, s3_bucket, "good", 2)
    good = dsm(f"s3://{s3_bucket}/good/", name="good")
    cases = {
        "bad-uri": (dsm("bucket-without-scheme", name="bad-uri"), "Invalid", "spec.source.uri"),
        "negative": (
            dsm(f"s3://{s3_bucket}/good/", name="negative", cache={"memory": "-1Gi"}),
            "Invalid",
            "spec.cache.memory",
        ),
        "format": (
            dsm(f"s3://{s3_bucket}/good/", name="format", source={"format": "csv"}),
            "Invalid",
            "spec.source.format: expected one of parquet, arrow, jsonl, found 'csv'",
        ),
        "no-secret": (
            dsm(
                f"s3://{s3_bucket}/good/", name="no-secret", source={"secretRef": {"name": "gone"}}
            ),
            "Pending",
            "Secret ml/gone named in spec.source.secretRef.name does not exist",
        ),
        # Data not (yet) at the source: Degraded and retried, not Invalid.
        "empty": (dsm(f"s3://{s3_bucket}/nothing-here/", name="empty"), "Degraded", "nothing-here"),
        "no-bucket": (
            dsm("s3://no-such-bucket-zz/x/", name="no-bucket"),
            "Degraded",
            "no-such-bucket-zz",
        ),
    }
    results = await asyncio.gather(
        run(good, s3_server), *(run(obj, s3_server) for obj, _, _ in cases.values())
    )
    assert results[0].status["phase"] == "Ready"
    for (name, (_, phase, text)), result in zip(cases.items(), results[1:], strict=True):
        ready = conditions(result)["Ready"]
        assert result.status["phase"] == phase, (name, ready)
        assert ready["status"] == "False"
        assert text in ready["message"], (name, ready["message"])
        assert result.events and result.events[0].type == "Warning"
        # Pending waits for the Secret, Degraded for the data (both retried); Invalid
        # waits for a spec change.
        assert (result.retry_in is not None) == (phase != "Invalid"), name


async def test_reconcile_survives_a_resolver_that_crashes(s3_server: S3Server) -> None:
    def broken(uri: str, fmt: str, options: Mapping[str, str] | None) -> manifests.Manifest:
        raise RuntimeError("boom")

    result = await reconcile.reconcile(
        dsm("s3://any/x/"),
        read_secret=secrets_of(s3_server),
        resolve=broken,
        probe=quick_probe,
        now=NOW,
    )
    assert result.status["phase"] == "Degraded"
    assert "boom" in conditions(result)["Ready"]["message"]
    assert result.retry_in is not None


def dead_endpoint_secrets(server: S3Server) -> reconcile.SecretReader:
    from tests.support.s3server import free_port

    dead = {**server.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}

    async def read_secret(namespace: str, name: str) -> Mapping[str, str] | None:
        return dead

    return read_secret


async def check(obj: dict[str, Any], server: S3Server, **kwargs: Any) -> reconcile.Result:
    result = await reconcile.check_source(
        obj,
        read_secret=kwargs.pop("read_secret", secrets_of(server)),
        probe=kwargs.pop("probe", quick_probe),
        now=kwargs.pop("now", LATER),
    )
    assert result is not None
    return result


async def test_pinned_mount_degrades_when_its_source_goes_away_and_recovers(
    s3_server: S3Server, s3_bucket: str, probe: reconcile.Prober
) -> None:
    write_shards(s3_server, s3_bucket, "train", 2)
    obj = dsm(f"s3://{s3_bucket}/train/")
    obj["status"] = (await run(obj, s3_server)).status
    assert (await check(obj, s3_server, probe=probe)).events == ()  # still there

    down = await check(obj, s3_server, read_secret=dead_endpoint_secrets(s3_server), probe=probe)
    assert down.status["phase"] == "Degraded"
    assert down.status["manifestDigest"] == obj["status"]["manifestDigest"]
    conditions_down = conditions(down)
    assert conditions_down["SourceReachable"]["reason"] == "SourceUnreachable"
    assert conditions_down["ManifestResolved"]["status"] == "True"  # the pin stands
    assert conditions_down["Ready"]["status"] == "False"
    assert [e.reason for e in down.events] == ["SourceUnreachable"]

    obj["status"] = down.status
    back = await check(obj, s3_server, probe=probe)
    assert back.status["phase"] == "Ready"
    assert [e.reason for e in back.events] == ["SourceRecovered"]


async def test_pinned_mount_degrades_when_data_or_secret_disappears(
    s3_server: S3Server, s3_bucket: str, probe: reconcile.Prober
) -> None:
    write_shards(s3_server, s3_bucket, "train", 1)
    obj = dsm(f"s3://{s3_bucket}/train/")
    obj["status"] = (await run(obj, s3_server)).status

    async def no_secret(namespace: str, name: str) -> Mapping[str, str] | None:
        return None

    secretless = await check(obj, s3_server, read_secret=no_secret, probe=probe)
    assert secretless.status["phase"] == "Degraded"
    assert conditions(secretless)["Ready"]["reason"] == "SecretNotFound"

    s3_server.filesystem().delete_dir_contents(f"{s3_bucket}/train")
    gone = await check(obj, s3_server, probe=probe)
    assert gone.status["phase"] == "Degraded"
    assert conditions(gone)["Ready"]["reason"] == "SourceGone"
    assert "the pinned data is gone" in conditions(gone)["Ready"]["message"]


async def test_a_pinned_shard_rewritten_or_deleted_degrades_the_mount_though_others_remain(
    s3_server: S3Server, s3_bucket: str, probe: reconcile.Prober
) -> None:
    """The check looks for the shard the pin recorded (status.largestShard) at its size:
    one request, whatever the prefix holds; a pin that recorded none (an older
    operator's) is checked at its root, which the other shards still pass."""
    write_shards(s3_server, s3_bucket, "train", 3)
    obj = dsm(f"s3://{s3_bucket}/train/")
    obj["status"] = (await run(obj, s3_server)).status
    name = obj["status"]["largestShard"]["path"]
    fs = s3_server.filesystem()
    with fs.open_output_stream(f"{s3_bucket}/train/{name}") as out:
        out.write(b"not the pinned shard")
    changed = await check(obj, s3_server, probe=probe)
    assert changed.status["phase"] == "Degraded"
    ready = conditions(changed)["Ready"]
    assert ready["reason"] == "SourceGone"
    assert f"the pinned shard {name!r} of 's3://{s3_bucket}/train/' is 20 bytes" in ready["message"]
    assert "the pinned data changed" in ready["message"]

    fs.delete_file(f"{s3_bucket}/train/{name}")
    gone = await check(obj, s3_server, probe=probe)
    assert conditions(gone)["Ready"]["message"].startswith(
        f"the pinned shard {name!r} of 's3://{s3_bucket}/train/' is not there any more: "
        "the pinned data is gone; new pods are refused"
    )
    older = {**obj, "status": {k: v for k, v in obj["status"].items() if k != "largestShard"}}
    assert (await check(older, s3_server, probe=probe)).status["phase"] == "Ready"


async def test_check_leaves_unpinned_mounts_to_reconcile(s3_server: S3Server) -> None:
    pending = dsm("s3://b/x/")
    pending["status"] = {"phase": "Pending"}
    assert (
        await reconcile.check_source(
            pending, read_secret=secrets_of(s3_server), probe=quick_probe, now=NOW
        )
        is None
    )


async def test_a_secret_the_operator_may_not_read_is_pending_with_the_fix(
    s3_server: S3Server, s3_bucket: str
) -> None:
    async def forbidden(namespace: str, name: str) -> Mapping[str, str] | None:
        raise PermissionError(f"the operator's identity may not get Secret {namespace}/{name}")

    result = await run(dsm(f"s3://{s3_bucket}/x/"), s3_server, read_secret=forbidden)
    assert result.status["phase"] == "Pending"
    ready = conditions(result)["Ready"]
    assert ready["reason"] == "SecretForbidden"
    assert "may not get Secret ml/s3-creds" in ready["message"]
    assert result.retry_in is not None


def wrong_key_secrets(server: S3Server) -> reconcile.SecretReader:
    wrong = {**server.env(), "AWS_SECRET_ACCESS_KEY": "not-the-key"}

    async def read_secret(namespace: str, name: str) -> Mapping[str, str] | None:
        return wrong

    return read_secret


async def test_wrong_credentials_are_rejected_naming_the_secret_and_heal_once_it_is_fixed(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """The real store's refusal (MinIO's 403) is `CredentialsRejected`, retried with
    the backoff, not `Invalid`: fixing the Secret alone brings the mount to Ready."""
    write_shards(s3_server, s3_bucket, "train", 1)
    obj = dsm(f"s3://{s3_bucket}/train/")
    rejected = await run(obj, s3_server, read_secret=wrong_key_secrets(s3_server), retry=1)
    assert rejected.status["phase"] == "Pending"
    ready = conditions(rejected)["Ready"]
    assert ready["reason"] == "CredentialsRejected"
    assert "Secret ml/s3-creds" in ready["message"] and "not-the-key" not in ready["message"]
    assert conditions(rejected)["SourceReachable"]["status"] == "False"
    assert rejected.retry_in == reconcile.Backoff().delay(1)

    obj["status"] = rejected.status
    fixed = await run(obj, s3_server, retry=2)
    assert fixed.status["phase"] == "Ready"
    assert [e.reason for e in fixed.events] == ["ManifestPinned"]


async def test_credentials_rotated_wrong_under_a_pinned_mount_are_not_reported_as_data_gone(
    s3_server: S3Server, s3_bucket: str, probe: reconcile.Prober
) -> None:
    write_shards(s3_server, s3_bucket, "train", 1)
    obj = dsm(f"s3://{s3_bucket}/train/")
    obj["status"] = (await run(obj, s3_server)).status
    rotated = await check(obj, s3_server, read_secret=wrong_key_secrets(s3_server), probe=probe)
    assert rotated.status["phase"] == "Degraded"
    ready = conditions(rotated)["Ready"]
    assert ready["reason"] == "CredentialsRejected", ready
    assert "Secret ml/s3-creds" in ready["message"]
    assert conditions(rotated)["SourceReachable"]["status"] == "False"
    assert rotated.status["manifestDigest"] == obj["status"]["manifestDigest"]

    obj["status"] = rotated.status
    back = await check(obj, s3_server, probe=probe)
    assert back.status["phase"] == "Ready"
    assert [e.reason for e in back.events] == ["SourceRecovered"]


async def test_a_listed_endpoint_is_read_and_the_same_one_unlisted_is_not_allowed(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """policy.sourceEndpoints through the operator's own resolve (`sources`)."""
    write_shards(s3_server, s3_bucket, "listed", 1)
    uri = f"s3://{s3_bucket}/listed/"

    def resolving(*entries: str) -> reconcile.Resolver:
        access = sources.Access(source_endpoints=tuple(map(endpoint_policy.entry, entries)))

        def resolve(uri: str, fmt: str, options: Mapping[str, str] | None) -> Any:
            return sources.resolve_manifest(uri, fmt, options, access=access, retry=FAST_RETRY)

        return resolve

    listed = await run(dsm(uri), s3_server, resolve=resolving(s3_server.endpoint_url))
    assert listed.status["phase"] == "Ready"
    assert listed.status["shards"] == 1
    for entries in [(), ("https://minio.storage.svc:9000",)]:
        refused = await run(dsm(uri), s3_server, resolve=resolving(*entries))
        assert refused.status["phase"] == "Pending"
        assert conditions(refused)["Ready"]["reason"] == "EndpointNotAllowed"
