"""Pod injection through AdmissionReview v1 payloads, as the API server sends them."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import jsonpatch
import pytest
from shardcache_operator import admission, injection, pod_volumes

from shardcache import contract

pytestmark = pytest.mark.unit

DIGEST = "sha256:" + "0f" * 32
DEFAULTS = injection.SidecarDefaults(image="shardcache-sidecar:test")
SECRET_ENV_NAMES = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


def dsm(name: str, *, phase: str = "Ready", generation: int = 1, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "source": {"uri": f"s3://data/{name}/", "secretRef": {"name": "s3-creds"}},
    }
    body.update(spec)
    return {
        "apiVersion": "shardcache.io/v1alpha1",
        "kind": "DatasetMount",
        "metadata": {"name": name, "namespace": "ml", "generation": generation},
        "spec": body,
        "status": {
            "phase": phase,
            "observedGeneration": 1,
            "manifestDigest": DIGEST,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if phase == "Ready" else "False",
                    "reason": "ManifestPinned" if phase == "Ready" else "Unreachable",
                    "message": "ok" if phase == "Ready" else "connection refused by the endpoint",
                }
            ],
        },
    }


def lookup_of(*objects: dict[str, Any]) -> admission.Lookup:
    table = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objects}
    return lambda namespace, name: table.get((namespace, name))


def pod(label: str | None = "imagenet", **spec: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "trainer-0", "namespace": "ml"}
    if label is not None:
        metadata["labels"] = {injection.LABEL_MOUNT: label}
    body: dict[str, Any] = {"containers": [{"name": "trainer", "image": "python:3.11"}]}
    body.update(spec)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": body}


def review_request(obj: dict[str, Any], *, namespace: str = "ml") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:job-controller"},
            "object": obj,
            "dryRun": False,
        },
    }


def admit(
    obj: dict[str, Any], *objects: dict[str, Any], missing_policy: str = "Refuse"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(AdmissionReview response, the pod as the API server would store it)."""
    reply = admission.review(
        review_request(obj),
        lookup=lookup_of(*objects),
        defaults=DEFAULTS,
        missing_policy=missing_policy,
    )
    response = reply["response"]
    assert reply["kind"] == "AdmissionReview"
    assert response["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    stored = obj
    if "patch" in response:
        assert response["patchType"] == "JSONPatch"
        ops = json.loads(base64.b64decode(response["patch"]))
        stored = jsonpatch.apply_patch(obj, ops)
    return response, stored


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def sidecars(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in obj["spec"].get("initContainers", []) if c.get("restartPolicy") == "Always"]


def all_names(obj: dict[str, Any], key: str) -> list[str]:
    return [c["name"] for c in obj["spec"].get(key, [])]


def test_pod_without_the_label_is_admitted_unchanged() -> None:
    response, stored = admit(pod(label=None), dsm("imagenet"))
    assert response["allowed"] is True
    assert "patch" not in response
    assert stored == pod(label=None)


def test_labelled_pod_gets_a_native_sidecar_with_a_startup_probe() -> None:
    response, stored = admit(pod(), dsm("imagenet"))
    assert response["allowed"] is True
    (sidecar,) = sidecars(stored)
    assert sidecar["name"] == "shardcache-imagenet"
    assert sidecar["image"] == "shardcache-sidecar:test"
    assert sidecar["command"] == ["shardcache", "sidecar"]
    port = contract.DEFAULT_METRICS_PORT
    assert sidecar["startupProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    assert sidecar["ports"][0]["containerPort"] == port
    security = sidecar["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert set(sidecar["resources"]) == {"requests", "limits"}
    # 256Mi for the sidecar and the 2560Mi run volume of the default 2Gi memory tier.
    assert sidecar["resources"]["requests"] == {"cpu": "250m", "memory": f"{256 + 2560}Mi"}
    assert stored["metadata"]["annotations"][injection.ANNOTATION_INJECTED] == "imagenet"


def test_sidecar_env_carries_the_spec_and_the_pinned_digest() -> None:
    _, stored = admit(pod(), dsm("imagenet", prefetch={"depth": 9}, sharding={"seed": 42}))
    env = env_of(sidecars(stored)[0])
    run_dir = contract.DEFAULT_RUN_DIR
    assert env[contract.ENV_SOURCE_URI] == "s3://data/imagenet/"
    assert env[contract.ENV_SOURCE_FORMAT] == "parquet"
    assert env[contract.ENV_MANIFEST_DIGEST] == DIGEST
    assert env[contract.ENV_MOUNT] == "imagenet"
    assert env[contract.ENV_RUN_DIR] == run_dir
    assert env[contract.ENV_SOCKET] == str(contract.socket_path(run_dir, "imagenet"))
    assert env[contract.ENV_MEMORY_DIR] == str(contract.memory_dir(run_dir, "imagenet"))
    assert env[contract.ENV_MEMORY_LIMIT] == str(2 * 2**30)
    assert env[contract.ENV_DISK_DIR] == f"{contract.DEFAULT_DISK_DIR}/ns-ml"
    assert env[contract.ENV_DISK_LIMIT] == str(50 * 2**30)
    assert env[contract.ENV_PREFETCH_DEPTH] == "9"
    assert env[contract.ENV_SEED] == "42"
    assert env[contract.ENV_SHUFFLE] == "true"
    assert env[contract.ENV_METRICS_PORT] == str(contract.DEFAULT_METRICS_PORT)
    assert contract.ENV_RANK not in env  # not an Indexed Job pod
    assert contract.ENV_CHECKPOINT_URI not in env


def test_volumes_memory_tier_in_both_disk_tier_in_sidecar_only() -> None:
    _, stored = admit(pod(), dsm("imagenet", cache={"memory": "1Gi"}))
    volumes = {v["name"]: v for v in stored["spec"]["volumes"]}
    # The tier plus a quarter of headroom for evicted shards a reader still maps.
    assert volumes["shardcache-imagenet-run"]["emptyDir"] == {
        "medium": "Memory",
        "sizeLimit": "1280Mi",
    }
    assert volumes["shardcache-imagenet-disk"]["hostPath"] == {
        "path": contract.DEFAULT_DISK_DIR,
        "type": "DirectoryOrCreate",
    }
    mount_dir = str(contract.mount_dir(contract.DEFAULT_RUN_DIR, "imagenet"))
    sidecar = sidecars(stored)[0]
    # The node path's directory of the pod's namespace alone, where the env points;
    # the source's Secret as files (test_injection_credentials).
    assert sidecar["volumeMounts"] == [
        {"name": "shardcache-imagenet-run", "mountPath": mount_dir},
        {
            "name": "shardcache-imagenet-disk",
            "mountPath": f"{contract.DEFAULT_DISK_DIR}/ns-ml",
            "subPath": "ns-ml",
        },
        {
            "name": "shardcache-imagenet-cred",
            "mountPath": "/etc/shardcache/credentials",
            "readOnly": True,
        },
    ]
    assert env_of(sidecar)[contract.ENV_DISK_DIR] == f"{contract.DEFAULT_DISK_DIR}/ns-ml"
    (trainer,) = stored["spec"]["containers"]
    assert trainer["volumeMounts"] == [{"name": "shardcache-imagenet-run", "mountPath": mount_dir}]


def test_disk_medium_uses_plain_emptydir_and_keeps_the_memory_limit() -> None:
    _, stored = admit(pod(), dsm("imagenet", cache={"memory": "1Gi", "medium": "Disk"}))
    volumes = {v["name"]: v for v in stored["spec"]["volumes"]}
    assert volumes["shardcache-imagenet-run"]["emptyDir"] == {"sizeLimit": "1280Mi"}
    assert sidecars(stored)[0]["resources"]["limits"]["memory"] == "1Gi"


def test_memory_medium_raises_the_sidecar_memory_limit_by_the_run_volume_size() -> None:
    _, stored = admit(pod(), dsm("imagenet", cache={"memory": "1Gi"}))
    assert sidecars(stored)[0]["resources"]["limits"]["memory"] == "2304Mi"  # 1Gi + 1280Mi


def test_run_volume_headroom_rounds_up_to_whole_mebibytes() -> None:
    assert pod_volumes.run_volume_bytes(16 << 20) == 20 << 20
    assert pod_volumes.run_volume_bytes(10 << 20) == 13 << 20  # 2.5 MiB of headroom -> 3
    assert pod_volumes.run_volume_bytes(0) == 0


def test_trainers_get_env_but_never_credentials() -> None:
    _, stored = admit(pod(), dsm("imagenet"))
    (trainer,) = stored["spec"]["containers"]
    env = env_of(trainer)
    assert env == {
        contract.ENV_RUN_DIR: contract.DEFAULT_RUN_DIR,
        contract.ENV_MOUNTS: "imagenet",
        contract.ENV_MOUNT: "imagenet",
        # The spec's plan defaults; no blockSize in the spec: the reader's default.
        contract.ENV_SEED: "0",
        contract.ENV_SHUFFLE: "true",
        contract.ENV_SHUFFLE_GRANULARITY: "block",
        contract.ENV_SHUFFLE_WINDOW: "65536",
    }
    assert "envFrom" not in trainer
    assert sidecars(stored)[0]["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    # Nor the Secret's files: only the sidecar mounts them.
    assert "shardcache-imagenet-cred" not in {m["name"] for m in trainer["volumeMounts"]}
    assert any(m["name"] == "shardcache-imagenet-cred" for m in sidecars(stored)[0]["volumeMounts"])


PLAN = (contract.ENV_SEED, contract.ENV_SHUFFLE, contract.ENV_BLOCK_SIZE)


def test_trainers_get_the_reading_plan_their_sidecar_warms_up_with() -> None:
    sharding = {"seed": 42, "shuffle": False, "blockSize": 512}
    _, stored = admit(pod(), dsm("imagenet", sharding=sharding))
    trainer = env_of(stored["spec"]["containers"][0])
    sidecar = env_of(sidecars(stored)[0])
    assert {n: trainer[n] for n in PLAN} == {
        contract.ENV_SEED: "42",
        contract.ENV_SHUFFLE: "false",
        contract.ENV_BLOCK_SIZE: "512",
    }
    assert {n: sidecar[n] for n in PLAN} == {n: trainer[n] for n in PLAN}


SAMPLE_PLAN = (contract.ENV_SHUFFLE, contract.ENV_SHUFFLE_GRANULARITY, contract.ENV_SHUFFLE_WINDOW)


def test_a_sample_mount_renders_its_granularity_and_window_into_sidecar_and_trainer() -> None:
    sharding = {"granularity": "sample", "window": 20000}
    _, stored = admit(pod(), dsm("imagenet", sharding=sharding))
    trainer = env_of(stored["spec"]["containers"][0])
    sidecar = env_of(sidecars(stored)[0])
    expected = {
        contract.ENV_SHUFFLE: "true",
        contract.ENV_SHUFFLE_GRANULARITY: "sample",
        contract.ENV_SHUFFLE_WINDOW: "20000",
    }
    assert {n: trainer[n] for n in SAMPLE_PLAN} == expected
    assert {n: sidecar[n] for n in SAMPLE_PLAN} == expected


def test_a_trainers_plan_is_its_first_mounts_even_with_a_second_one() -> None:
    _, stored = admit(
        pod(label="imagenet_captions"),
        dsm("imagenet", sharding={"seed": 1, "blockSize": 64}),
        dsm(
            "captions",
            sharding={"seed": 2, "blockSize": 128, "shuffle": False, "granularity": "sample"},
        ),
    )
    trainer = env_of(stored["spec"]["containers"][0])
    assert trainer[contract.ENV_MOUNTS] == "imagenet,captions"
    assert {n: trainer[n] for n in PLAN} == {
        contract.ENV_SEED: "1",
        contract.ENV_SHUFFLE: "true",
        contract.ENV_BLOCK_SIZE: "64",
    }
    assert trainer[contract.ENV_SHUFFLE_GRANULARITY] == "block"


def test_a_users_own_plan_variable_on_a_trainer_is_replaced_by_the_mounts() -> None:
    # The sidecar warms up with the mount's plan; a trainer env saying otherwise would
    # read in another order than the one prefetched. open() arguments are the override.
    user_env = [{"name": contract.ENV_SEED, "value": "9"}]
    obj = pod(containers=[{"name": "trainer", "image": "python:3.11", "env": user_env}])
    _, stored = admit(obj, dsm("imagenet", sharding={"seed": 42}))
    assert env_of(stored["spec"]["containers"][0])[contract.ENV_SEED] == "42"


def test_job_template_pod_with_generate_name_gets_rank_from_completion_index() -> None:
    obj = pod(sharding={})
    obj["metadata"] = {
        "generateName": "resnet-train-0-",
        "labels": {injection.LABEL_MOUNT: "imagenet", "batch.kubernetes.io/job-name": "resnet"},
        "annotations": {injection.ANNOTATION_JOB_INDEX: "0"},
        "ownerReferences": [
            {"kind": "Job", "name": "resnet-train", "uid": "u", "apiVersion": "batch/v1"}
        ],
    }
    obj["spec"]["restartPolicy"] = "OnFailure"
    response, stored = admit(obj, dsm("imagenet", sharding={"worldSize": 4}))
    assert response["allowed"] is True
    assert "name" not in stored["metadata"]
    env = env_of(sidecars(stored)[0])
    assert env[contract.ENV_WORLD_SIZE] == "4"
    assert env[contract.ENV_RANK] == {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    }


def test_world_size_annotation_overrides_the_spec_and_bad_values_are_refused() -> None:
    obj = pod()
    obj["metadata"]["annotations"] = {injection.ANNOTATION_WORLD_SIZE: "16"}
    _, stored = admit(obj, dsm("imagenet", sharding={"worldSize": 4}))
    assert env_of(sidecars(stored)[0])[contract.ENV_WORLD_SIZE] == "16"
    obj["metadata"]["annotations"] = {injection.ANNOTATION_WORLD_SIZE: "many"}
    response, _ = admit(obj, dsm("imagenet"))
    assert response["allowed"] is False
    assert "shardcache.io/world-size" in response["status"]["message"]


def test_a_world_size_annotation_at_or_below_a_fixed_rank_is_refused_naming_both() -> None:
    obj = pod()
    mount = dsm("imagenet", sharding={"rankFrom": "Fixed", "rank": 3, "worldSize": 4})
    for size in ("3", "2"):
        obj["metadata"]["annotations"] = {injection.ANNOTATION_WORLD_SIZE: size}
        response, _ = admit(obj, mount)
        assert response["allowed"] is False
        message = response["status"]["message"]
        assert "rank is 3 (spec.sharding.rank)" in message
        assert f"world size is {size} (annotation shardcache.io/world-size ({size}))" in message
    obj["metadata"]["annotations"] = {injection.ANNOTATION_WORLD_SIZE: "5"}
    _, stored = admit(obj, mount)
    env = env_of(sidecars(stored)[0])
    assert (env[contract.ENV_RANK], env[contract.ENV_WORLD_SIZE]) == ("3", "5")


def test_an_indexed_job_pod_whose_index_is_not_below_the_world_size_is_refused() -> None:
    obj = pod()
    mount = dsm("imagenet", sharding={"worldSize": 4})
    obj["metadata"]["annotations"] = {"batch.kubernetes.io/job-completion-index": "4"}
    response, _ = admit(obj, mount)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "rank is 4 (annotation batch.kubernetes.io/job-completion-index)" in message
    assert "world size is 4 (spec.sharding.worldSize)" in message
    obj["metadata"]["annotations"] = {"batch.kubernetes.io/job-completion-index": "3"}
    response, _ = admit(obj, mount)
    assert response["allowed"] is True


def test_fixed_rank_is_passed_as_a_value() -> None:
    _, stored = admit(
        pod(), dsm("imagenet", sharding={"rankFrom": "Fixed", "rank": 2, "worldSize": 3})
    )
    env = env_of(sidecars(stored)[0])
    assert (env[contract.ENV_RANK], env[contract.ENV_WORLD_SIZE]) == ("2", "3")


def test_user_init_containers_keep_their_order_and_run_first() -> None:
    init = [
        {"name": "fetch-config", "image": "busybox"},
        {"name": "istio-proxy", "image": "proxy", "restartPolicy": "Always"},
        {"name": "migrate", "image": "busybox"},
    ]
    _, stored = admit(pod(initContainers=copy.deepcopy(init)), dsm("imagenet"))
    assert stored["spec"]["initContainers"][:3] == init
    assert all_names(stored, "initContainers") == [
        "fetch-config",
        "istio-proxy",
        "migrate",
        "shardcache-imagenet",
    ]


def test_names_and_ports_never_collide_with_the_pods_own() -> None:
    obj = pod(
        initContainers=[{"name": "shardcache-imagenet", "image": "mine"}],
        volumes=[
            {"name": "shardcache-imagenet-run", "emptyDir": {}},
            {"name": "shardcache-imagenet-disk", "emptyDir": {}},
        ],
    )
    obj["spec"]["containers"][0]["ports"] = [
        {"name": "shardcache", "containerPort": contract.DEFAULT_METRICS_PORT}
    ]
    response, stored = admit(obj, dsm("imagenet"))
    assert response["allowed"] is True
    containers = all_names(stored, "initContainers") + all_names(stored, "containers")
    volumes = all_names(stored, "volumes")
    assert len(containers) == len(set(containers))
    assert len(volumes) == len(set(volumes))
    sidecar = sidecars(stored)[0]
    assert sidecar["name"] == "shardcache-imagenet-2"
    assert sidecar["ports"][0]["containerPort"] == contract.DEFAULT_METRICS_PORT + 1
    assert sidecar["ports"][0]["name"] != "shardcache"
    assert sidecar["startupProbe"]["httpGet"]["port"] == contract.DEFAULT_METRICS_PORT + 1
    # The user's own volumes are untouched and ours are the ones mounted.
    assert {"name": "shardcache-imagenet-run", "emptyDir": {}} in stored["spec"]["volumes"]
    mounted = {m["name"] for m in sidecar["volumeMounts"]}
    assert mounted == {
        "shardcache-imagenet-run-2",
        "shardcache-imagenet-disk-2",
        "shardcache-imagenet-cred",
    }


def test_two_mounts_get_two_sidecars_with_distinct_ports() -> None:
    response, stored = admit(pod(label="imagenet_captions"), dsm("imagenet"), dsm("captions"))
    assert response["allowed"] is True
    first, second = sidecars(stored)
    assert (first["name"], second["name"]) == ("shardcache-imagenet", "shardcache-captions")
    assert first["ports"][0]["containerPort"] != second["ports"][0]["containerPort"]
    env = env_of(stored["spec"]["containers"][0])
    assert env[contract.ENV_MOUNTS] == "imagenet,captions"
    assert env[contract.ENV_MOUNT] == "imagenet"
    assert stored["metadata"]["annotations"][injection.ANNOTATION_INJECTED] == "imagenet,captions"
    # Each its run volume, its disk tier and its Secret's files.
    assert all_names(stored, "volumes") == [
        "shardcache-imagenet-run",
        "shardcache-imagenet-disk",
        "shardcache-imagenet-cred",
        "shardcache-captions-run",
        "shardcache-captions-disk",
        "shardcache-captions-cred",
    ]


def test_mounts_annotation_adds_mounts_beyond_the_label() -> None:
    obj = pod()
    obj["metadata"]["annotations"] = {injection.ANNOTATION_MOUNTS: "captions, imagenet"}
    _, stored = admit(obj, dsm("imagenet"), dsm("captions"))
    assert [s["name"] for s in sidecars(stored)] == ["shardcache-imagenet", "shardcache-captions"]


def test_readmission_of_an_injected_pod_changes_nothing() -> None:
    _, once = admit(pod(label="imagenet_captions"), dsm("imagenet"), dsm("captions"))
    response, twice = admit(copy.deepcopy(once), dsm("imagenet"), dsm("captions"))
    assert response["allowed"] is True
    assert "patch" not in response
    assert twice == once
    # Even when a mount has been deleted since: the running pod keeps what it has.
    response, _ = admit(copy.deepcopy(once))
    assert response["allowed"] is True and "patch" not in response


def test_inject_is_idempotent_as_a_function() -> None:
    mount = injection.Mount(name="imagenet", spec=_spec(), digest=DIGEST)
    once = injection.inject(pod(), [mount], defaults=DEFAULTS)
    assert injection.inject(once, [mount], defaults=DEFAULTS) == once
    assert injection.json_patch(once, injection.inject(once, [mount], defaults=DEFAULTS)) == []


def _spec() -> Any:
    from shardcache_operator import specs

    return specs.parse_spec({"source": {"uri": "s3://data/imagenet/"}})


def test_missing_datasetmount_is_refused_naming_it() -> None:
    response, stored = admit(pod())
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    message = response["status"]["message"]
    assert "DatasetMount ml/imagenet does not exist" in message
    assert stored == pod()


def test_missing_datasetmount_admits_without_injection_under_admit_policy() -> None:
    response, stored = admit(pod(), missing_policy="Admit")
    assert response["allowed"] is True
    assert "patch" not in response
    assert "ml/imagenet does not exist" in response["warnings"][0]
    assert stored == pod()


def test_not_ready_datasetmount_is_refused_with_phase_and_reason() -> None:
    response, _ = admit(pod(), dsm("imagenet", phase="Degraded"))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "DatasetMount ml/imagenet is not Ready" in message
    assert "Degraded" in message and "connection refused" in message


def test_not_ready_datasetmount_with_admit_policy_admits_without_injection() -> None:
    response, stored = admit(pod(), dsm("imagenet", phase="Pending", admission={"policy": "Admit"}))
    assert response["allowed"] is True
    assert "patch" not in response
    assert "not Ready" in response["warnings"][0]
    assert stored == pod()


def test_unreconciled_spec_change_is_not_ready() -> None:
    response, _ = admit(pod(), dsm("imagenet", generation=2))
    assert response["allowed"] is False
    assert "generation 2 is not reconciled" in response["status"]["message"]


def test_one_of_two_mounts_missing_refuses_the_whole_pod() -> None:
    response, _ = admit(pod(label="imagenet_captions"), dsm("imagenet"))
    assert response["allowed"] is False
    assert "ml/captions does not exist" in response["status"]["message"]


def test_checkpoint_volume_and_env_reach_sidecar_and_trainers() -> None:
    checkpoint = {"uri": "s3://ckpt/run-1/", "keepLast": 2, "restore": "300"}
    _, stored = admit(pod(), dsm("imagenet", checkpoint=checkpoint))
    sidecar = sidecars(stored)[0]
    env = env_of(sidecar)
    assert env[contract.ENV_CHECKPOINT_URI] == "s3://ckpt/run-1/"
    assert env[contract.ENV_CHECKPOINT_KEEP_LAST] == "2"
    assert env[contract.ENV_CHECKPOINT_RESTORE] == "300"
    assert env[contract.ENV_CHECKPOINT_DIR] == "/checkpoints"
    volumes = {v["name"]: v for v in stored["spec"]["volumes"]}
    assert volumes["shardcache-imagenet-ckpt"]["emptyDir"] == {"sizeLimit": "20Gi"}
    (trainer,) = stored["spec"]["containers"]
    assert {"name": "shardcache-imagenet-ckpt", "mountPath": "/checkpoints"} in trainer[
        "volumeMounts"
    ]
    assert env_of(trainer)[contract.ENV_CHECKPOINT_DIR] == "/checkpoints"


CHECKPOINT_ENV = {
    contract.ENV_CHECKPOINT_DIR,
    contract.ENV_CHECKPOINT_URI,
    contract.ENV_CHECKPOINT_KEEP_LAST,
    contract.ENV_CHECKPOINT_RESTORE,
    contract.ENV_CHECKPOINT_RESTORE_FALLBACK,
    contract.ENV_CHECKPOINT_CONCURRENCY,
    contract.ENV_CHECKPOINT_VERIFY_UPLOADS,
    contract.ENV_CHECKPOINT_UPLOAD_BUFFER,
}


def checkpoint_env_of(stored: dict[str, Any]) -> dict[str, Any]:
    env = env_of(sidecars(stored)[0])
    return {k: v for k, v in env.items() if k.startswith("SHARDCACHE_CHECKPOINT_")}


def test_checkpoint_agent_settings_reach_the_sidecar_env() -> None:
    checkpoint = {
        "uri": "s3://ckpt/run-1/",
        "restoreFallback": True,
        "concurrency": 16,
        "verifyUploads": True,
        "uploadBuffer": "64Mi",
    }
    _, stored = admit(pod(), dsm("imagenet", checkpoint=checkpoint))
    assert checkpoint_env_of(stored) == {
        contract.ENV_CHECKPOINT_DIR: "/checkpoints",
        contract.ENV_CHECKPOINT_URI: "s3://ckpt/run-1/",
        contract.ENV_CHECKPOINT_KEEP_LAST: "3",
        contract.ENV_CHECKPOINT_RESTORE: "latest",
        contract.ENV_CHECKPOINT_RESTORE_FALLBACK: "true",
        contract.ENV_CHECKPOINT_CONCURRENCY: "16",
        contract.ENV_CHECKPOINT_VERIFY_UPLOADS: "true",
        contract.ENV_CHECKPOINT_UPLOAD_BUFFER: str(64 * 2**20),
    }
    (trainer,) = stored["spec"]["containers"]
    # Agent tuning is for the sidecar alone.
    assert set(env_of(trainer)) & CHECKPOINT_ENV == {contract.ENV_CHECKPOINT_DIR}


def test_checkpoint_agent_settings_are_written_at_their_defaults_too() -> None:
    _, stored = admit(pod(), dsm("imagenet", checkpoint={"uri": "s3://ckpt/run-1/"}))
    env = checkpoint_env_of(stored)
    assert set(env) == CHECKPOINT_ENV
    assert env[contract.ENV_CHECKPOINT_RESTORE_FALLBACK] == "false"
    assert env[contract.ENV_CHECKPOINT_CONCURRENCY] == "8"
    assert env[contract.ENV_CHECKPOINT_VERIFY_UPLOADS] == "false"
    assert env[contract.ENV_CHECKPOINT_UPLOAD_BUFFER] == str(512 * 2**20)
    _, again = admit(pod(), dsm("imagenet", checkpoint={"uri": "s3://ckpt/run-1/"}))
    assert sidecars(again)[0]["env"] == sidecars(stored)[0]["env"]


def test_without_checkpoint_no_agent_setting_is_written() -> None:
    _, stored = admit(pod(), dsm("imagenet"))
    assert checkpoint_env_of(stored) == {}


def test_a_taken_mount_path_refuses_the_pod_with_the_reason() -> None:
    obj = pod(volumes=[{"name": "data", "emptyDir": {}}])
    obj["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/checkpoints"}]
    response, _ = admit(obj, dsm("imagenet", checkpoint={"uri": "s3://ckpt/"}))
    assert response["allowed"] is False
    assert "already mounts something at /checkpoints" in response["status"]["message"]


def test_containers_annotation_limits_which_containers_are_trainers() -> None:
    obj = pod()
    obj["spec"]["containers"].append({"name": "logger", "image": "fluentbit"})
    obj["metadata"]["annotations"] = {injection.ANNOTATION_CONTAINERS: "trainer"}
    _, stored = admit(obj, dsm("imagenet"))
    trainer, logger = stored["spec"]["containers"]
    assert contract.ENV_MOUNT in env_of(trainer)
    assert logger == {"name": "logger", "image": "fluentbit"}


def test_user_chosen_default_mount_is_kept() -> None:
    obj = pod(label="imagenet_captions")
    obj["spec"]["containers"][0]["env"] = [{"name": contract.ENV_MOUNT, "value": "captions"}]
    _, stored = admit(obj, dsm("imagenet"), dsm("captions"))
    assert env_of(stored["spec"]["containers"][0])[contract.ENV_MOUNT] == "captions"


def test_long_mount_names_give_valid_container_and_volume_names() -> None:
    name = "a" * 30 + "." + "b" * 32
    response, stored = admit(pod(label=name), dsm(name))
    assert response["allowed"] is True
    for key in ("initContainers", "volumes"):
        for item in all_names(stored, key):
            assert len(item) <= 63 and "." not in item, item


def test_invalid_label_value_is_refused_with_the_reason() -> None:
    response, _ = admit(pod(label="Bad-Name"), dsm("imagenet"))
    assert response["allowed"] is False
    assert "'Bad-Name'" in response["status"]["message"]


def test_datasetmount_being_deleted_is_not_ready() -> None:
    deleting = dsm("imagenet")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    response, _ = admit(pod(), deleting)
    assert response["allowed"] is False
    assert "DatasetMount ml/imagenet is being deleted" in response["status"]["message"]


def test_a_pod_refused_for_a_mount_being_deleted_is_told_it_will_not_be_ready_again() -> None:
    """Exploration s18-xnode defect 4: the refusal said "wait until ... shows Ready", which a
    mount being deleted never does again."""
    deleting = dsm("imagenet")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    response, _ = admit(pod(), deleting)
    message = response["status"]["message"]
    assert response["allowed"] is False
    assert "shows Ready" not in message
    assert "will not be Ready again" in message
    assert "recreate it once `kubectl get dsm imagenet` finds none" in message
    assert f"remove imagenet from the pod's {injection.LABEL_MOUNT} label" in message


def test_each_rank_of_an_indexed_job_publishes_checkpoints_under_its_own_prefix() -> None:
    obj = pod(sharding={})
    obj["metadata"]["annotations"] = {injection.ANNOTATION_JOB_INDEX: "3"}
    obj["metadata"]["labels"]["batch.kubernetes.io/job-name"] = "resnet"
    obj["metadata"]["ownerReferences"] = [
        {"kind": "Job", "name": "resnet", "uid": "u", "apiVersion": "batch/v1"}
    ]
    checkpoint = {"uri": "s3://ckpt/run-1/"}
    _, stored = admit(obj, dsm("imagenet", sharding={"worldSize": 4}, checkpoint=checkpoint))
    env = sidecars(stored)[0]["env"]
    order = [e["name"] for e in env]
    # The kubelet expands $(VAR) only from variables defined before it.
    assert order.index(contract.ENV_RANK) < order.index(contract.ENV_CHECKPOINT_URI)
    assert env_of(sidecars(stored)[0])[contract.ENV_CHECKPOINT_URI] == (
        f"s3://ckpt/run-1/rank-$({contract.ENV_RANK})"
    )


def test_a_fixed_rank_publishes_under_its_rank_and_an_unranked_pod_under_the_uri() -> None:
    checkpoint = {"uri": "s3://ckpt/run-1"}
    sharding = {"rankFrom": "Fixed", "rank": 2, "worldSize": 3}
    _, stored = admit(pod(), dsm("imagenet", sharding=sharding, checkpoint=checkpoint))
    assert env_of(sidecars(stored)[0])[contract.ENV_CHECKPOINT_URI] == "s3://ckpt/run-1/rank-2"
    _, stored = admit(pod(), dsm("imagenet", checkpoint=checkpoint))
    assert env_of(sidecars(stored)[0])[contract.ENV_CHECKPOINT_URI] == "s3://ckpt/run-1"


def test_a_trainer_whose_env_and_volume_mounts_are_yaml_nulls_is_injected() -> None:
    # `env:` or `volumeMounts:` with nothing under it is a null in YAML (offline inject).
    body = pod(
        containers=[{"name": "trainer", "image": "python:3.11", "env": None, "volumeMounts": None}]
    )
    response, stored = admit(body, dsm("imagenet"))
    assert response["allowed"] is True
    (trainer,) = stored["spec"]["containers"]
    assert env_of(trainer)[contract.ENV_MOUNT] == "imagenet"
    assert trainer["volumeMounts"], "the run volume is mounted into the trainer"


@pytest.mark.parametrize(("env", "found"), [(1, "env: expected a list"), ([None], "env[0]")])
def test_a_trainer_whose_env_is_not_a_list_of_mappings_is_refused_naming_it(
    env: object, found: str
) -> None:
    # The fuzz test's examples: these answered 500 (an AttributeError, a TypeError).
    body = pod(containers=[{"name": "trainer", "image": "python:3.11", "env": env}])
    response, _ = admit(body, dsm("imagenet"))
    assert response["allowed"] is False
    assert found in response["status"]["message"]
