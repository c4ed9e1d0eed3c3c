"""What the node tier runs on the real node, as pure builders, and how it reads results.

The trainer program (tests/node/trainer.py) travels in a ConfigMap and runs with the
trainer image's `python3`; its JSON lines (`TRAINER {...}`) are parsed here, and the
dataset's known totals (tests/support/datasets.py makes every row from its uid) are what
they are checked against.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardcache_operator import injection

from tests.support import datasets

TRAINER_SOURCE = pathlib.Path(__file__).with_name("trainer.py")
TRAINER_CONFIGMAP = "node-trainer"
TRAINER_DIR = "/opt/node-test"
TRAINER_PREFIX = "TRAINER "
TRAINER_CONTAINER = "trainer"


def trainer_configmap() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": TRAINER_CONFIGMAP},
        "data": {"trainer.py": TRAINER_SOURCE.read_text()},
    }


def trainer_container(image: str, settings: Mapping[str, object]) -> dict[str, Any]:
    """The trainer container: the program above with TRAINER_* `settings` as env."""
    return {
        "name": TRAINER_CONTAINER,
        "image": image,
        "imagePullPolicy": "Never",
        "command": ["python3", f"{TRAINER_DIR}/trainer.py"],
        "env": [{"name": k, "value": str(v)} for k, v in settings.items()],
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": [{"name": "trainer", "mountPath": TRAINER_DIR, "readOnly": True}],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def pod_spec(
    image: str, settings: Mapping[str, object], *, node_selector: Mapping[str, str],
    tolerations: Sequence[Mapping[str, str]], restart_policy: str = "Never",
) -> dict[str, Any]:  # fmt: skip
    return {
        "restartPolicy": restart_policy,
        "terminationGracePeriodSeconds": 5,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "nodeSelector": dict(node_selector),
        "tolerations": [dict(t) for t in tolerations],
        "containers": [trainer_container(image, settings)],
        "volumes": [{"name": "trainer", "configMap": {"name": TRAINER_CONFIGMAP}}],
    }


def indexed_job(
    name: str,
    mount: str,
    image: str,
    *,
    ranks: int,
    settings: Mapping[str, object],
    node_selector: Mapping[str, str],
    tolerations: Sequence[Mapping[str, str]],
    backoff_limit: int = 0,
) -> dict[str, Any]:
    """An Indexed Job of `ranks` pods, all at once, opted in to `mount`."""
    spec = pod_spec(
        image,
        {"TRAINER_WORLD_SIZE": ranks, **settings},
        node_selector=node_selector,
        tolerations=tolerations,
    )
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completionMode": "Indexed",
            "completions": ranks,
            "parallelism": ranks,
            "backoffLimit": backoff_limit,
            "template": {
                "metadata": {"labels": {injection.LABEL_MOUNT: mount, "job": name}},
                "spec": spec,
            },
        },
    }


def single_pod(
    name: str,
    mount: str,
    image: str,
    *,
    settings: Mapping[str, object],
    node_selector: Mapping[str, str],
    tolerations: Sequence[Mapping[str, str]],
) -> dict[str, Any]:
    """One trainer pod reading the whole dataset (world size 1)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {injection.LABEL_MOUNT: mount}},
        "spec": pod_spec(
            image,
            {"TRAINER_WORLD_SIZE": 1, **settings},
            node_selector=node_selector,
            tolerations=tolerations,
        ),
    }


# -- reading what the trainer reported --------------------------------------------------


def events(log: str) -> list[dict[str, Any]]:
    """The trainer's JSON events in a container log, in order."""
    return [
        json.loads(line[len(TRAINER_PREFIX) :])
        for line in log.splitlines()
        if line.startswith(TRAINER_PREFIX)
    ]


def event(log: str, name: str) -> dict[str, Any]:
    """The last event `name` in the log; fails with the log when there is none."""
    found = [e for e in events(log) if e["event"] == name]
    assert found, f"the trainer reported no {name!r} event; its log:\n{log[-4000:]}"
    return found[-1]


def expand(runs: Iterable[Sequence[int]]) -> list[int]:
    return [uid for start, stop in runs for uid in range(start, stop)]


@dataclasses.dataclass(frozen=True)
class Totals:
    """What a reader of a set of sample ids must report: count, id sum, checksums."""

    rows: int
    uid_sum: int
    text_crc: int
    token_sum: int

    @classmethod
    def of(cls, uids: Sequence[int]) -> Totals:
        """Computed from the dataset's own rows (datasets.make_table builds row `uid`)."""
        if not uids:
            return cls(0, 0, 0, 0)
        table = datasets.make_table(0, max(uids) + 1)
        texts = table.column("text").to_pylist()
        tokens = table.column("tokens").to_pylist()
        return cls(
            len(uids),
            sum(uids),
            sum(zlib.crc32(texts[u].encode()) for u in uids),
            sum(sum(tokens[u]) for u in uids),
        )

    @classmethod
    def reported(cls, done: Mapping[str, Any]) -> Totals:
        return cls(
            int(done["rows"]), int(done["uid_sum"]), int(done["text_crc"]), int(done["token_sum"])
        )


def rank_rows(total: int, rank: int, world_size: int) -> int:
    """Rows rank `rank` reads in one epoch (shardcache.plans.rank_bounds)."""
    return total * (rank + 1) // world_size - total * rank // world_size
