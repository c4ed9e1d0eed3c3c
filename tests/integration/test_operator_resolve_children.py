"""The operator resolves a tenant's source in a child process it bounds and kills
(`resolve_children`; docs/security.md, "Starve other namespaces through the operator's
reads"): real child processes, real files, MinIO and a store on loopback that accepts
and never answers.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from shardcache_operator import (
    endpoint_policy,
    quiet_stores,
    reconcile,
    resolve_child,
    resolve_children,
    source_reads,
    sources,
)

from shardcache import errors, manifests, source
from shardcache.node import pinned_manifests
from tests.integration.test_operator_reconcile import write_shards
from tests.support import datasets
from tests.support.s3server import S3Server
from tests.support.stalling import stalling_endpoint

pytestmark = pytest.mark.integration

FILES = sources.Access(file_sources=True)
FAST_RETRY = source.RetryPolicy(attempts=2, initial_delay=0.05, max_delay=0.1)
#: A resolve of a few shards maps about 140 MiB (configuration.Settings.resolve_memory).
ROOMY = 256 << 20
NOW = "2026-01-01T00:00:00Z"


def listing(*endpoints: str) -> sources.Access:
    """Access to stores on loopback, which the operator reads only where the platform
    lists them (policy.sourceEndpoints)."""
    return sources.Access(source_endpoints=tuple(map(endpoint_policy.entry, endpoints)))


def children(memory: int = ROOMY, *, timeout: float = 60.0, **kwargs: Any) -> Any:
    return resolve_children.Resolver(memory=memory, timeout=timeout, retry=FAST_RETRY, **kwargs)


def in_process(uri: str, options: Any, access: sources.Access) -> manifests.Manifest:
    manifest = sources.resolve_manifest(uri, "parquet", options, access=access, retry=FAST_RETRY)
    assert isinstance(manifest, manifests.Manifest)
    return manifest


def test_a_file_source_resolved_in_a_child_pins_the_in_process_manifest(tmp_path: Path) -> None:
    uri, _ = datasets.write_local(tmp_path / "data", [30, 20, 10])
    child = children(access=FILES)(uri, "parquet", None)
    here = in_process(uri, None, FILES)
    assert child == resolve_child.Summary.of(here)
    assert child.handed == ()  # its namespace hands no manifests: none encoded
    assert child.digest == here.digest and child.shard_count == 3 and child.total_rows == 60
    assert child.largest_shard is not None
    assert child.largest_shard.path == here.shards[0].path  # the 30 rows: the largest file


def test_a_childs_answer_is_the_summary_and_the_handed_manifest_gzipped(tmp_path: Path) -> None:
    """What the operator reads back is the summary it pins, which does not grow with the
    shard count, and the manifest only as the gzipped parts it hands to the sidecars as
    they are, bounded (`handed_manifests.MAX_PARTS`): it never parses a manifest (which
    capped the shards any resolveMemory could pin at about 100,000, by its size)."""
    sizes = {}
    for count in (2, 400):
        uri = (tmp_path / f"ds{count}").as_uri()
        for i in range(count):
            (tmp_path / f"ds{count}" / f"part-{i:05d}.jsonl").parent.mkdir(exist_ok=True)
            (tmp_path / f"ds{count}" / f"part-{i:05d}.jsonl").write_text('{"a": 1}\n')
        # Off a gate thread the caller's namespace is "": handed there.
        child = children(access=FILES, hand_namespaces=frozenset({""}))(uri, "jsonl", None)
        assert child.shard_count == count and child.total_rows == count
        summary = {k: v for k, v in child.to_json().items() if k != "handed"}
        sizes[count] = len(json.dumps(summary))
        here = in_process_jsonl(uri)
        assert gzip.decompress(b"".join(child.handed)) == pinned_manifests.encode(here)
    assert sizes[400] - sizes[2] < 16  # the digits of the counts, nothing per shard


def in_process_jsonl(uri: str) -> manifests.Manifest:
    manifest = sources.resolve_manifest(uri, "jsonl", None, access=FILES, retry=FAST_RETRY)
    assert isinstance(manifest, manifests.Manifest)
    return manifest


def test_an_s3_source_resolved_in_a_child_pins_the_in_process_manifest(
    s3_server: S3Server, s3_bucket: str
) -> None:
    write_shards(s3_server, s3_bucket, "train", 3)
    uri = f"s3://{s3_bucket}/train/"
    access = listing(s3_server.endpoint_url)
    child = children(access=access)(uri, "parquet", s3_server.env())
    assert child == resolve_child.Summary.of(in_process(uri, s3_server.env(), access))


def test_without_a_secret_the_child_reads_anonymously_not_with_the_operators_environment(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child inherits the operator's environment; holding the store's real keys
    there must not let a mount without a secretRef read a private bucket."""
    write_shards(s3_server, s3_bucket, "train", 1)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    options = {"AWS_ENDPOINT_URL": s3_server.endpoint_url, "AWS_REGION": s3_server.region}
    with pytest.raises(errors.AccessDeniedError):
        children(access=listing(s3_server.endpoint_url))(
            f"s3://{s3_bucket}/train/", "parquet", options
        )


def failure(call: Any, *args: Any) -> tuple[type[BaseException], str]:
    """The class and message of what `call(*args)` raises."""
    with pytest.raises(Exception) as caught:
        call(*args)
    return type(caught.value), str(caught.value)


def test_each_error_comes_back_as_the_in_process_class_and_message(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    write_shards(s3_server, s3_bucket, "train", 1)
    refused_port = free_port()
    wrong_key = {**s3_server.env(), "AWS_SECRET_ACCESS_KEY": "not-the-key"}
    unreachable = {**s3_server.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{refused_port}"}
    (tmp_path / "empty").mkdir()
    stores = listing(s3_server.endpoint_url, unreachable["AWS_ENDPOINT_URL"])
    cases = [
        # (uri, options, access, expected class)
        (f"file://{tmp_path}/missing/", None, FILES, errors.InputError),
        (f"file://{tmp_path}/empty/", None, FILES, errors.InputError),
        (f"file://{tmp_path}/data/", None, sources.Access(), reconcile.SourceRefused),
        (f"s3://{s3_bucket}/train/", wrong_key, stores, errors.AccessDeniedError),
        (f"s3://{s3_bucket}/train/", unreachable, stores, errors.SourceError),
    ]
    for uri, options, access, expected in cases:
        child = failure(children(access=access), uri, "parquet", options)
        here = failure(in_process, uri, options, access)
        assert here[0] is expected, here
        if expected is errors.SourceError:
            # The retries' count and timing are in the message; the class and what failed
            # are the same.
            assert child[0] is expected and f"127.0.0.1:{refused_port}" in child[1], child
        else:
            assert child == here


def many_files(root: Path, count: int) -> str:
    """`count` JSON Lines shards of one row: a listing and its shards that outgrow a
    small limit, as a prefix of millions of keys outgrows the default one. Not empty
    files: an empty Parquet file fails the resolve as unreadable before the listing's
    size tells, now that shards are inspected a window at a time."""
    root.mkdir()
    for i in range(count):
        (root / f"part-{i:07d}.jsonl").write_bytes(b'{"a": 0}\n')
    return f"file://{root}/"


async def test_a_child_over_its_memory_limit_fails_the_resolve_saying_which_limit_to_raise(
    tmp_path: Path,
) -> None:
    resolver = children(128 << 20, access=FILES)
    gate = source_reads.Gate(per_namespace=1)
    uri = many_files(tmp_path / "huge", 60_000)
    result = await reconcile.reconcile(
        {
            "metadata": {"name": "huge", "namespace": "ml", "generation": 1},
            "spec": {"source": {"uri": uri, "format": "jsonl"}},
        },
        read_secret=secrets_of_nobody,
        resolve=resolver,
        probe=lambda uri, options, **_: None,
        now=NOW,
        reads=gate,
    )
    assert result.status["phase"] == "Degraded"
    ready = {c["type"]: c for c in result.status["conditions"]}["Ready"]
    assert ready["reason"] == "ResolveOverMemory", ready
    assert "memory limit of 128 MiB" in ready["message"]
    assert "raise operator.settings.resolveMemory" in ready["message"]
    assert result.retry_in is not None
    # The operator (this process) is unharmed, its slot is back and no child is left; a
    # source that fits resolves on the same slot.
    assert gate.running("ml") == 0 and resolver.running() == []
    small, _ = datasets.write_local(tmp_path / "small", [10])
    assert await gate.run("ml", lambda: resolver(small, "parquet", None), timeout=60, what="x")


async def secrets_of_nobody(namespace: str, name: str) -> None:
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_child_reading_a_store_that_never_answers_is_killed_at_the_timeout() -> None:
    """Its process is gone and its namespace's slot back once the caller's timeout
    passes, while the store still holds the connection: before, the read's thread kept
    the slot until the store answered."""
    secret = "tenant-secret-" + os.urandom(4).hex()
    gate = source_reads.Gate(per_namespace=1)
    with stalling_endpoint() as endpoint:
        resolver = children(access=listing(endpoint))
        options = {
            "AWS_ACCESS_KEY_ID": "AKIATENANT",
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_ENDPOINT_URL": endpoint,
        }
        read = asyncio.ensure_future(
            gate.run(
                "ml",
                lambda: resolver("s3://bucket/data/", "parquet", options),
                timeout=3.0,
                what="resolving",
            )
        )
        pids = await started(resolver)
        (pid,) = pids
        # The Secret's keys reach the child on stdin, never where `ps` shows them.
        assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert secret.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
        with pytest.raises(TimeoutError):
            await read
        assert await slots_back(gate, "ml")
        assert resolver.running() == []
        assert not Path(f"/proc/{pid}").exists()


async def started(resolver: resolve_children.Resolver) -> list[int]:
    """The pids of the resolver's children once one has started (within 30 s)."""
    for _ in range(3000):
        if resolver.running():
            return resolver.running()
        await asyncio.sleep(0.01)
    raise AssertionError("no child started")


async def slots_back(gate: source_reads.Gate, namespace: str) -> bool:
    """Whether every read of `namespace` handed its slot back within 10 s (the store
    above never answers: on threads reading it in-process, never)."""
    for _ in range(1000):
        if gate.running(namespace) == 0:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_closing_the_resolver_kills_its_children_and_refuses_new_resolves() -> None:
    """What the operator does when it stops: no child outlives it."""
    with stalling_endpoint() as endpoint:
        resolver = children(access=listing(endpoint))
        options = {"AWS_ENDPOINT_URL": endpoint}
        loop = asyncio.get_running_loop()
        read = loop.run_in_executor(None, lambda: resolver("s3://bucket/data/", "parquet", options))
        (pid,) = await started(resolver)
        resolver.close()
        with pytest.raises(errors.SourceError, match="the operator stopped while resolving"):
            await read
        assert not Path(f"/proc/{pid}").exists()
        with pytest.raises(errors.SourceError, match="the operator is stopping"):
            resolver("s3://bucket/data/", "parquet", options)


async def test_namespaces_resolving_at_once_never_run_more_children_than_the_cap() -> None:
    """Four namespaces resolve a store that never answers at once, with room for two
    children: two run until their timeout, the other two wait that long for a slot
    and fail saying the operator's resolves are busy; never a third child."""
    gate = source_reads.Gate()
    with stalling_endpoint() as endpoint:
        resolver = children(access=listing(endpoint), children=2)
        options = {"AWS_ENDPOINT_URL": endpoint}
        most = 0
        reads = asyncio.gather(
            *(
                reconcile.reconcile(
                    {
                        "metadata": {"name": "stalled", "namespace": f"team-{i}", "generation": 1},
                        "spec": {"source": {"uri": "s3://bucket/data/"}},
                    },
                    read_secret=secrets_of_nobody,
                    resolve=lambda uri, fmt, _: resolver(uri, fmt, options),
                    probe=lambda uri, options, **_: None,
                    now=NOW,
                    reads=gate,
                    timeout=3.0,
                )
                for i in range(4)
            )
        )
        while not reads.done():
            most = max(most, len(resolver.running()))
            await asyncio.sleep(0.005)
        results = await reads
    reasons = sorted(
        {c["type"]: c for c in r.status["conditions"]}["Ready"]["reason"] for r in results
    )
    assert most == 2
    assert reasons == ["ResolveTimeout", "ResolveTimeout", "ResolvesBusy", "ResolvesBusy"]
    busy = next(r for r in results if "ResolvesBusy" in str(r.status))
    ready = {c["type"]: c for c in busy.status["conditions"]}["Ready"]
    assert "the operator's resolves are all busy, not the source" in ready["message"]
    # The children are killed at their timeout, and their slots come back with them.
    for _ in range(1000):
        if resolver.slots.running() == 0 and resolver.running() == []:
            break
        await asyncio.sleep(0.01)
    assert resolver.slots.running() == 0 and resolver.running() == []


async def test_a_store_that_failed_a_resolve_slowly_is_left_alone_for_its_namespace() -> None:
    """The store never answers: the first resolve holds its child through the store's
    request timeouts and retries, then fails (SourceError); the namespace's next
    resolve of the same store fails at once, with no child, saying when it is tried
    again; another namespace's resolve of it is still made."""
    gate = source_reads.Gate()
    with stalling_endpoint() as endpoint:
        resolver = children(
            access=listing(endpoint), quiet=quiet_stores.Quiet(after=0.5, hold=60.0)
        )
        options = {"AWS_ENDPOINT_URL": endpoint, source.ENV_S3_REQUEST_TIMEOUT: "1"}

        async def resolve(namespace: str, uri: str) -> None:
            await gate.run(
                namespace,
                lambda: resolver(uri, "parquet", options),
                timeout=30.0,
                what=f"resolving {uri}",
            )

        with pytest.raises(errors.SourceError) as first:
            await resolve("ml", "s3://bucket/data/")
        assert not isinstance(first.value, quiet_stores.Unanswered)
        started_at = time.monotonic()
        with pytest.raises(quiet_stores.Unanswered) as again:
            await resolve("ml", "s3://bucket/other/")
        assert time.monotonic() - started_at < 1
        message = str(again.value)
        assert "resolving the manifest of s3://bucket/other/: not read now" in message
        assert re.search(r"failed after \d+ s, 0 s ago; the operator reads it again in", message)
        with pytest.raises(errors.SourceError) as elsewhere:
            await resolve("team-b", "s3://bucket/data/")
        assert not isinstance(elsewhere.value, quiet_stores.Unanswered)
        assert resolver.running() == []
