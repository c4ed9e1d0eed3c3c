"""A one-rank training Job that resumes from its checkpoints, preempted on the real
node: the mount it reads, the Job, its first pod's published checkpoint, and the
replacement pod that finishes the Job after the first is deleted (test_faults.py,
test_skip.py)."""

from __future__ import annotations

import secrets
from typing import Any

import kubernetes.client

from tests.e2e import harness
from tests.node.product import jobs, pods, release
from tests.support import s3server

#: After its checkpoint is published the first pod waits this long, for the test to
#: delete it meanwhile (a resumed run does not wait).
HOLD_SECONDS = 600


def resumable_mount(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    store: s3server.S3Server,
    namespace: str,
    name: str,
    *,
    checkpoint_uri: str,
) -> release.Mount:
    """A Ready mount of `release.TRAIN_SHARDS` for one rank (its JobCompletionIndex),
    whose sidecar publishes checkpoints to `checkpoint_uri`, keeps the last two and
    restores `latest` before the trainer starts."""
    return release.make_mount(
        admin, operator, store, namespace, name, release.TRAIN_SHARDS,
        sharding={"seed": release.TRAIN_SEED, "worldSize": 1,
                  "blockSize": release.TRAIN_BLOCK_SIZE, "rankFrom": "JobCompletionIndex"},
        checkpoint={"uri": checkpoint_uri, "keepLast": 2, "restore": "latest",
                    "mountPath": "/checkpoints", "size": "64Mi"},
        sidecar=release.small_sidecar(),
    )  # fmt: skip


def start_job(
    admin: kubernetes.client.ApiClient,
    namespace: str,
    prefix: str,
    mount: release.Mount,
    product_images: release.ProductImages,
    real_node: release.RealNode,
    **settings: object,
) -> str:
    """Create a one-rank Job on `mount` whose trainer resumes from `latest`, with the
    further TRAINER_* `settings`; its name (`prefix-<random>`). A deleted pod is
    replaced (backoffLimit 2)."""
    name = f"{prefix}-{secrets.token_hex(3)}"
    body = jobs.indexed_job(
        name, mount.name, product_images.trainer, ranks=1,
        settings=release.trainer_settings(
            TRAINER_HOLD_SECONDS=HOLD_SECONDS, TRAINER_RESUME="latest", **settings
        ),
        node_selector=real_node.node_selector, tolerations=real_node.tolerations,
        backoff_limit=2,
    )  # fmt: skip
    kubernetes.client.BatchV1Api(admin).create_namespaced_job(namespace, body)
    return name


def wait_first_checkpoint(
    core: kubernetes.client.CoreV1Api, namespace: str, job: str
) -> tuple[str, dict[str, Any]]:
    """The Job's one pod, once its trainer committed a checkpoint and the sidecar
    published it: the pod's name and the trainer's `checkpoint` event."""
    first = harness.wait_until(
        f"a pod of Job {job}", lambda: pods.job_pods(core, namespace, job) or None, timeout=60
    )
    assert len(first) == 1
    name: str = first[0].metadata.name
    committed = pods.wait_event(
        core, namespace, name, lambda e: e["event"] == "checkpoint",
        "a checkpoint committed and published",
    )  # fmt: skip
    return name, committed


def preempt(
    admin: kubernetes.client.ApiClient,
    core: kubernetes.client.CoreV1Api,
    namespace: str,
    job: str,
    first: str,
) -> str:
    """Delete the Job's pod `first` and wait for the Job to complete; the trainer log of
    the one pod that replaced it."""
    core.delete_namespaced_pod(first, namespace)
    pods.wait_job_complete(admin, namespace, job)
    replacement = [p for p in pods.job_pods(core, namespace, job) if p.metadata.name != first]
    assert len(replacement) == 1, [p.metadata.name for p in replacement]
    return pods.log(core, namespace, replacement[0].metadata.name, jobs.TRAINER_CONTAINER)
