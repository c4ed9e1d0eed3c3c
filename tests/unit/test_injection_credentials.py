"""The webhook mounts the DatasetMount's Secret as files in the sidecar, read-only and
there alone, so that a key rotated in the Secret reaches a running pod (its `envFrom`
never changes); the env variable that says where is written either way."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardcache_operator import (
    injection,
    manifest_handoff,
    mount_parts,
    offline,
    pod_volumes,
    specs,
)

from shardcache import contract
from shardcache.contract import variables
from tests.unit.test_injection import DEFAULTS, DIGEST, admit, dsm, env_of, pod, sidecars
from tests.unit.test_injection_manifests import admit as admit_handing
from tests.unit.test_injection_manifests import check_valid

pytestmark = pytest.mark.unit

PATH = "/etc/shardcache/credentials"
ROOT = Path(__file__).resolve().parents[2]


def secret_volumes(stored: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in stored["spec"]["volumes"] if "secret" in v]


def mounts_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in container.get("volumeMounts") or []}


def without_secret_ref(name: str, **spec: Any) -> dict[str, Any]:
    obj = dsm(name, **spec)
    del obj["spec"]["source"]["secretRef"]
    return obj


def test_a_secret_ref_is_mounted_as_files_read_only_in_the_sidecar_only() -> None:
    obj = pod()
    obj["spec"]["containers"].append({"name": "logger", "image": "busybox"})
    response, stored = admit(obj, dsm("imagenet"))
    assert response["allowed"] is True
    check_valid(stored)
    # Every key a file (no items), not optional (envFrom requires the Secret already),
    # the API's default mode (0644: the non-root sidecar reads root's files).
    (volume,) = secret_volumes(stored)
    assert volume == {"name": "shardcache-imagenet-cred", "secret": {"secretName": "s3-creds"}}
    (sidecar,) = sidecars(stored)
    assert sidecar["securityContext"]["runAsNonRoot"] is True
    # Whole, never with subPath: the kubelet does not update a subPath mount's files.
    assert mounts_of(sidecar)["shardcache-imagenet-cred"] == {
        "name": "shardcache-imagenet-cred",
        "mountPath": PATH,
        "readOnly": True,
    }
    assert pod_volumes.CREDENTIALS_PATH == PATH == variables.CREDENTIALS_DIR.default
    # The sidecar looks where it is mounted, and keeps the env as its first source.
    assert env_of(sidecar)[variables.CREDENTIALS_DIR.env] == PATH
    assert sidecar["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    for trainer in stored["spec"]["containers"]:
        assert "shardcache-imagenet-cred" not in mounts_of(trainer)
        assert PATH not in {m["mountPath"] for m in mounts_of(trainer).values()}
        assert variables.CREDENTIALS_DIR.env not in env_of(trainer)


def test_without_a_secret_ref_no_volume_but_the_env_still_says_where() -> None:
    response, stored = admit(pod(), without_secret_ref("imagenet"))
    assert response["allowed"] is True
    assert secret_volumes(stored) == []
    (sidecar,) = sidecars(stored)
    assert "envFrom" not in sidecar
    assert PATH not in {m["mountPath"] for m in sidecar["volumeMounts"]}
    assert not any(m["name"].endswith("-cred") for m in sidecar["volumeMounts"])
    # The sidecar finds no files there and uses its own identity, as before.
    assert env_of(sidecar)[variables.CREDENTIALS_DIR.env] == PATH


def test_two_mounts_each_mount_their_own_secret_in_their_own_sidecar() -> None:
    captions = dsm("captions")
    captions["spec"]["source"]["secretRef"] = {"name": "captions-creds"}
    response, stored = admit(pod(label="imagenet_captions"), dsm("imagenet"), captions)
    assert response["allowed"] is True
    check_valid(stored)
    assert secret_volumes(stored) == [
        {"name": "shardcache-imagenet-cred", "secret": {"secretName": "s3-creds"}},
        {"name": "shardcache-captions-cred", "secret": {"secretName": "captions-creds"}},
    ]
    first, second = sidecars(stored)
    assert mounts_of(first)["shardcache-imagenet-cred"]["mountPath"] == PATH
    assert "shardcache-captions-cred" not in mounts_of(first)
    assert mounts_of(second)["shardcache-captions-cred"]["mountPath"] == PATH
    assert "shardcache-imagenet-cred" not in mounts_of(second)


@pytest.mark.parametrize("checkpoint", [PATH, f"{PATH}/x", "/etc/shardcache", "/etc"])
def test_no_volume_where_a_checkpoint_path_would_meet_it(checkpoint: str) -> None:
    """The spec allows these paths (it knows only the sidecar's own directories), but
    the pod would have two volumes at one path (the API server refuses it), or one
    would hide the other: the sidecar keeps the env's credentials alone."""
    obj = dsm("imagenet", checkpoint={"uri": "s3://ckpt/imagenet/", "mountPath": checkpoint})
    response, stored = admit(pod(), obj)
    assert response["allowed"] is True
    check_valid(stored)
    assert secret_volumes(stored) == []
    (sidecar,) = sidecars(stored)
    assert sidecar["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert env_of(sidecar)[variables.CREDENTIALS_DIR.env] == PATH


@pytest.mark.parametrize("checkpoint", ["/etc/shardcache/credentials2", "/etc/shardcache/ckpt"])
def test_a_checkpoint_path_beside_it_keeps_the_volume(checkpoint: str) -> None:
    obj = dsm("imagenet", checkpoint={"uri": "s3://ckpt/imagenet/", "mountPath": checkpoint})
    _, stored = admit(pod(), obj)
    check_valid(stored)
    assert len(secret_volumes(stored)) == 1


@pytest.mark.parametrize("run_dir", ["/etc/shardcache", "/etc", f"{PATH}/run"])
def test_no_volume_where_the_run_directory_would_meet_it(run_dir: str) -> None:
    defaults = injection.SidecarDefaults(image="shardcache-sidecar:test", run_dir=run_dir)
    mount = injection.Mount("imagenet", specs.load(dsm("imagenet")).spec, DIGEST, namespace="ml")
    out = injection.inject(pod(), [mount], defaults=defaults)
    check_valid(out)
    assert secret_volumes(out) == []
    (sidecar,) = sidecars(out)
    assert sidecar["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]


def test_the_credentials_path_meets_none_of_the_sidecars_other_default_paths() -> None:
    """Fixed paths, so no check at injection: held here."""
    for other in (
        contract.DEFAULT_RUN_DIR,
        contract.DEFAULT_DISK_DIR,
        manifest_handoff.MOUNT_PATH,
        variables.CHECKPOINT_DIR.default,
        variables.TERMINATION_MESSAGE_PATH.default,
    ):
        assert not specs.paths_overlap(PATH, str(other)), other
    # Both the handed manifests and the Secret where the operator hands manifests.
    response, stored = admit_handing(pod(), dsm("imagenet"))
    assert response["allowed"] is True
    check_valid(stored)
    (sidecar,) = sidecars(stored)
    assert {"shardcache-imagenet-mfst", "shardcache-imagenet-cred"} <= set(mounts_of(sidecar))


def test_a_taken_volume_name_gets_a_suffix_and_long_names_stay_labels() -> None:
    obj = pod(volumes=[{"name": "shardcache-imagenet-cred", "emptyDir": {}}])
    _, stored = admit(obj, dsm("imagenet"))
    check_valid(stored)
    (volume,) = secret_volumes(stored)
    assert volume["name"] == "shardcache-imagenet-cred-2"
    assert {"name": "shardcache-imagenet-cred", "emptyDir": {}} in stored["spec"]["volumes"]
    (sidecar,) = sidecars(stored)
    assert mounts_of(sidecar)["shardcache-imagenet-cred-2"]["mountPath"] == PATH
    name = "a" * 30 + "." + "b" * 32
    _, stored = admit(pod(label=name), dsm(name))
    check_valid(stored)
    (volume,) = secret_volumes(stored)
    assert volume["name"].endswith("-cred") and len(volume["name"]) <= 63


def test_other_names_do_not_move_with_the_credentials_volume() -> None:
    """The credentials volume is named last: the sidecar, ports and other volumes are
    named as for a mount without a secretRef."""
    label = "imagenet_captions"
    _, with_it = admit_handing(pod(label=label), dsm("imagenet"), dsm("captions"))
    _, without = admit_handing(
        pod(label=label), without_secret_ref("imagenet"), without_secret_ref("captions")
    )
    assert [c["name"] for c in sidecars(with_it)] == [c["name"] for c in sidecars(without)]
    assert [v["name"] for v in without["spec"]["volumes"]] == [
        v["name"] for v in with_it["spec"]["volumes"] if "secret" not in v
    ]
    for a, b in zip(sidecars(with_it), sidecars(without), strict=True):
        assert a["ports"] == b["ports"]


def test_a_trainer_mounting_the_credentials_volume_by_name_is_refused() -> None:
    obj = pod()
    obj["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "shardcache-imagenet-cred", "mountPath": "/loot"}
    ]
    response, _ = admit(obj, dsm("imagenet"))
    assert response["allowed"] is False
    assert "names volume 'shardcache-imagenet-cred'" in response["status"]["message"]


def test_readmission_of_an_injected_pod_changes_nothing() -> None:
    _, once = admit(pod(), dsm("imagenet"))
    response, twice = admit(copy.deepcopy(once), dsm("imagenet"))
    assert response["allowed"] is True and "patch" not in response
    assert twice == once


def test_the_parts_cache_never_serves_another_secret_or_run_directory() -> None:
    """Which Secret is the spec's (keyed by identity); whether it is mounted depends on
    the spec and the run directory (`key.defaults`)."""
    cache = mount_parts.Cache()

    def secrets_of(spec: specs.DatasetMountSpec, defaults: injection.SidecarDefaults) -> list[Any]:
        m = injection.Mount("imagenet", spec, DIGEST, namespace="ml")
        out = injection.inject(pod(), [m], defaults=defaults, cache=cache)
        assert out == injection.inject(pod(), [m], defaults=defaults)
        return secret_volumes(out)

    first = specs.load(dsm("imagenet")).spec
    rotated = dsm("imagenet")
    rotated["spec"]["source"]["secretRef"] = {"name": "s3-creds-v2"}
    second = specs.load(rotated).spec
    assert secrets_of(first, DEFAULTS)[0]["secret"] == {"secretName": "s3-creds"}
    assert secrets_of(second, DEFAULTS)[0]["secret"] == {"secretName": "s3-creds-v2"}
    beside = injection.SidecarDefaults(image="shardcache-sidecar:test", run_dir="/etc/shardcache")
    assert secrets_of(first, beside) == []
    assert secrets_of(first, DEFAULTS)[0]["secret"] == {"secretName": "s3-creds"}


def test_offline_injection_mounts_the_secret_too() -> None:
    """`shardcache inject` is the same function: the example mount's Secret is mounted."""
    example = yaml.safe_load((ROOT / "examples" / "datasetmount.yaml").read_text())
    mounts = {example["metadata"]["name"]: specs.load(example)}
    doc = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": pod()["spec"]}
    out, _ = offline.inject_document(doc, mounts, defaults=DEFAULTS, where="pod.yaml")
    assert isinstance(out, dict)
    secret = example["spec"]["source"]["secretRef"]["name"]
    (volume,) = secret_volumes(out)
    assert volume["secret"] == {"secretName": secret}
    (sidecar,) = sidecars(out)
    assert mounts_of(sidecar)[volume["name"]] == {
        "name": volume["name"],
        "mountPath": PATH,
        "readOnly": True,
    }
    (trainer,) = out["spec"]["containers"]
    assert volume["name"] not in mounts_of(trainer)
