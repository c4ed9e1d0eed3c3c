"""The volumes of a mount: a checkpoint path clear of the sidecar's own mounts, and
refusals that name what already sits at a path."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from shardcache_operator import injection, pod_names, pod_volumes, specs

from shardcache import errors

pytestmark = pytest.mark.unit

NAMES = pod_names.MountNames(
    sidecar="shardcache-m",
    run_volume="shardcache-m-run",
    disk_volume="shardcache-m-disk",
    checkpoint_volume="shardcache-m-ckpt",
    port=8470,
    port_name="shardcache",
    ui_port=8490,
)
DEFAULTS = injection.SidecarDefaults(image="shardcache-sidecar:test")


def parse(**spec: Any) -> specs.DatasetMountSpec:
    return specs.parse_spec({"source": {"uri": "s3://bucket/train/"}, **spec})


def sidecar_paths(spec: specs.DatasetMountSpec, run_dir: str) -> list[str]:
    volumes = pod_volumes.volumes_for("m", spec, NAMES, run_dir=run_dir)
    return [m["mountPath"] for m in volumes.sidecar_mounts]


@pytest.mark.parametrize("path", ["/srv/run", "/srv/run/m", "/srv/run/other", "/srv"])
def test_a_checkpoint_path_at_an_operators_own_run_directory_is_refused(path: str) -> None:
    # The spec's check knows only the default run directory; the operator may set another.
    spec = parse(checkpoint={"uri": "s3://ckpt/", "mountPath": path})
    with pytest.raises(
        errors.InputError,
        match=rf"^spec\.checkpoint\.mountPath: {path!r} is, holds or lies inside the "
        r"sidecars' run directory /srv/run \(operator setting RUN_DIR\)",
    ):
        sidecar_paths(spec, "/srv/run")


def test_a_checkpoint_path_beside_an_operators_own_run_directory_is_mounted() -> None:
    spec = parse(checkpoint={"uri": "s3://ckpt/", "mountPath": "/srv/runs"})
    paths = sidecar_paths(spec, "/srv/run")
    assert paths == ["/srv/run/m", "/var/cache/shardcache", "/srv/runs"]


def test_a_path_the_user_already_mounts_names_the_container_and_the_volume() -> None:
    container: dict[str, Any] = {
        "name": "trainer",
        "volumeMounts": [{"name": "data", "mountPath": "/checkpoints/"}],
    }
    mount = pod_volumes.TrainerMount("shardcache-m-ckpt", "/checkpoints", "the m checkpoints")
    with pytest.raises(
        errors.InputError,
        match=r"^container 'trainer' already mounts something at /checkpoints \(volume 'data'\), "
        r"where the m checkpoints must go: remove that mount or change the DatasetMount's path$",
    ):
        pod_volumes.add_mount(container, mount)


def mount(name: str, **spec: Any) -> injection.Mount:
    return injection.Mount(name=name, spec=parse(**spec), digest=None, namespace="ml")


def test_two_mounts_with_the_default_checkpoint_path_name_the_other_mounts_volume() -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ml"},
        "spec": {"containers": [{"name": "trainer", "image": "python:3.11"}]},
    }
    both = [
        mount("b", checkpoint={"uri": "s3://ck/b/"}),
        mount("c", checkpoint={"uri": "s3://ck/c/"}),
    ]
    with pytest.raises(errors.InputError) as refused:
        injection.inject(pod, both, defaults=DEFAULTS)
    message = str(refused.value)
    assert message == (
        "container 'trainer' already mounts the checkpoints of another DatasetMount at "
        "/checkpoints (volume 'shardcache-b-ckpt'), where the c checkpoints must go: give each "
        "DatasetMount of the pod its own spec.checkpoint.mountPath"
    )


def test_the_sidecar_mounts_its_namespaces_directory_of_the_node_path_alone() -> None:
    volumes = pod_volumes.volumes_for("m", parse(), NAMES, run_dir="/srv/run", namespace="team-a")
    (host,) = [v for v in volumes.volumes if "hostPath" in v]
    assert host == {
        "name": "shardcache-m-disk",
        "hostPath": {"path": "/var/cache/shardcache", "type": "DirectoryOrCreate"},
    }
    (disk,) = [m for m in volumes.sidecar_mounts if m["name"] == "shardcache-m-disk"]
    assert disk == {
        "name": "shardcache-m-disk",
        "mountPath": "/var/cache/shardcache/ns-team-a",
        "subPath": "ns-team-a",
    }
    # Trainers never get the disk tier.
    assert [t.volume for t in volumes.trainer_mounts] == ["shardcache-m-run"]


def test_offline_injection_without_a_namespace_mounts_the_node_path_itself() -> None:
    # A template injected by `shardcache inject` has no namespace yet: the sidecar's
    # env points at the node path, so the mount does too (docs/operator.md, Offline).
    (disk,) = [
        m
        for m in pod_volumes.volumes_for("m", parse(), NAMES, run_dir="/srv/run").sidecar_mounts
        if m["name"] == "shardcache-m-disk"
    ]
    assert disk == {"name": "shardcache-m-disk", "mountPath": "/var/cache/shardcache"}


def test_the_sources_secret_is_mounted_whole_and_read_only_in_the_sidecar_alone() -> None:
    names = dataclasses.replace(NAMES, credentials_volume="shardcache-m-cred")
    spec = specs.parse_spec({"source": {"uri": "s3://bucket/train/", "secretRef": {"name": "s"}}})
    volumes = pod_volumes.volumes_for("m", spec, names, run_dir="/srv/run")
    assert volumes.volumes[-1] == {"name": "shardcache-m-cred", "secret": {"secretName": "s"}}
    assert volumes.sidecar_mounts[-1] == {
        "name": "shardcache-m-cred",
        "mountPath": "/etc/shardcache/credentials",
        "readOnly": True,
    }
    assert "shardcache-m-cred" not in [t.volume for t in volumes.trainer_mounts]
    # A name without a secretRef (never allocated so) mounts nothing.
    bare = pod_volumes.volumes_for("m", parse(), names, run_dir="/srv/run")
    assert not any("secret" in v for v in bare.volumes)
    assert "/etc/shardcache/credentials" not in [m["mountPath"] for m in bare.sidecar_mounts]
