"""A pinned shard the sidecar cannot decode in its memory limit is also a status
condition, ShardTooLargeToDecode, not only a Warning Event (Events expire
after an hour; `kubectl get -o yaml` and dashboards read status). The pin records its
largest shard (status.largestShard, and each status.mixture entry's), so a kept pin is
judged again when the limit changes (`status.decode_room_condition`; docs/operator.md,
"Status, phases and conditions")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jsonschema
import pytest
from shardcache_operator import reconcile, shard_room, status

from shardcache import errors
from tests.support.shard_room_mounts import (
    DIGEST,
    OTHER_DIGEST,
    SHARDS,
    Manifest,
    MiB,
    Shard,
    answers,
    mount,
    no_secret,
    not_listed,
    respecified,
    serves,
    serves_mixture,
    with_further_source,
)
from tests.unit.test_crd import committed_schema

pytestmark = pytest.mark.unit


async def reconciled(
    obj: dict[str, Any], resolve: reconcile.Resolver, *, now: str = "2026-11-28T10:00:00Z"
) -> reconcile.Result:
    result = await reconcile.reconcile(
        obj, read_secret=no_secret, resolve=resolve, probe=answers, now=now
    )
    obj["status"] = result.status
    return result


def condition(found: Mapping[str, Any]) -> dict[str, Any]:
    (entry,) = [c for c in found["conditions"] if c["type"] == status.SHARD_TOO_LARGE_TO_DECODE]
    return dict(entry)


async def test_a_shard_over_the_room_sets_the_condition_naming_it_and_by_how_much() -> None:
    obj = mount()
    result = await reconciled(obj, serves(Manifest(SHARDS)))
    found = condition(result.status)
    assert (found["status"], found["reason"]) == ("True", "OverDecodeRoom")
    message = found["message"]
    assert message.startswith("spec.source: shard 'part-1.parquet' is 900Mi at the source")
    # 900Mi against the default 1Gi limit's 768Mi room: 132Mi over, and what to set.
    assert "132Mi over the 768Mi the sidecar can decode a shard in" in message
    assert "Set spec.sidecar.resources.limits.memory to at least 1156Mi" in message
    assert found["observedGeneration"] == 1
    assert result.status["largestShard"] == {"path": "part-1.parquet", "bytes": 900 * MiB}
    # The pin's Event says the same, once.
    (event,) = [e for e in result.events if e.reason == shard_room.REASON]
    assert event.message == message


async def test_raising_the_limit_on_a_kept_pin_clears_the_condition() -> None:
    obj = mount()
    await reconciled(obj, serves(Manifest(SHARDS)))
    respecified(obj, "1156Mi")
    result = await reconciled(obj, not_listed, now="2026-11-28T11:00:00Z")
    found = condition(result.status)
    assert (found["status"], found["reason"]) == ("False", "WithinDecodeRoom")
    assert "'part-1.parquet' 900Mi (0 to spare)" in found["message"]
    assert "within the 900Mi the sidecar can decode a shard in" in found["message"]
    assert found["lastTransitionTime"] == "2026-11-28T11:00:00Z"
    assert found["observedGeneration"] == 2
    assert result.status["manifestDigest"] == DIGEST


async def test_a_reconcile_of_an_unchanged_mount_leaves_the_condition_as_it_was() -> None:
    """An operator restart resumes every mount: the condition is judged again from what
    the pin recorded, to the same entry (no status change, docs/e2e.md test_restart)."""
    obj = mount()
    first = await reconciled(obj, serves(Manifest(SHARDS)))
    again = await reconciled(obj, not_listed, now="2026-11-28T12:00:00Z")
    assert condition(again.status) == condition(first.status)
    assert again.status["largestShard"] == first.status["largestShard"]
    assert [e.reason for e in again.events] == []


async def test_lowering_the_limit_on_a_kept_pin_sets_the_condition() -> None:
    """The condition follows the limit, not only the pin."""
    obj = mount(memory="2Gi")
    first = await reconciled(obj, serves(Manifest(SHARDS)))
    assert condition(first.status)["status"] == "False"
    respecified(obj, "1Gi")
    again = await reconciled(obj, not_listed, now="2026-11-28T11:00:00Z")
    found = condition(again.status)
    assert (found["status"], found["reason"]) == ("True", "OverDecodeRoom")
    assert "132Mi over the 768Mi" in found["message"]


def warnings(result: reconcile.Result) -> list[reconcile.Event]:
    return [e for e in result.events if e.reason == shard_room.REASON]


def unreachable(
    uri: str, options: Mapping[str, str] | None, *, shard: reconcile.PinnedShard | None = None
) -> None:
    raise errors.SourceError(f"{uri} did not answer")


async def test_lowering_the_limit_on_a_kept_pin_posts_one_warning_event() -> None:
    """The Event comes with the condition's move to True, whatever moved it, once: not
    again while it stays True, and again after it was False."""
    obj = mount(memory="2Gi")
    assert warnings(await reconciled(obj, serves(Manifest(SHARDS)))) == []
    respecified(obj, "1Gi")
    lowered = await reconciled(obj, not_listed, now="2026-11-28T11:00:00Z")
    (event,) = warnings(lowered)
    assert event.type == "Warning"
    assert event.message == condition(lowered.status)["message"]
    assert event.message.startswith("spec.source: shard 'part-1.parquet' is 900Mi")
    # Every reconcile judges the condition again (an operator restart): no Event spam.
    assert warnings(await reconciled(obj, not_listed, now="2026-11-28T12:00:00Z")) == []
    respecified(obj, "2Gi")
    assert warnings(await reconciled(obj, not_listed)) == []
    respecified(obj, "1Gi")
    assert len(warnings(await reconciled(obj, not_listed))) == 1


async def test_a_limit_lowered_while_the_source_is_down_is_warned_too() -> None:
    """A failure keeps the pin, which is judged again against the new limit."""
    obj = mount(memory="2Gi")
    await reconciled(obj, serves(Manifest(SHARDS)))
    respecified(obj, "1Gi")
    down = await reconcile.reconcile(
        obj, read_secret=no_secret, resolve=not_listed, probe=unreachable, now="t"
    )
    assert down.status["phase"] == "Degraded"
    assert condition(down.status)["status"] == "True"
    assert [(e.type, e.reason) for e in down.events] == [
        ("Warning", "SourceUnreachable"),
        ("Warning", shard_room.REASON),
    ]


async def test_a_new_pin_over_the_room_posts_one_warning_per_source_over_it() -> None:
    """The pin and the condition's move to True are one transition: not two Events for a
    source. One a source keeps each message under the 1024 characters kopf cuts an
    Event's message to in its middle."""
    obj = with_further_source(mount())
    big = Manifest((Shard("big.parquet", 2 << 30),), digest=OTHER_DIGEST)
    result = await reconciled(obj, serves_mixture(Manifest(SHARDS), big))
    source, web = warnings(result)
    assert source.message.startswith("spec.source: shard 'part-1.parquet' is 900Mi")
    assert web.message.startswith("spec.mixture.sources[0] (web): shard 'big.parquet' is 2Gi")
    assert condition(result.status)["message"] == f"{source.message}; {web.message}"
    assert all(len(e.message) <= 1024 for e in (source, web))


async def test_a_new_pin_over_the_room_while_the_condition_stays_true_is_warned() -> None:
    """Not a move to True, but a shard not said before."""
    obj = mount()
    await reconciled(obj, serves(Manifest(SHARDS)))
    obj["spec"]["source"]["uri"] = "s3://bucket/tokens-resharded/"
    obj["metadata"]["generation"] += 1
    larger = Manifest((Shard("b.parquet", 1 << 30),), digest=OTHER_DIGEST)
    (event,) = warnings(await reconciled(obj, serves(larger), now="2026-11-28T11:00:00Z"))
    assert event.message.startswith("spec.source: shard 'b.parquet' is 1Gi")


async def test_an_over_room_message_names_the_sources_whose_largest_shard_is_unrecorded() -> None:
    """One source over the room, another pinned by an older operator: raising the limit
    for the one named may not be enough, so the other is said not judged."""
    obj = with_further_source(mount(memory="2Gi"))
    small = Manifest((Shard("small.parquet", 100 * MiB),), digest=OTHER_DIGEST)
    await reconciled(obj, serves_mixture(Manifest(SHARDS), small))
    del obj["status"]["mixture"][0]["largestShard"]
    respecified(obj, "1Gi")
    lowered = await reconciled(obj, not_listed)
    found = condition(lowered.status)
    assert (found["status"], found["reason"]) == ("True", "OverDecodeRoom")
    assert found["message"].startswith("spec.source: shard 'part-1.parquet' is 900Mi")
    assert found["message"].endswith(
        "; the pin of spec.mixture.sources[0] (web) has no status.largestShard (pinned by "
        "an older operator; a kept pin is not listed again), so its shards were not "
        "judged: they are once the source is pinned again (a new uri, format or version)"
    )
    # The Event says it too.
    assert [e.message for e in warnings(lowered)] == [found["message"]]


async def test_a_new_pin_with_smaller_shards_clears_the_condition() -> None:
    obj = mount()
    await reconciled(obj, serves(Manifest(SHARDS)))
    assert condition(obj["status"])["status"] == "True"
    obj["spec"]["source"]["uri"] = "s3://bucket/tokens-resharded/"
    obj["metadata"]["generation"] += 1
    smaller = Manifest((Shard("a.parquet", 500 * MiB),), digest=OTHER_DIGEST)
    result = await reconciled(obj, serves(smaller), now="2026-11-28T11:00:00Z")
    assert result.status["largestShard"] == {"path": "a.parquet", "bytes": 500 * MiB}
    found = condition(result.status)
    assert (found["status"], found["reason"]) == ("False", "WithinDecodeRoom")


async def test_a_mixtures_further_source_over_the_room_is_named_and_its_pin_records_it() -> None:
    obj = with_further_source(mount())
    big = Manifest((Shard("big.parquet", 2 << 30),), digest=OTHER_DIGEST)
    resolve = serves_mixture(Manifest(SHARDS[:1]), big)
    result = await reconciled(obj, resolve)
    assert result.status["phase"] == "Ready"
    (web,) = result.status["mixture"]
    assert web["largestShard"] == {"path": "big.parquet", "bytes": 2 << 30}
    found = condition(result.status)
    assert found["status"] == "True"
    assert found["message"].startswith(
        "spec.mixture.sources[0] (web): shard 'big.parquet' is 2Gi at the source, "
        "1.2Gi over the 768Mi"
    )
    # Kept pins, a raised limit: judged again from what the pins recorded.
    respecified(obj, "3Gi")
    again = await reconciled(obj, not_listed, now="2026-11-28T11:00:00Z")
    assert condition(again.status)["status"] == "False"
    assert "spec.mixture.sources[0] (web): 'big.parquet' 2Gi" in condition(again.status)["message"]


async def test_a_pin_that_recorded_no_largest_shard_is_unknown_until_pinned_again() -> None:
    """A pin made by an operator before status.largestShard: kept, so not listed again."""
    obj = mount()
    await reconciled(obj, serves(Manifest(SHARDS)))
    del obj["status"]["largestShard"]
    obj["status"]["conditions"] = [
        c for c in obj["status"]["conditions"] if c["type"] != status.SHARD_TOO_LARGE_TO_DECODE
    ]
    result = await reconciled(obj, not_listed)
    found = condition(result.status)
    assert (found["status"], found["reason"]) == ("Unknown", "ShardSizesNotRecorded")
    assert "spec.source has no status.largestShard" in found["message"]
    assert "largestShard" not in result.status


async def test_two_pins_without_a_largest_shard_are_named_together_in_the_plural() -> None:
    """Both sources' pins made by an older operator: one sentence names both, and says
    "their shards" (not "its"), each judged once its source is pinned again."""
    obj = with_further_source(mount())
    small = Manifest((Shard("small.parquet", 100 * MiB),), digest=OTHER_DIGEST)
    await reconciled(obj, serves_mixture(Manifest(SHARDS), small))
    del obj["status"]["largestShard"]
    del obj["status"]["mixture"][0]["largestShard"]
    obj["status"]["conditions"] = [
        c for c in obj["status"]["conditions"] if c["type"] != status.SHARD_TOO_LARGE_TO_DECODE
    ]
    found = condition((await reconciled(obj, not_listed)).status)
    assert (found["status"], found["reason"]) == ("Unknown", "ShardSizesNotRecorded")
    assert found["message"] == (
        "the pins of spec.source, spec.mixture.sources[0] (web) have no "
        "status.largestShard (pinned by an older operator; a kept pin is not listed "
        "again), so their shards were not judged: each source's are once it is pinned "
        "again (a new uri, format or version)"
    )


async def test_a_stored_largest_shard_that_is_not_one_is_unknown_and_deleted() -> None:
    obj = mount()
    await reconciled(obj, serves(Manifest(SHARDS)))
    obj["status"]["largestShard"] = {"path": "part-1.parquet", "bytes": "900Mi"}
    result = await reconciled(obj, not_listed)
    assert condition(result.status)["status"] == "Unknown"
    # None: the merge patch deletes it, nothing unreadable is copied forward.
    assert result.status["largestShard"] is None
    # A failure keeps the pin, and copies no unreadable record forward either.
    obj["status"]["largestShard"] = "900Mi"
    obj["spec"]["source"]["format"] = "no-such-format"
    invalid = await reconciled(obj, not_listed)
    assert invalid.status["phase"] == "Invalid"
    assert invalid.status["largestShard"] is None


async def test_json_lines_is_not_judged_by_its_stored_size() -> None:
    """JSON Lines text decodes smaller than it is stored: its size says nothing."""
    result = await reconciled(mount("jsonl"), serves(Manifest(SHARDS, format="jsonl")))
    found = condition(result.status)
    assert (found["status"], found["reason"]) == ("False", "DecodedSizeNotBounded")
    assert "not judged: spec.source (jsonl)" in found["message"]


async def test_a_sidecar_without_a_memory_limit_is_never_too_small() -> None:
    obj = mount()
    obj["spec"]["sidecar"] = {"resources": {"limits": {"cpu": "2"}}}
    found = condition((await reconciled(obj, serves(Manifest(SHARDS)))).status)
    assert (found["status"], found["reason"]) == ("False", "NoMemoryLimit")


async def test_the_periodic_source_check_and_an_invalid_spec_keep_the_condition() -> None:
    obj = mount()
    await reconciled(obj, serves(Manifest(SHARDS)))
    stored = condition(obj["status"])
    checked = await reconcile.check_source(
        obj, read_secret=no_secret, probe=answers, now="2026-11-28T12:00:00Z"
    )
    assert checked is not None
    assert condition(checked.status) == stored
    obj["spec"]["source"]["format"] = "no-such-format"
    invalid = await reconciled(obj, not_listed, now="2026-11-28T12:00:00Z")
    assert invalid.status["phase"] == "Invalid"
    assert condition(invalid.status) == stored


def test_the_condition_and_the_recorded_shards_are_in_the_committed_crd() -> None:
    """The conditions' type is an enum and status is pruned to its schema: without the
    new type the API server refuses the status patch, without largestShard it drops it
    (a schema change: crd.SCHEMA_VERSION 3)."""
    written = {
        "phase": "Ready",
        "largestShard": {"path": "part-1.parquet", "bytes": 900 * MiB},
        "mixture": [
            {"name": "web", "manifestDigest": DIGEST, "largestShard": {"path": "b", "bytes": 1}}
        ],
        "conditions": [
            {
                "type": shard_room.REASON,  # the condition's type is the Event's reason
                "status": "True",
                "reason": "OverDecodeRoom",
                "message": "m",
                "lastTransitionTime": "2026-11-28T10:00:00Z",
            }
        ],
    }
    schema = committed_schema()["properties"]["status"]
    jsonschema.Draft7Validator(schema).validate(written)
    assert set(schema["properties"]["largestShard"]["properties"]) == {"path", "bytes"}
    mixture = schema["properties"]["mixture"]["items"]["properties"]
    assert set(mixture["largestShard"]["properties"]) == {"path", "bytes"}


def test_a_recorded_largest_shard_reads_back_and_what_is_not_one_reads_as_none() -> None:
    largest = shard_room.Largest("a.parquet", 5)
    assert shard_room.read_recorded(largest.recorded()) == largest
    for bad in (None, "a", {"path": "a"}, {"path": 1, "bytes": 5}, {"path": "a", "bytes": -1}):
        assert shard_room.read_recorded(bad) is None
    assert shard_room.read_recorded({"path": "a", "bytes": True}) is None
