"""A multi-source DatasetMount through the real API server: CEL refuses bad mixtures,
the operator pins every source, the webhook hands every source to the pod's sidecar,
and that sidecar (started here with the env the API server stored) serves them all to
`shardcache.open_mixture()`."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException
from shardcache_operator import manifest_handoff

import shardcache
from shardcache import contract, manifests
from shardcache.contract import variables
from tests.e2e import harness, objects
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.e2e

CODE_ROWS = (20, 33)


def mixture_mount(mount: str, web: str, code: str, **mixture: Any) -> dict[str, Any]:
    spec = {
        "name": "web",
        "weight": 3,
        "seed": 5,
        "sources": [{"name": "code", "weight": 1, "uri": code, "format": "parquet"}],
        **mixture,
    }
    return objects.datasetmount(mount, web, mixture=spec)


def test_a_mixture_with_a_repeated_source_name_is_refused_by_the_api_server(
    admin: kubernetes.client.ApiClient, release: object, workload_namespace: str
) -> None:
    body = mixture_mount("mix-dup", "s3://b/web/", "s3://b/code/", name="code")
    with pytest.raises(ApiException) as refused:
        objects.create_datasetmount(admin, workload_namespace, body)
    assert refused.value.status == 422, refused.value.body
    assert "every source needs its own name" in json.loads(refused.value.body)["message"]


def test_a_multi_source_mount_pins_every_source_and_its_sidecar_serves_them_all(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
    sidecar_factory: Callable[..., SidecarProcess],
    tmp_path: Path,
) -> None:
    web = objects.write_shards(object_store, shard_rows=(40, 25, 31))
    code = objects.write_shards(object_store, shard_rows=CODE_ROWS)
    name = objects.unique("mix")
    objects.create_datasetmount(admin, workload_namespace, mixture_mount(name, web, code))
    status = objects.wait_phase(admin, workload_namespace, name, "Ready", operator)
    options = harness.store_env(object_store)
    web_digest = manifests.resolve(web, format="parquet", storage_options=options).digest
    code_digest = manifests.resolve(code, format="parquet", storage_options=options).digest
    assert status["manifestDigest"] == web_digest
    (pin,) = status["mixture"]
    assert (pin["name"], pin["manifestDigest"], pin["rows"]) == ("code", code_digest, 53)

    # The webhook gives the pod's one sidecar every source with its weight and pin.
    core = kubernetes.client.CoreV1Api(admin)
    created = core.create_namespaced_pod(workload_namespace, objects.pod(None, name))
    stored = admin.sanitize_for_serialization(
        core.read_namespaced_pod(str(created.metadata.name), workload_namespace)
    )
    (sidecar,) = [c for c in stored["spec"]["initContainers"] if c["name"] == f"shardcache-{name}"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    mixture = variables.MIXTURE.parse(env[contract.ENV_MIXTURE])
    assert [(s.name, s.weight, s.uri, s.digest) for s in mixture.sources] == [
        ("web", 3, web, web_digest),
        ("code", 1, code, code_digest),
    ]

    # Both pinned manifests are handed (rbac.manifestNamespaces lists the namespace): the
    # pod's projected volume names the operator's ConfigMaps, which exist, each with the
    # pin it hands; here the test does the kubelet's projection into a directory.
    handed = tmp_path / "handed"
    handed.mkdir()
    (volume,) = [v for v in stored["spec"]["volumes"] if v["name"] == f"shardcache-{name}-mfst"]
    projected = volume["projected"]["sources"]
    pins = set()
    for source in projected:
        ref = source["configMap"]
        assert ref["optional"] is True
        try:
            config_map = core.read_namespaced_config_map(ref["name"], workload_namespace)
        except ApiException as exc:
            assert exc.status == 404  # a part past the manifest's: none for one this small
            continue
        pins.add(config_map.metadata.annotations[manifest_handoff.ANNOTATION_DIGEST])
        (item,) = ref["items"]
        data = base64.b64decode(config_map.binary_data[item["key"]])
        (handed / item["path"]).write_bytes(data)
    assert pins == {web_digest, code_digest}
    assert len(list(handed.iterdir())) == 2

    # That sidecar, with the env the API server stored (its layout moved to this
    # machine) and the Secret's settings, takes both manifests it was handed and serves
    # both sources from the object store.
    served = {
        key: env[key]
        for key in (
            contract.ENV_MIXTURE,
            contract.ENV_MANIFEST_DIGEST,
            contract.ENV_SOURCE_FORMAT,
            contract.ENV_SEED,
        )
    }
    served[contract.ENV_HANDED_MANIFESTS_DIR] = str(handed)
    proc = sidecar_factory(env[contract.ENV_SOURCE_URI], env={**served, **options})
    proc.start(wait="ready")
    log = proc.log_tail(lines=100_000)
    assert log.count("handed by the operator") == 2, log[-3000:]
    with shardcache.open_mixture(environ=proc.client_env(), block_size=8) as mixed:
        batches = list(mixed.batches(8, steps=40))
        snap = mixed.snapshot()
    assert all(b.num_rows == 8 for b in batches)
    counts = {n: s["batches"] for n, s in snap["sources"].items()}
    assert counts["web"] + counts["code"] == 40 and min(counts.values()) > 0
    # Every row of the code source was read in order of its plan: its epochs finished
    # plus its position account for every row it served.
    code_state = snap["sources"]["code"]
    assert code_state["rows"] == counts["code"] * 8
    assert (
        code_state["epochs_finished"] * sum(CODE_ROWS) + code_state["position"]
        == (code_state["rows"])
    )
