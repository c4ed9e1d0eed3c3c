"""A DatasetMount author gets no host-level power the platform did not grant.

Issue 13, rows 6, 9 and 10: nodePath, sidecar image and cache sizes are bounded by
the operator's policy (chart values), quantities by the CRD and the parser, and pod
settings that defeat the sidecar's isolation are refused. Each refusal is a message
naming the field, the value and what is allowed, never a 500.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
from shardcache_operator import (
    admission,
    authority,
    configuration,
    context,
    injection,
    mounts,
    specs,
)

from shardcache import contract, errors
from tests.unit.test_injection import DEFAULTS, admit, dsm, lookup_of, pod, review_request

pytestmark = pytest.mark.unit


def reviewed(obj: dict[str, Any], *mounts: dict[str, Any], **policy: Any) -> dict[str, Any]:
    """The webhook's response to `obj` with `mounts` there, under the chart's `policy`."""
    reply = admission.review(
        review_request(obj),
        lookup=lookup_of(*mounts),
        defaults=DEFAULTS,
        policy=authority.Policy(**policy),
    )
    response: dict[str, Any] = reply["response"]
    return response


def refusal(obj: dict[str, Any], *mounts: dict[str, Any], **policy: Any) -> str:
    response = reviewed(obj, *mounts, **policy)
    assert response["allowed"] is False, response
    assert response["status"]["code"] == 403
    return str(response["status"]["message"])


@pytest.mark.parametrize(
    "path", ["/", "/var/lib/kubelet/pods", "/var/cache/shardcache/../../etc", "/etc"]
)
def test_node_path_outside_the_allow_list_is_refused(path: str) -> None:
    mount = dsm("imagenet", cache={"nodePath": path})
    message = (
        refusal(pod(), mount)
        if re.fullmatch(specs.NODE_PATH_PATTERN, path)
        else admit(pod(), mount)[0]["status"]["message"]
    )
    assert "nodePath" in message


def test_node_path_on_the_allow_list_is_admitted() -> None:
    mount = dsm("imagenet", cache={"nodePath": "/mnt/nvme/shardcache"})
    response = reviewed(pod(), mount, node_paths=("/mnt/nvme/shardcache",))
    assert response["allowed"] is True


def test_spec_parser_refuses_dot_segments_in_node_path() -> None:
    for path in ("/var/cache/../../etc", "/a/./b", "//a", "relative"):
        with pytest.raises(errors.InputError, match="nodePath"):
            specs.parse_spec({"source": {"uri": "s3://b/x"}, "cache": {"nodePath": path}})


def test_sidecar_image_must_be_the_default_or_on_the_list() -> None:
    mount = dsm("imagenet", sidecar={"image": "attacker/exfiltrate:latest"})
    message = refusal(pod(), mount)
    assert "attacker/exfiltrate:latest" in message and "policy.sidecarImages" in message
    response = reviewed(pod(), mount, sidecar_images=("attacker/exfiltrate:latest",))
    assert response["allowed"] is True
    # Naming the default image explicitly is fine.
    response, _ = admit(pod(), dsm("imagenet", sidecar={"image": DEFAULTS.image}))
    assert response["allowed"] is True


@pytest.mark.parametrize(("field", "value"), [("memory", "65Gi"), ("disk", "2Ti")])
def test_cache_sizes_over_the_platform_cap_are_refused(field: str, value: str) -> None:
    message = refusal(pod(), dsm("imagenet", cache={field: value}))
    assert f"spec.cache.{field}" in message and "cap" in message


@pytest.mark.parametrize("value", ["1e5000", "1e30", "99999999999999999999Ei", 2**64])
def test_huge_quantities_are_refused_by_parser_and_schema(value: Any) -> None:
    with pytest.raises(errors.InputError, match=r"cache\.memory"):
        specs.parse_spec({"source": {"uri": "s3://b/x"}, "cache": {"memory": value}})
    if isinstance(value, str) and len(value) < 20:
        assert not re.match(specs.QUANTITY_PATTERN, value)
    # Admission answers with a refusal, not a 500.
    response, _ = admit(pod(), dsm("imagenet", cache={"memory": value}))
    assert response["allowed"] is False
    assert "cache.memory" in response["status"]["message"]


def test_largest_quantity_still_parses() -> None:
    assert specs.parse_quantity("7Ei") == 7 * 2**60
    assert specs.parse_quantity(specs.MAX_BYTES) == specs.MAX_BYTES
    assert specs.parse_quantity("1e18") == 10**18


def test_preset_injected_annotation_does_not_skip_injection() -> None:
    obj = pod()
    obj["metadata"]["annotations"] = {injection.ANNOTATION_INJECTED: "imagenet"}
    response, stored = admit(obj, dsm("imagenet"))
    assert response["allowed"] is True
    (sidecar,) = [c for c in stored["spec"]["initContainers"] if c["name"] == "shardcache-imagenet"]
    assert {"name": contract.ENV_MOUNT, "value": "imagenet"} in sidecar["env"]


def test_really_injected_pod_is_still_left_alone() -> None:
    _, once = admit(pod(), dsm("imagenet"))
    response, twice = admit(copy.deepcopy(once), dsm("imagenet"))
    assert "patch" not in response and twice == once


def test_share_process_namespace_is_refused_unless_the_mount_allows_it() -> None:
    response, _ = admit(pod(shareProcessNamespace=True), dsm("imagenet"))
    assert response["allowed"] is False
    assert "shareProcessNamespace" in response["status"]["message"]
    assert "allowShareProcessNamespace" in response["status"]["message"]
    allowed = dsm("imagenet", admission={"allowShareProcessNamespace": True})
    response, _ = admit(pod(shareProcessNamespace=True), allowed)
    assert response["allowed"] is True


def test_operator_settings_carry_the_policy_from_the_chart_env() -> None:
    settings = configuration.from_env(
        {
            "SHARDCACHE_OPERATOR_NODE_PATHS": "/var/cache/shardcache,/mnt/nvme",
            "SHARDCACHE_OPERATOR_SIDECAR_IMAGES": "",
            "SHARDCACHE_OPERATOR_MAX_CACHE_MEMORY": "8Gi",
            "SHARDCACHE_OPERATOR_MAX_CACHE_DISK": "100Gi",
        }
    )
    assert settings.policy() == authority.Policy(
        node_paths=("/var/cache/shardcache", "/mnt/nvme"),
        sidecar_images=(),
        max_cache_memory=8 << 30,
        max_cache_disk=100 << 30,
    )
    with pytest.raises(errors.InputError, match="SHARDCACHE_OPERATOR_MAX_CACHE_DISK"):
        configuration.from_env({"SHARDCACHE_OPERATOR_MAX_CACHE_DISK": "lots"})


def test_a_mount_without_node_path_gets_the_platforms_default_node_path() -> None:
    """nodeCache.path is spec.cache.nodePath's default: under a release with
    nodeCache.path=/data/x (the chart's allow-list then is /data/x alone) a mount that
    leaves nodePath out is allowed and its pods mount /data/x (the helm exploration's
    defect 3: it was Invalid, and so were its pods)."""
    settings = configuration.from_env(
        {
            "SHARDCACHE_OPERATOR_NODE_PATHS": "/data/x",
            "SHARDCACHE_OPERATOR_DEFAULT_NODE_PATH": "/data/x",
        }
    )
    store = context.Context(settings=settings, api=None).mounts  # type: ignore[arg-type]
    mount = dsm("imagenet")
    assert "nodePath" not in mount["spec"].get("cache", {})
    loaded = store.load(mount, known=1)
    assert loaded.spec.cache.node_path == "/data/x"
    assert authority.violations(loaded.spec, settings.policy(), default_image="s:1") == []
    decision = admission.decide(
        pod(),
        namespace="ml",
        lookup=lookup_of(mount),
        defaults=DEFAULTS,
        load=lambda obj: store.load(obj, known=1),
        policy=settings.policy(),
    )
    assert decision.allowed, decision.message
    paths = [v["hostPath"]["path"] for v in decision.pod["spec"]["volumes"] if "hostPath" in v]
    assert paths == ["/data/x"]


def test_a_mount_that_names_its_node_path_keeps_it_under_another_default() -> None:
    """Mounts stored by an older CRD carry its default, /var/cache/shardcache, as if
    written: they keep it, allowed where the platform still allows it."""
    policy = authority.Policy(
        node_paths=("/data/x", contract.DEFAULT_DISK_DIR), default_node_path="/data/x"
    )
    store = mounts.Store(default_node_path="/data/x")
    named = store.load(dsm("imagenet", cache={"nodePath": contract.DEFAULT_DISK_DIR}), known=1)
    assert named.spec.cache.node_path == contract.DEFAULT_DISK_DIR
    assert authority.violations(named.spec, policy, default_image="s:1") == []


def test_an_unset_node_path_the_platform_does_not_allow_says_it_was_the_default() -> None:
    spec = specs.parse_spec({"source": {"uri": "s3://b/p/"}})
    policy = authority.Policy(node_paths=("/mnt/nvme",), default_node_path="/data/x")
    (message,) = authority.violations(spec, policy, default_image="s:1")
    assert "unset: the platform's default '/data/x', chart value nodeCache.path" in message
    assert "'/mnt/nvme'" in message


def test_the_default_node_path_setting_is_held_to_the_crds_pattern() -> None:
    assert configuration.from_env({}).default_node_path == contract.DEFAULT_DISK_DIR
    with pytest.raises(errors.InputError, match="SHARDCACHE_OPERATOR_DEFAULT_NODE_PATH"):
        configuration.from_env({"SHARDCACHE_OPERATOR_DEFAULT_NODE_PATH": "/var/cache/../etc"})
