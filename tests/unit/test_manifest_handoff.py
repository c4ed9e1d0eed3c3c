"""The ConfigMaps that hand a pinned manifest to the sidecars, and the volume that projects
them: names fixed per mount and source, bodies owned by the mount, a stale tail deleted,
and a failure said, never raised."""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import Mapping
from typing import Any

import pytest
from shardcache_operator import manifest_handoff, specs

from shardcache.node import handed_manifests

OWNER = {
    "apiVersion": f"{specs.GROUP}/{specs.VERSION}",
    "kind": specs.KIND,
    "name": "train",
    "uid": "0000-1111",
}
DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32
#: A DNS-1123 subdomain, as Kubernetes holds ConfigMap names to.
SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class Recorder:
    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail = fail

    async def put_config_map(self, body: Mapping[str, Any]) -> None:
        if self.fail is not None:
            raise self.fail
        self.calls.append(("put", body))

    async def delete_config_map(self, namespace: str, name: str) -> None:
        self.calls.append(("delete", (namespace, name)))


def test_names_are_fixed_per_mount_source_and_part_and_valid_for_any_mount_name() -> None:
    long_mount = "a" * 253
    names = {
        manifest_handoff.config_map_name(mount, source, part)
        for mount in ("train", long_mount)
        for source in (manifest_handoff.PRIMARY, "web")
        for part in range(handed_manifests.MAX_PARTS)
    }
    assert len(names) == 2 * 2 * handed_manifests.MAX_PARTS
    assert all(SUBDOMAIN.fullmatch(n) and len(n) <= 63 for n in names)
    assert manifest_handoff.config_map_name("train", "", 0) == manifest_handoff.config_map_name(
        "train", "", 0
    )


def test_a_configmap_per_part_owned_by_the_mount_carries_the_part_and_the_pin() -> None:
    bodies = manifest_handoff.config_maps(
        namespace="ns", mount="train", owner=OWNER, source="", digest=DIGEST, parts=[b"ab", b"c"]
    )
    assert [b["metadata"]["name"] for b in bodies] == [
        manifest_handoff.config_map_name("train", "", p) for p in (0, 1)
    ]
    for part, (body, data) in enumerate(zip(bodies, [b"ab", b"c"], strict=True)):
        meta = body["metadata"]
        assert meta["namespace"] == "ns"
        assert meta["ownerReferences"] == [
            {**OWNER, "blockOwnerDeletion": False}
        ]  # the garbage collector deletes them with the mount
        assert meta["annotations"] == {
            manifest_handoff.ANNOTATION_DIGEST: DIGEST,
            manifest_handoff.ANNOTATION_PART: str(part),
            manifest_handoff.ANNOTATION_PARTS: "2",
        }
        assert meta["labels"][manifest_handoff.LABEL_MOUNT] == "train"
        assert base64.b64decode(body["binaryData"][handed_manifests.DATA_KEY]) == data


def test_handing_writes_the_parts_and_deletes_the_tail_a_larger_pin_left() -> None:
    api = Recorder()
    failure = asyncio.run(
        manifest_handoff.hand(
            api, owner=OWNER, namespace="ns", source="web", digest=DIGEST, parts=[b"x", b"y"]
        )
    )
    assert failure is None
    puts = [body["metadata"]["name"] for kind, body in api.calls if kind == "put"]
    deletes = [where[1] for kind, where in api.calls if kind == "delete"]
    assert puts == [manifest_handoff.config_map_name("train", "web", p) for p in (0, 1)]
    assert deletes == [
        manifest_handoff.config_map_name("train", "web", p)
        for p in range(2, handed_manifests.MAX_PARTS)
    ]


def test_a_manifest_too_large_to_hand_leaves_a_part_0_that_says_so_and_nothing_else(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The earlier pin's parts would be refused by the sidecars (not their pin); part 0
    without data says the pin was looked at, so it is not resolved again to hand it."""
    api = Recorder()
    with caplog.at_level("INFO"):
        assert (
            asyncio.run(
                manifest_handoff.hand(
                    api, owner=OWNER, namespace="ns", source="", digest=DIGEST, parts=[]
                )
            )
            is None
        )
    assert [kind for kind, _ in api.calls] == ["put"] + ["delete"] * (
        handed_manifests.MAX_PARTS - 1
    )
    marker = api.calls[0][1]
    assert marker["metadata"]["name"] == manifest_handoff.config_map_name("train", "", 0)
    assert "binaryData" not in marker and "data" not in marker
    annotations = marker["metadata"]["annotations"]
    assert annotations[manifest_handoff.ANNOTATION_PARTS] == "0"
    assert annotations[manifest_handoff.ANNOTATION_DIGEST] == DIGEST
    assert "reads the dataset to hash it" in annotations[manifest_handoff.ANNOTATION_NOT_HANDED]
    assert [where[1] for kind, where in api.calls[1:]] == [
        manifest_handoff.config_map_name("train", "", p)
        for p in range(1, handed_manifests.MAX_PARTS)
    ]
    assert "is not handed: over 3145728 bytes gzipped" in caplog.text
    assert manifest_handoff.hands([_read(marker)], DIGEST)


def _read(body: Mapping[str, Any]) -> dict[str, Any]:
    """What `kube.Api.read_config_map` gives of a ConfigMap the API server holds."""
    keys = sorted({*(body.get("data") or {}), *(body.get("binaryData") or {})})
    return {"metadata": {"annotations": dict(body["metadata"]["annotations"])}, "keys": keys}


def _written(digest: str, parts: int) -> list[dict[str, Any] | None]:
    chunks = [bytes([p]) for p in range(parts)]
    bodies = manifest_handoff.config_maps(
        namespace="ns", mount="train", owner=OWNER, source="", digest=digest, parts=chunks
    )
    return [_read(b) for b in bodies]


@pytest.mark.parametrize("parts", [1, 2, handed_manifests.MAX_PARTS])
def test_the_parts_written_for_a_pin_hand_that_pin_and_no_other(parts: int) -> None:
    found = _written(DIGEST, parts)
    assert manifest_handoff.hands(found, DIGEST)
    assert manifest_handoff.hands([*found, None], DIGEST)  # nothing past the count matters
    assert not manifest_handoff.hands(found, OTHER)


def test_parts_missing_or_of_another_pin_do_not_hand_it() -> None:
    """What a backfill then writes again: a part deleted, a tail of an earlier pin, a
    part without its data, or a ConfigMap someone else wrote under the name."""
    found = _written(DIGEST, 3)
    assert not manifest_handoff.hands([], DIGEST)
    assert not manifest_handoff.hands([None], DIGEST)
    assert not manifest_handoff.hands([found[0], None, found[2]], DIGEST)
    assert not manifest_handoff.hands(found[:2], DIGEST)
    assert not manifest_handoff.hands([found[0], found[1], _written(OTHER, 3)[2]], DIGEST)
    assert not manifest_handoff.hands([found[0], found[2], found[1]], DIGEST)
    no_data = {**found[1], "keys": []}  # type: ignore[dict-item]
    assert not manifest_handoff.hands([found[0], no_data, found[2]], DIGEST)
    foreign = {"metadata": {"annotations": {}}, "keys": [handed_manifests.DATA_KEY]}
    assert not manifest_handoff.hands([foreign], DIGEST)
    uncounted = {"metadata": {"annotations": {manifest_handoff.ANNOTATION_PARTS: "9"}}}
    assert not manifest_handoff.hands([uncounted], DIGEST)


def test_a_failed_write_is_said_and_not_raised() -> None:
    api = Recorder(RuntimeError("the API server answered 500"))
    failure = asyncio.run(
        manifest_handoff.hand(
            api, owner=OWNER, namespace="ns", source="", digest=DIGEST, parts=[b"x"]
        )
    )
    assert failure is not None
    assert failure.startswith(f"the manifest {DIGEST} of spec.source was not handed")
    assert "the API server answered 500" in failure


def test_a_refused_write_is_raised_for_the_caller_to_leave_the_namespace_alone() -> None:
    api = Recorder(PermissionError("the operator's identity may not write ConfigMap ns/x"))
    with pytest.raises(PermissionError, match="may not write ConfigMap ns/x"):
        asyncio.run(
            manifest_handoff.hand(
                api, owner=OWNER, namespace="ns", source="", digest=DIGEST, parts=[b"x"]
            )
        )


def test_the_volume_projects_each_part_of_each_pinned_source_optionally() -> None:
    sources = [("", "s3://b/a/", DIGEST), ("web", "s3://b/web/", OTHER)]
    volume = manifest_handoff.volume("train-manifests", "train", sources)
    assert volume is not None and volume["name"] == "train-manifests"
    projected = volume["projected"]["sources"]
    assert len(projected) == 2 * handed_manifests.MAX_PARTS
    for i, entry in enumerate(projected):
        key, uri, digest = sources[i // handed_manifests.MAX_PARTS]
        part = i % handed_manifests.MAX_PARTS
        assert entry["configMap"] == {
            "name": manifest_handoff.config_map_name("train", key, part),
            "optional": True,  # a part not written (yet, or ever) never holds the pod back
            "items": [
                {
                    "key": handed_manifests.DATA_KEY,
                    "path": handed_manifests.file_name(digest, uri, part),
                }
            ],
        }
    assert manifest_handoff.volume_mount("train-manifests") == {
        "name": "train-manifests",
        "mountPath": manifest_handoff.MOUNT_PATH,
        "readOnly": True,
    }


def test_no_volume_without_a_pin_or_with_a_source_that_names_nothing() -> None:
    assert manifest_handoff.volume("v", "train", []) is None
    assert manifest_handoff.volume("v", "train", [("", "s3://", DIGEST)]) is None


def test_parts_an_older_operator_wrote_uncounted_hand_their_pin_when_their_digests_agree() -> None:
    """After an upgrade, the parts written before part 0 counted them are taken for
    what they hand, rather than every such pin's dataset read again."""

    def uncounted(digest: str, parts: int) -> list[dict[str, Any] | None]:
        found = _written(digest, parts)
        for config_map in found:
            assert config_map is not None
            config_map["metadata"]["annotations"].pop(manifest_handoff.ANNOTATION_PARTS)
        return found

    old = uncounted(DIGEST, 2)
    assert manifest_handoff.hands(old, DIGEST)
    assert manifest_handoff.hands([*old, None], DIGEST)
    assert manifest_handoff.hands(old[:1], DIGEST)  # a tail deleted by hand goes unseen
    assert not manifest_handoff.hands(old, OTHER)
    assert not manifest_handoff.hands([old[0], uncounted(OTHER, 2)[1]], DIGEST)
    assert not manifest_handoff.hands([{**old[0], "keys": []}], DIGEST)  # type: ignore[dict-item]
