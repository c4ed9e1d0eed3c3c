"""The webhook mounts the pinned manifests the operator hands in ConfigMaps
(`manifest_handoff`) into each sidecar, read-only, where the operator writes them."""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import jsonpatch
import pytest
from shardcache_operator import (
    admission,
    configuration,
    injection,
    manifest_handoff,
    mount_parts,
    specs,
    webhook,
)

from shardcache import contract
from shardcache.contract import variables
from shardcache.node import handed_manifests
from tests.unit.test_injection import dsm, env_of, lookup_of, pod, review_request, sidecars

pytestmark = pytest.mark.unit

DIGEST = "sha256:" + "0f" * 32
CODE_DIGEST = "sha256:" + "cd" * 32
BOOKS_DIGEST = "sha256:" + "be" * 32
#: The operator hands manifests in the tests' namespace, ml.
HANDING = injection.SidecarDefaults(image="shardcache-sidecar:test", manifest_namespaces=("ml",))
ELSEWHERE = injection.SidecarDefaults(
    image="shardcache-sidecar:test", manifest_namespaces=("team-b",)
)
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def admit(
    obj: dict[str, Any],
    *objects: dict[str, Any],
    defaults: injection.SidecarDefaults = HANDING,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(AdmissionReview response, the pod as the API server would store it)."""
    reply = admission.review(review_request(obj), lookup=lookup_of(*objects), defaults=defaults)
    response = reply["response"]
    stored = obj
    if "patch" in response:
        ops = json.loads(base64.b64decode(response["patch"]))
        stored = jsonpatch.apply_patch(obj, ops)
    return response, stored


def mixture(name: str, *pins: tuple[str, str | None]) -> dict[str, Any]:
    """A mixture DatasetMount whose further sources are `pins` (name, pinned digest or
    None: not pinned yet)."""
    sources = [{"name": n, "weight": 1, "uri": f"s3://data/{n}/"} for n, _ in pins]
    obj = dsm(name, mixture={"name": "web", "sources": sources})
    obj["status"]["mixture"] = [{"name": n, "manifestDigest": d} for n, d in pins if d is not None]
    return obj


def volumes(stored: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in stored["spec"]["volumes"]}


def handed(stored: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in stored["spec"]["volumes"] if "projected" in v]


def expected_sources(mount: str, *pins: tuple[str, str, str]) -> list[dict[str, Any]]:
    """The projected sources of (source key, URI, digest) `pins`: one per part, each
    optional, its one key at the file name the sidecar looks for."""
    return [
        {
            "configMap": {
                "name": manifest_handoff.config_map_name(mount, key, part),
                "optional": True,
                "items": [
                    {
                        "key": handed_manifests.DATA_KEY,
                        "path": handed_manifests.file_name(digest, uri, part),
                    }
                ],
            }
        }
        for key, uri, digest in pins
        for part in range(handed_manifests.MAX_PARTS)
    ]


def check_valid(stored: dict[str, Any]) -> None:
    """What the API server would check of the names, and what admission checks of a
    submitted pod: every mount names a declared volume."""
    spec = stored["spec"]
    for key in ("initContainers", "containers", "volumes"):
        names = [item["name"] for item in spec.get(key, [])]
        assert len(names) == len(set(names)), names
        for name in names:
            assert len(name) <= 63 and _DNS_LABEL.fullmatch(name), name
    injection.refuse_undeclared_volumes(spec)
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        paths = [m["mountPath"] for m in container.get("volumeMounts", [])]
        assert len(paths) == len(set(paths)), paths


def test_a_single_source_gets_its_manifest_read_only_in_the_sidecar_only() -> None:
    response, stored = admit(pod(), dsm("imagenet"))
    assert response["allowed"] is True
    check_valid(stored)
    (volume,) = handed(stored)
    assert volume == {
        "name": "shardcache-imagenet-mfst",
        "projected": {
            "sources": expected_sources("imagenet", ("", "s3://data/imagenet/", DIGEST)),
            "defaultMode": 0o444,
        },
    }
    (sidecar,) = sidecars(stored)
    mount = {
        "name": "shardcache-imagenet-mfst",
        "mountPath": "/etc/shardcache/manifests",
        "readOnly": True,
    }
    assert mount in sidecar["volumeMounts"]
    assert manifest_handoff.MOUNT_PATH == "/etc/shardcache/manifests"
    # The sidecar looks where it is mounted (the contract table's default, in its env).
    assert env_of(sidecar)[variables.HANDED_MANIFESTS_DIR.env] == manifest_handoff.MOUNT_PATH
    (trainer,) = stored["spec"]["containers"]
    assert "shardcache-imagenet-mfst" not in {m["name"] for m in trainer["volumeMounts"]}
    # The other volumes are as without it.
    assert set(volumes(stored)) == {
        "shardcache-imagenet-run",
        "shardcache-imagenet-disk",
        "shardcache-imagenet-mfst",
        "shardcache-imagenet-cred",
    }


def test_a_mixture_gets_every_pinned_sources_parts_in_one_volume() -> None:
    obj = mixture("mix", ("code", CODE_DIGEST), ("books", BOOKS_DIGEST))
    response, stored = admit(pod(label="mix"), obj)
    assert response["allowed"] is True
    check_valid(stored)
    (volume,) = handed(stored)
    assert volume["name"] == "shardcache-mix-mfst"
    assert volume["projected"]["sources"] == expected_sources(
        "mix",
        ("", "s3://data/mix/", DIGEST),
        ("code", "s3://data/code/", CODE_DIGEST),
        ("books", "s3://data/books/", BOOKS_DIGEST),
    )
    assert len(volume["projected"]["sources"]) == 3 * handed_manifests.MAX_PARTS
    paths = [s["configMap"]["items"][0]["path"] for s in volume["projected"]["sources"]]
    assert len(paths) == len(set(paths))
    (sidecar,) = sidecars(stored)
    assert {"name": volume["name"], "mountPath": manifest_handoff.MOUNT_PATH, "readOnly": True} in (
        sidecar["volumeMounts"]
    )
    (trainer,) = stored["spec"]["containers"]
    assert volume["name"] not in {m["name"] for m in trainer["volumeMounts"]}


def test_a_mixture_source_not_pinned_yet_is_left_out() -> None:
    obj = mixture("mix", ("code", CODE_DIGEST), ("books", None))
    _, stored = admit(pod(label="mix"), obj)
    (volume,) = handed(stored)
    assert volume["projected"]["sources"] == expected_sources(
        "mix", ("", "s3://data/mix/", DIGEST), ("code", "s3://data/code/", CODE_DIGEST)
    )


def test_no_volume_where_the_operator_hands_no_manifests() -> None:
    for defaults in (ELSEWHERE, injection.SidecarDefaults(image="shardcache-sidecar:test")):
        response, stored = admit(pod(), dsm("imagenet"), defaults=defaults)
        assert response["allowed"] is True
        assert handed(stored) == []
        assert set(volumes(stored)) == {
            "shardcache-imagenet-run",
            "shardcache-imagenet-disk",
            "shardcache-imagenet-cred",
        }
        mounted = {m["mountPath"] for m in sidecars(stored)[0]["volumeMounts"]}
        assert manifest_handoff.MOUNT_PATH not in mounted


def test_no_volume_when_nothing_is_pinned() -> None:
    parsed = specs.parse_spec({"source": {"uri": "s3://data/imagenet/"}})
    unpinned = injection.Mount("imagenet", parsed, None, namespace="ml")
    out = injection.inject(pod(), [unpinned], defaults=HANDING)
    assert [v for v in out["spec"]["volumes"] if "projected" in v] == []
    # A mixture none of whose sources is pinned either.
    obj = mixture("mix", ("code", None))
    obj["status"]["manifestDigest"] = None
    loaded = specs.load(obj)
    assert loaded.manifest_digest is None
    mount = injection.Mount("mix", loaded.spec, None, namespace="ml")
    out = injection.inject(pod(label="mix"), [mount], defaults=HANDING)
    assert [v for v in out["spec"]["volumes"] if "projected" in v] == []


@pytest.mark.parametrize(
    "checkpoint", ["/etc/shardcache/manifests", "/etc/shardcache", "/etc/shardcache/manifests/x"]
)
def test_no_volume_where_a_checkpoint_path_would_meet_it(checkpoint: str) -> None:
    """The pod would have two volumes at one path (the API server refuses it), or one
    would hide the other: the sidecar resolves from the source instead."""
    obj = dsm("imagenet", checkpoint={"uri": "s3://ckpt/imagenet/", "mountPath": checkpoint})
    response, stored = admit(pod(), obj)
    assert response["allowed"] is True
    check_valid(stored)
    assert handed(stored) == []
    _, stored = admit(pod(), dsm("imagenet", checkpoint={"uri": "s3://ckpt/imagenet/"}))
    check_valid(stored)
    assert len(handed(stored)) == 1


def test_no_volume_where_the_run_directory_would_meet_it() -> None:
    defaults = injection.SidecarDefaults(
        image="shardcache-sidecar:test", run_dir="/etc/shardcache", manifest_namespaces=("ml",)
    )
    response, stored = admit(pod(), dsm("imagenet"), defaults=defaults)
    assert response["allowed"] is True
    assert handed(stored) == []


def test_offline_injection_with_no_namespace_mounts_none() -> None:
    parsed = specs.parse_spec({"source": {"uri": "s3://data/imagenet/"}})
    mount = injection.Mount("imagenet", parsed, DIGEST)
    out = injection.inject(pod(), [mount], defaults=HANDING)
    assert [v for v in out["spec"]["volumes"] if "projected" in v] == []


def test_two_mounts_get_distinct_volumes_each_in_its_own_sidecar() -> None:
    response, stored = admit(pod(label="imagenet_captions"), dsm("imagenet"), dsm("captions"))
    assert response["allowed"] is True
    check_valid(stored)
    first, second = handed(stored)
    assert (first["name"], second["name"]) == (
        "shardcache-imagenet-mfst",
        "shardcache-captions-mfst",
    )
    assert first["projected"]["sources"] == expected_sources(
        "imagenet", ("", "s3://data/imagenet/", DIGEST)
    )
    assert second["projected"]["sources"] == expected_sources(
        "captions", ("", "s3://data/captions/", DIGEST)
    )
    for sidecar, volume in zip(sidecars(stored), (first, second), strict=True):
        at = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
        assert at[manifest_handoff.MOUNT_PATH] == volume["name"]


def test_a_taken_volume_name_gets_a_suffix_and_long_names_stay_labels() -> None:
    obj = pod(volumes=[{"name": "shardcache-imagenet-mfst", "emptyDir": {}}])
    _, stored = admit(obj, dsm("imagenet"))
    check_valid(stored)
    (volume,) = handed(stored)
    assert volume["name"] == "shardcache-imagenet-mfst-2"
    assert {"name": "shardcache-imagenet-mfst", "emptyDir": {}} in stored["spec"]["volumes"]
    name = "a" * 30 + "." + "b" * 32
    _, stored = admit(pod(label=name), dsm(name))
    check_valid(stored)
    (volume,) = handed(stored)
    assert volume["name"].endswith("-mfst")


def test_a_trainer_mounting_the_manifest_volume_by_name_is_refused() -> None:
    obj = pod()
    obj["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "shardcache-imagenet-mfst", "mountPath": "/m"}
    ]
    response, _ = admit(obj, dsm("imagenet"))
    assert response["allowed"] is False
    assert "names volume 'shardcache-imagenet-mfst'" in response["status"]["message"]


def test_readmission_of_an_injected_pod_changes_nothing() -> None:
    _, once = admit(pod(label="imagenet_captions"), dsm("imagenet"), dsm("captions"))
    response, twice = admit(copy.deepcopy(once), dsm("imagenet"), dsm("captions"))
    assert response["allowed"] is True and "patch" not in response
    assert twice == once
    # Nor once the mount's pin moved: the running pod keeps what it was given.
    moved = dsm("imagenet")
    moved["status"]["manifestDigest"] = CODE_DIGEST
    response, _ = admit(copy.deepcopy(once), moved, dsm("captions"))
    assert "patch" not in response


def test_other_names_do_not_move_with_the_handed_volume() -> None:
    """The manifest volume is named last: the sidecar, ports and other volumes are
    named as where no manifests are handed."""
    _, with_it = admit(pod(label="imagenet_captions"), dsm("imagenet"), dsm("captions"))
    _, without = admit(
        pod(label="imagenet_captions"), dsm("imagenet"), dsm("captions"), defaults=ELSEWHERE
    )
    assert [c["name"] for c in sidecars(with_it)] == [c["name"] for c in sidecars(without)]
    assert [v["name"] for v in without["spec"]["volumes"]] == [
        v["name"] for v in with_it["spec"]["volumes"] if "projected" not in v
    ]
    for a, b in zip(sidecars(with_it), sidecars(without), strict=True):
        assert a["ports"] == b["ports"]
        assert env_of(a)[contract.ENV_UI_PORT] == env_of(b)[contract.ENV_UI_PORT]


def test_the_parts_cache_keys_whether_and_what_is_handed() -> None:
    """`mount_parts.Cache` keeps parts by spec identity and key: the namespaces the
    operator hands in and the digests are in the key, never served across."""
    cache = mount_parts.Cache()
    parsed = specs.parse_spec({"source": {"uri": "s3://data/imagenet/"}})
    mount = injection.Mount("imagenet", parsed, DIGEST, namespace="ml")

    def handed_of(m: injection.Mount, defaults: injection.SidecarDefaults) -> list[Any]:
        out = injection.inject(pod(), [m], defaults=defaults, cache=cache)
        assert out == injection.inject(pod(), [m], defaults=defaults)
        return [v for v in out["spec"]["volumes"] if "projected" in v]

    (first,) = handed_of(mount, HANDING)
    assert handed_of(mount, ELSEWHERE) == []
    assert handed_of(injection.Mount("imagenet", parsed, DIGEST, namespace="team-a"), HANDING) == []
    (moved,) = handed_of(injection.Mount("imagenet", parsed, CODE_DIGEST, namespace="ml"), HANDING)
    assert moved != first
    assert handed_of(injection.Mount("imagenet", parsed, None, namespace="ml"), HANDING) == []
    (again,) = handed_of(mount, HANDING)
    assert again == first


def test_the_webhook_hands_in_the_namespaces_of_the_operators_setting() -> None:
    settings = configuration.from_env({"SHARDCACHE_OPERATOR_MANIFEST_NAMESPACES": "ml, team-b"})
    assert settings.manifest_namespaces == ("ml", "team-b")
    assert webhook.defaults_of(settings).manifest_namespaces == ("ml", "team-b")
    assert webhook.defaults_of(configuration.Settings()).manifest_namespaces == ()
    _, stored = admit(pod(), dsm("imagenet"), defaults=webhook.defaults_of(settings))
    assert len(handed(stored)) == 1
