"""What status says, and when the operator tries again, for each way a source fails.

`Invalid` (no retry) is kept for a source the operator does not read at all; refused
credentials, a Secret whose keys can only fail, and data that is missing or changed
are fixed outside the spec, so they are retried and heal once fixed (docs/operator.md,
"Status, phases and conditions")."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
from shardcache_operator import quiet_stores, read_workers, reconcile, resolve_slots, status

from shardcache import errors
from tests.unit.test_reconcile_events import DIGEST, FakeManifest

pytestmark = pytest.mark.unit

OTHER = "sha256:" + "cd" * 32
GOOD_SECRET = {"AWS_ACCESS_KEY_ID": "AKIAGOOD", "AWS_SECRET_ACCESS_KEY": "s3cr3t-value"}
BACKOFF = reconcile.Backoff(initial_seconds=2, max_seconds=120)
DENIED = (
    "listing s3://bucket/data/: When getting information for key 'data' in bucket "
    "'bucket': AWS Error ACCESS_DENIED during HeadObject operation: No response body."
)


def mount(**source: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "data", "namespace": "ml", "generation": 1},
        "spec": {"source": {"uri": "s3://bucket/data/", "secretRef": {"name": "creds"}, **source}},
    }


def resolver(
    *failures: BaseException, digest: str = DIGEST
) -> Callable[[str, str, Mapping[str, str] | None], FakeManifest]:
    """Raises `failures` in turn, then resolves to `digest`."""
    left = list(failures)

    def resolve(uri: str, fmt: str, options: Mapping[str, str] | None) -> FakeManifest:
        if left:
            raise left.pop(0)
        return FakeManifest(digest=digest)

    return resolve


def answers(uri: str, options: Mapping[str, str] | None) -> None:
    return None


def secret_of(data: Mapping[str, str]) -> reconcile.SecretReader:
    async def read(namespace: str, name: str) -> Mapping[str, str] | None:
        return data

    return read


async def run(
    obj: dict[str, Any],
    resolve: reconcile.Resolver,
    *,
    secret: Mapping[str, str] = GOOD_SECRET,
    probe: reconcile.Prober = answers,
    retry: int = 0,
) -> reconcile.Result:
    return await reconcile.reconcile(
        obj,
        read_secret=secret_of(secret),
        resolve=resolve,
        probe=probe,
        now="t",
        retry=retry,
        backoff=BACKOFF,
    )


def conditions(result: reconcile.Result) -> dict[str, dict[str, Any]]:
    return conditions_of(result.status)


def conditions_of(status: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


async def test_refused_credentials_name_the_secret_and_are_retried_with_backoff() -> None:
    result = await run(mount(), resolver(errors.AccessDeniedError(DENIED)), retry=2)
    assert result.status["phase"] == "Pending"
    ready, reachable = conditions(result)["Ready"], conditions(result)["SourceReachable"]
    assert ready["reason"] == "CredentialsRejected"
    assert "Secret ml/creds" in ready["message"] and "ACCESS_DENIED" in ready["message"]
    # The store refused: not "the source answered".
    assert (reachable["status"], reachable["reason"]) == ("False", "CredentialsRejected")
    assert result.retry_in == BACKOFF.delay(2)
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "CredentialsRejected")]


async def test_fixing_the_secret_after_refused_credentials_pins_the_manifest() -> None:
    obj = mount()
    resolve = resolver(errors.AccessDeniedError(DENIED))
    obj["status"] = (await run(obj, resolve)).status
    healed = await run(obj, resolve, retry=1)
    assert healed.status["phase"] == "Ready"
    assert healed.status["manifestDigest"] == DIGEST
    assert [e.reason for e in healed.events] == ["ManifestPinned"]


async def test_refused_credentials_without_a_secret_say_the_request_had_none() -> None:
    obj = mount()
    del obj["spec"]["source"]["secretRef"]
    result = await run(obj, resolver(errors.AccessDeniedError(DENIED)))
    message = conditions(result)["Ready"]["message"]
    assert "without credentials" in message and "no secretRef" in message


async def test_rotated_wrong_credentials_of_a_pinned_mount_are_not_reported_as_data_gone() -> None:
    obj = mount()
    obj["status"] = (await run(obj, resolver())).status

    def denied(uri: str, options: Mapping[str, str] | None) -> None:
        raise errors.AccessDeniedError(DENIED)

    result = await reconcile.check_source(
        obj, read_secret=secret_of(GOOD_SECRET), probe=denied, now="t2"
    )
    assert result is not None
    assert result.status["phase"] == "Degraded"
    ready, reachable = conditions(result)["Ready"], conditions(result)["SourceReachable"]
    assert ready["reason"] == "CredentialsRejected" and "Secret ml/creds" in ready["message"]
    assert reachable["status"] == "False"
    # The pin stays: running pods keep their dataset.
    assert result.status["manifestDigest"] == DIGEST
    assert conditions(result)["ManifestResolved"]["reason"] == "Pinned"


@pytest.mark.parametrize(
    "error",
    [
        errors.InputError("listing s3://bucket/data/: nothing found at 's3://bucket/data/'"),
        errors.InputError("listing s3://no-bucket/x/: AWS Error NO_SUCH_BUCKET"),
        errors.InputError("empty dataset at 's3://bucket/data/': expected at least one shard"),
    ],
    ids=["missing-prefix", "missing-bucket", "empty-prefix"],
)
async def test_missing_data_is_degraded_and_retried_slowly_until_it_is_there(
    error: errors.InputError,
) -> None:
    obj = mount()
    resolve = resolver(error)
    failed = await run(obj, resolve)
    assert failed.status["phase"] == "Degraded"
    assert conditions(failed)["Ready"]["reason"] == "InvalidData"
    assert str(error) in conditions(failed)["Ready"]["message"]
    assert failed.retry_in == BACKOFF.max_seconds
    obj["status"] = failed.status
    assert (await run(obj, resolve, retry=1)).status["phase"] == "Ready"


async def test_a_digest_mismatch_is_retried_slowly_and_heals_when_the_data_is_restored() -> None:
    obj = mount(version=DIGEST)
    changed = resolver(digest=OTHER)
    failed = await run(obj, changed)
    assert failed.status["phase"] == "Degraded"
    ready = conditions(failed)["Ready"]
    assert ready["reason"] == "DigestMismatch"
    assert DIGEST in ready["message"] and OTHER in ready["message"]
    assert failed.retry_in == BACKOFF.max_seconds
    obj["status"] = failed.status
    restored = await run(obj, resolver(digest=DIGEST), retry=1)
    assert restored.status["phase"] == "Ready"


async def test_a_source_the_operator_does_not_read_is_invalid_and_not_retried() -> None:
    refused = reconcile.SourceRefused("file:// sources are not resolved by the operator")
    result = await run(mount(uri="file:///data"), resolver(refused))
    assert result.status["phase"] == "Invalid"
    assert conditions(result)["Ready"]["reason"] == "InvalidSource"
    assert result.retry_in is None


@pytest.mark.parametrize(
    ("secret", "named"),
    [
        ({"AWS_ACCESS_KEY_ID": "AKIAGOOD"}, "AWS_SECRET_ACCESS_KEY"),
        ({"AWS_SECRET_ACCESS_KEY": "s3cr3t-value"}, "AWS_ACCESS_KEY_ID"),
        ({**GOOD_SECRET, "AWS_ACCESS_KEY_ID": "AKIAGOOD\n"}, "AWS_ACCESS_KEY_ID"),
        ({**GOOD_SECRET, "AWS_SECRET_ACCESS_KEY": " s3cr3t-value"}, "AWS_SECRET_ACCESS_KEY"),
        (
            {**GOOD_SECRET, "AWS_ENDPOINT_URL": "http://AKIAGOOD:s3cr3t-value@minio:9000"},
            "AWS_ENDPOINT_URL",
        ),
    ],
    ids=["no-secret-key", "no-key-id", "newline", "leading-space", "endpoint-userinfo"],
)
async def test_a_secret_whose_keys_can_only_fail_is_named_without_its_values(
    secret: dict[str, str], named: str
) -> None:
    calls: list[str] = []

    def resolve(uri: str, fmt: str, options: Mapping[str, str] | None) -> FakeManifest:
        calls.append(uri)
        return FakeManifest()

    result = await run(mount(), resolve, secret=secret, retry=1)
    assert result.status["phase"] == "Pending"
    ready = conditions(result)["Ready"]
    assert ready["reason"] == "SecretInvalid"
    assert "Secret ml/creds" in ready["message"] and named in ready["message"]
    texts = [c["message"] for c in result.status["conditions"]] + [e.message for e in result.events]
    assert not any("AKIAGOOD" in t or "s3cr3t-value" in t for t in texts), texts
    assert conditions(result)["SourceReachable"]["status"] == "Unknown"
    assert result.retry_in == BACKOFF.delay(1)
    assert calls == [], "the source was read with a Secret that can only fail"


async def test_a_secret_with_neither_key_reads_anonymously() -> None:
    seen: list[Mapping[str, str] | None] = []

    def resolve(uri: str, fmt: str, options: Mapping[str, str] | None) -> FakeManifest:
        seen.append(options)
        return FakeManifest()

    endpoint_only = {"AWS_ENDPOINT_URL": "http://minio:9000"}
    result = await run(mount(), resolve, secret=endpoint_only)
    assert result.status["phase"] == "Ready"
    assert seen == [endpoint_only]


async def test_a_secret_broken_after_the_pin_degrades_the_mount_and_keeps_the_pin() -> None:
    obj = mount()
    obj["status"] = (await run(obj, resolver())).status
    result = await reconcile.check_source(
        obj,
        read_secret=secret_of({"AWS_ACCESS_KEY_ID": "AKIAGOOD"}),
        probe=answers,
        now="t2",
    )
    assert result is not None
    assert result.status["phase"] == "Degraded"
    assert conditions(result)["Ready"]["reason"] == "SecretInvalid"
    assert result.status["manifestDigest"] == DIGEST


async def test_a_check_looks_for_the_shard_the_pin_recorded_else_at_the_root() -> None:
    obj = mount()
    obj["status"] = (await run(obj, resolver())).status
    asked: list[object] = []

    def records(
        uri: str, options: Mapping[str, str] | None, *, shard: object = "not given"
    ) -> None:
        asked.append(shard)

    # A pin without status.largestShard (the fake manifest records none; an older
    # operator's pin): the root.
    await reconcile.check_source(obj, read_secret=secret_of(GOOD_SECRET), probe=records, now="t2")
    obj["status"]["largestShard"] = {"path": "part-7.parquet", "bytes": 4096}
    await reconcile.check_source(obj, read_secret=secret_of(GOOD_SECRET), probe=records, now="t3")
    await run(obj, resolver(), probe=records)  # a reconcile of the kept pin checks it too
    assert asked == ["not given", ("part-7.parquet", 4096), ("part-7.parquet", 4096)]


async def test_a_check_that_got_no_read_worker_changes_no_status() -> None:
    """Other namespaces' reads held every worker: nothing is known of this store, so
    the check-source timer leaves the mount as it was (Degraded would page someone)."""
    obj = mount()
    obj["status"] = (await run(obj, resolver())).status

    def busy(uri: str, options: Mapping[str, str] | None) -> None:
        raise resolve_slots.AllBusy("checking s3://bucket/data/: the operator's periodic reads")

    result = await reconcile.check_source(
        obj, read_secret=secret_of(GOOD_SECRET), probe=busy, now="t2"
    )
    assert result is None


def busy_probe(
    slots: resolve_slots.Slots,
) -> reconcile.Prober:
    """A check that waits for the one read worker, which another namespace holds."""

    def busy(uri: str, options: Mapping[str, str] | None) -> None:
        with slots.held("ml", timeout=0.05, what="checking s3://bucket/data/"):
            raise AssertionError("the only worker is another namespace's")

    return busy


async def test_a_spec_updates_check_that_got_no_read_worker_is_degraded_and_retried_with_backoff() -> (
    None
):
    """A spec update's reconcile of a pinned mount writes its status: there ChecksBusy
    is Degraded with the pin kept (the update may name another Secret, so another
    store), retried with the backoff, and its message says so."""
    obj = mount()
    obj["status"] = (await run(obj, resolver())).status
    obj["metadata"]["generation"] = 2
    slots = resolve_slots.Slots(1, read_workers.READS, share=1)
    with slots.held("other", timeout=1, what="another namespace's read"):
        result = await run(obj, resolver(), probe=busy_probe(slots), retry=3)
    assert result.status["phase"] == "Degraded"
    ready = conditions(result)["Ready"]
    assert ready["reason"] == reconcile.CHECKS_BUSY
    assert "periodic reads are all busy, not the source" in ready["message"]
    assert "(from a spec update's reconcile: with backoff)" in ready["message"]
    assert result.retry_in == BACKOFF.delay(3)
    assert result.status["manifestDigest"] == DIGEST


async def test_a_restarts_check_that_got_no_read_worker_leaves_a_ready_mount_ready() -> None:
    """An operator restart's reconcile (same generation) of a Ready mount whose check got
    no worker changes nothing, as the timer's check does: other namespaces' reads
    holding every worker must not refuse this namespace's pods. The next check tries."""
    obj = mount()
    obj["status"] = (await run(obj, resolver())).status
    before = conditions(await run(obj, resolver()))["Ready"]
    slots = resolve_slots.Slots(1, read_workers.READS, share=1)
    with slots.held("other", timeout=1, what="another namespace's read"):
        result = await run(obj, resolver(), probe=busy_probe(slots), retry=3)
    assert result.status["phase"] == "Ready"
    assert conditions(result)["Ready"] == before
    assert result.status["manifestDigest"] == DIGEST
    assert result.retry_in is None
    assert result.events == ()


async def test_a_restarts_check_that_got_no_read_worker_leaves_a_degraded_mount_as_it_was() -> None:
    """Not made Ready by a check that never ran, nor given ChecksBusy for its reason (a
    Warning, and an alert by reason flapping, at every restart): its reason and message
    stay, and it is retried as before."""
    obj = mount()
    obj["status"] = (await run(obj, resolver())).status

    def down(uri: str, options: Mapping[str, str] | None) -> None:
        raise errors.SourceError("checking s3://bucket/data/: failed after 5 attempts")

    obj["status"] = (await run(obj, resolver(), probe=down)).status
    before = conditions_of(obj["status"])
    assert before["Ready"]["reason"] == "SourceUnreachable"
    slots = resolve_slots.Slots(1, read_workers.READS, share=1)
    with slots.held("other", timeout=1, what="another namespace's read"):
        still = await run(obj, resolver(), probe=busy_probe(slots), retry=3)
    assert still.status["phase"] == "Degraded"
    assert conditions(still) == before
    assert still.events == ()
    assert still.retry_in == BACKOFF.delay(3)
    assert still.status["manifestDigest"] == DIGEST


async def test_a_store_left_alone_is_retried_when_it_is_read_again_not_sooner() -> None:
    """A retry before the store's hold ends would fail the same way and write a status
    that differs only in its seconds: the backoff's delay, or the hold's end if later."""
    left_alone = quiet_stores.Unanswered("resolving s3://bucket/data/: not read now", left=200.0)
    result = await run(mount(), resolver(left_alone), retry=1)
    assert conditions(result)["Ready"]["reason"] == "SourceUnreachable"
    assert result.retry_in == 200.0
    late = await run(mount(), resolver(quiet_stores.Unanswered("m", left=1.0)), retry=5)
    assert late.retry_in == BACKOFF.delay(5)
    # A pinned mount's check from a reconcile (a restart) is retried the same way.
    obj = mount()
    obj["status"] = (await run(obj, resolver())).status

    def left(uri: str, options: Mapping[str, str] | None) -> None:
        raise quiet_stores.Unanswered("checking s3://bucket/data/: not read now", left=90.0)

    checked = await run(obj, resolver(), probe=left)
    assert checked.status["phase"] == "Degraded" and checked.retry_in == 90.0


async def test_a_check_over_its_workers_memory_degrades_the_mount_naming_it_and_keeps_the_pin() -> (
    None
):
    obj = mount()
    obj["status"] = (await run(obj, resolver())).status

    def over(uri: str, options: Mapping[str, str] | None) -> None:
        raise reconcile.ResolveOverMemory("the read went over its memory limit of 256 MiB")

    result = await reconcile.check_source(
        obj, read_secret=secret_of(GOOD_SECRET), probe=over, now="t2"
    )
    assert result is not None
    assert result.status["phase"] == "Degraded"
    ready = conditions(result)["Ready"]
    assert ready["reason"] == "CheckOverMemory"
    assert ready["message"] == (
        "checking s3://bucket/data/: the read went over its memory limit of 256 MiB"
    )
    assert result.status["manifestDigest"] == DIGEST


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (status.Failed(status.Phase.PENDING, "CredentialsRejected", "m", reachable=False), 8.0),
        (status.Failed(status.Phase.PENDING, "SecretInvalid", "m", reachable=None), 8.0),
        (status.Failed(status.Phase.DEGRADED, "SourceUnreachable", "m", reachable=False), 8.0),
        (status.Failed(status.Phase.DEGRADED, "InvalidData", "m", reachable=True), 120.0),
        (status.Failed(status.Phase.DEGRADED, "DigestMismatch", "m", reachable=True), 120.0),
        (status.Failed(status.Phase.DEGRADED, "SourceGone", "m", reachable=True), 120.0),
        (status.Failed(status.Phase.INVALID, "InvalidSpec", "m", reachable=None), None),
        (status.Resolved(digest=DIGEST, format="parquet", shards=1, rows=1, bytes=1), None),
    ],
)
def test_retry_delay_is_the_backoff_for_fixable_failures_and_its_cap_for_the_sources_data(
    outcome: status.Outcome, expected: float | None
) -> None:
    assert reconcile.retry_delay(outcome, retry=2, backoff=BACKOFF) == expected


async def test_a_store_that_does_not_answer_is_said_with_where_to_look() -> None:
    """SourceUnreachable carries the store's error and where to look; a pinned mount's
    also what it means for its pods. A store left alone says why itself."""
    down = errors.SourceError("listing s3://bucket/data/: failed after 5 attempts in 30.0 s")
    result = await run(mount(), resolver(down))
    message = conditions(result)["Ready"]["message"]
    assert message.startswith(str(down) + "; check the store's endpoint (the Secret's ")
    assert "network from the operator's pod" in message
    assert "new pods are refused" not in message  # nothing was admitted before a pin

    obj = mount()
    obj["status"] = (await run(obj, resolver())).status

    def unanswered(uri: str, options: Mapping[str, str] | None) -> None:
        raise errors.SourceError("checking s3://bucket/data/: failed after 5 attempts")

    checked = await run(obj, resolver(), probe=unanswered)
    message = conditions(checked)["Ready"]["message"]
    assert "new pods are refused, running ones keep reading their cache" in message
    assert "check the store's endpoint" in message

    left_alone = quiet_stores.Unanswered("resolving s3://bucket/data/: not read now", left=9.0)
    quiet = await run(mount(), resolver(left_alone))
    assert conditions(quiet)["Ready"]["message"] == str(left_alone)


async def test_an_unexpected_error_names_its_class_and_where_its_traceback_is() -> None:
    """ResolveFailed and CheckFailed are bugs or unforeseen library errors: the message
    gives the class, the text and the log line to find, not a bare repr."""
    result = await run(mount(), resolver(KeyError("shards")))
    ready = conditions(result)["Ready"]
    assert ready["reason"] == "ResolveFailed"
    assert ready["message"] == (
        "unexpected error while resolving s3://bucket/data/: KeyError: 'shards'; the "
        'operator\'s log has its traceback ("resolving ... failed unexpectedly"): please '
        "report it (tried again)"
    )
    obj = mount()
    obj["status"] = (await run(obj, resolver())).status

    def broken(uri: str, options: Mapping[str, str] | None) -> None:
        raise ZeroDivisionError("division by zero")

    checked = await run(obj, resolver(), probe=broken)
    ready = conditions(checked)["Ready"]
    assert ready["reason"] == "CheckFailed"
    assert (
        "ZeroDivisionError: division by zero; the operator's log has its traceback"
        in (ready["message"])
    )
    assert '("checking ... failed unexpectedly")' in ready["message"]


async def test_a_pinned_shard_gone_says_how_to_restore_or_pin_anew() -> None:
    obj = mount()
    obj["status"] = (await run(obj, resolver())).status

    def gone(uri: str, options: Mapping[str, str] | None) -> None:
        raise errors.InputError(
            "nothing found at 's3://bucket/data/' any more: the pinned data is gone"
        )

    checked = await run(obj, resolver(), probe=gone)
    ready = conditions(checked)["Ready"]
    assert ready["reason"] == "SourceGone" and checked.status["phase"] == "Degraded"
    assert ready["message"].startswith("nothing found at 's3://bucket/data/' any more")
    assert (
        "restore the pinned data, or pin anew by changing the source's uri or version"
        in (ready["message"])
    )
