"""Every file under examples/ applied to the real node as written, with only the image
names substituted by the images this project built (and the placeholder credentials of
examples/s3-credentials.yaml filled in: its values say `replace-me`, and its endpoint
names a DNS name this cluster, which has no DNS, cannot resolve).

The objects live where the examples put them (namespace `default`). For the duration of
this module kwok's fake nodes are cordoned and the real node's taint lifted, so the
examples' pods, which carry no node selector, run on the real node and nowhere else.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import kubernetes.client
import pytest
import yaml
from kubernetes.client.rest import ApiException
from shardcache_operator import injection, specs

from tests.e2e import harness, objects
from tests.node.product import pods, release
from tests.support import datasets, s3server

# Fixture set-up (images, the release, a Ready mount) counts towards the first test.
pytestmark = [pytest.mark.node, pytest.mark.timeout(900)]

EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples"
NAMESPACE = "default"
#: The data the examples name: s3://datasets/imagenet/train/ (Parquet) and
#: s3://datasets/pile/jsonl/ (JSONL); checkpoints go to s3://checkpoints/.
IMAGENET_SHARDS = (30, 41, 22, 57)
PILE_SHARDS = (12, 9)
JOB = "resnet-train"
JOB_RANKS = 4
#: Four ranks that each ask for a whole CPU run one or two at a time on two cores.
JOB_TIMEOUT_S = 600.0


def documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def substitute_images(doc: dict[str, Any], image: str) -> dict[str, Any]:
    """The same object with every container image replaced by `image`."""
    text = yaml.safe_dump(doc)
    return dict(yaml.safe_load(re.sub(r"(?m)^(\s*-?\s*image:\s*).*$", rf"\g<1>{image}", text)))


def fill_credentials(doc: dict[str, Any], store: s3server.S3Server) -> dict[str, Any]:
    if doc["kind"] == "Secret":
        assert set(doc["stringData"]) == set(store.env()), "the example Secret's keys changed"
        doc = {**doc, "stringData": store.env()}
    return doc


@pytest.fixture(scope="module")
def only_the_real_node(
    admin: kubernetes.client.ApiClient, real_node: release.RealNode
) -> Iterator[None]:
    core = kubernetes.client.CoreV1Api(admin)
    others = [n.metadata.name for n in core.list_node().items if n.metadata.name != real_node.name]
    taints = core.read_node(real_node.name).spec.taints or []
    for name in others:
        core.patch_node(name, {"spec": {"unschedulable": True}})
    core.patch_node(real_node.name, {"spec": {"taints": []}})
    try:
        yield
    finally:
        core.patch_node(real_node.name, {"spec": {"taints": [t.to_dict() for t in taints]}})
        for name in others:
            core.patch_node(name, {"spec": {"unschedulable": False}})


def prepared(
    docs: list[dict[str, Any]], images: release.ProductImages, store: s3server.S3Server
) -> str:
    """The examples as one manifest, images substituted, placeholder credentials filled."""
    return "---\n".join(
        yaml.safe_dump(fill_credentials(substitute_images(d, images.trainer), store)) for d in docs
    )


def is_notebook(doc: dict[str, Any]) -> bool:
    return bool(doc["kind"] == "Deployment" and doc["metadata"]["name"] == "notebook")


@pytest.fixture(scope="module")
def applied(
    admin: kubernetes.client.ApiClient,
    node_cluster: harness.Cluster,
    operator: harness.InClusterOperator,
    node_store: s3server.S3Server,
    product_images: release.ProductImages,
    only_the_real_node: None,
) -> Iterator[None]:
    """Every example but the notebook Deployment (its test applies it, last: its pod asks
    for 1.75 CPU and would keep the Job's ranks, 1.25 CPU each, off a 2-core node)."""
    fs = node_store.filesystem(allow_bucket_creation=True)
    for bucket in ("datasets", "checkpoints"):
        fs.create_dir(bucket)
    datasets.write_dataset(fs, "datasets/imagenet/train", IMAGENET_SHARDS)
    datasets.write_dataset(fs, "datasets/pile/jsonl", PILE_SHARDS, fmt="jsonl")
    manifest = prepared([d for d in documents() if not is_notebook(d)], product_images, node_store)
    node_cluster.run("kubectl", "apply", "-f", "-", stdin=manifest)
    try:
        yield
    finally:
        node_cluster.run(
            "kubectl", "delete", "-f", "-", "--wait=false", "--ignore-not-found",
            stdin=prepared(documents(), product_images, node_store), check=False,
        )  # fmt: skip
        _release(admin)
        core = kubernetes.client.CoreV1Api(admin)
        harness.wait_until(
            "the examples' pods to be gone",
            lambda: (
                not core.list_namespaced_pod(NAMESPACE, label_selector=injection.LABEL_MOUNT).items
            ),
            timeout=release.GONE_TIMEOUT_S,
        )


def _release(admin: kubernetes.client.ApiClient) -> None:
    custom = kubernetes.client.CustomObjectsApi(admin)
    group, version, plural = specs.GROUP, specs.VERSION, specs.PLURAL
    for name in ("imagenet-train", "pile-text"):
        patch = {"metadata": {"annotations": {specs.ANNOTATION_FORCE_DELETE: "true"}}}
        with contextlib.suppress(ApiException):
            custom.patch_namespaced_custom_object(group, version, NAMESPACE, plural, name, patch)
            custom.delete_namespaced_custom_object(group, version, NAMESPACE, plural, name)


def test_the_example_datasetmounts_go_ready(
    admin: kubernetes.client.ApiClient,
    operator: harness.InClusterOperator,
    applied: None,
) -> None:
    imagenet = objects.wait_phase(admin, NAMESPACE, "imagenet-train", "Ready", operator)
    assert imagenet["rows"] == sum(IMAGENET_SHARDS)
    pile = objects.wait_phase(admin, NAMESPACE, "pile-text", "Ready", operator)
    assert pile["rows"] == sum(PILE_SHARDS)


def test_the_example_training_job_completes_and_its_ranks_read_every_row(
    admin: kubernetes.client.ApiClient,
    operator: harness.InClusterOperator,
    applied: None,
) -> None:
    objects.wait_phase(admin, NAMESPACE, "imagenet-train", "Ready", operator)
    pods.wait_job_complete(admin, NAMESPACE, JOB, timeout=JOB_TIMEOUT_S)
    core = kubernetes.client.CoreV1Api(admin)
    counts = {}
    for pod in pods.job_pods(core, NAMESPACE, JOB):
        if pod.status.phase != "Succeeded":
            continue
        log = pods.log(core, NAMESPACE, pod.metadata.name, "trainer")
        match = re.search(r"rank (\d+): (\d+) rows", log)
        assert match, f"{pod.metadata.name} printed no row count: {log[-2000:]}"
        counts[int(match.group(1))] = int(match.group(2))
    total = sum(IMAGENET_SHARDS)
    assert sorted(counts) == list(range(JOB_RANKS))
    assert counts == {r: total * (r + 1) // 4 - total * r // 4 for r in range(JOB_RANKS)}


def test_the_example_notebook_is_admitted_with_both_caches_for_its_notebook_container(
    admin: kubernetes.client.ApiClient,
    node_cluster: harness.Cluster,
    node_store: s3server.S3Server,
    product_images: release.ProductImages,
    applied: None,
) -> None:
    notebook = [d for d in documents() if is_notebook(d)]
    assert len(notebook) == 1
    node_cluster.run(
        "kubectl", "apply", "-f", "-", stdin=prepared(notebook, product_images, node_store)
    )
    core = kubernetes.client.CoreV1Api(admin)
    found = harness.wait_until(
        "the notebook's pod",
        lambda: core.list_namespaced_pod(NAMESPACE, label_selector="app=notebook").items or None,
        timeout=120,
    )
    pod = found[0]
    sidecars = [c.name for c in pod.spec.init_containers or []]
    assert sorted(sidecars) == ["shardcache-imagenet-train", "shardcache-pile-text"], sidecars
    env = {c.name: {e.name for e in c.env or []} for c in pod.spec.containers}
    assert "SHARDCACHE_MOUNTS" in env["notebook"]
    assert not any(n.startswith("SHARDCACHE_") for n in env["log-shipper"])
