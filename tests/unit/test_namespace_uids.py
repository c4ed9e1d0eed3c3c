"""The node disk directory is keyed by the namespace's UID (`namespace_dirs`), which the
webhook learns from its namespace watch or one GET (`namespace_uids.Store`): a namespace
deleted and created again with the same name gets a directory of its own, never the
earlier tenant's cached entries; a pod whose namespace's UID cannot be read is refused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from shardcache_operator import (
    namespace_dirs,
    namespace_uids,
    pod_env,
    webhook,
)

from shardcache import contract
from tests.unit.test_injection import pod, review_request
from tests.unit.test_injection_security import (
    AGAIN,
    FIRST,
    Namespaces,
    admitted,
    memo_of,
    node_directory,
)

pytestmark = pytest.mark.unit


def namespace(name: str, uid: str, **metadata: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "uid": uid, **metadata},
    }


async def test_the_watch_serves_the_uid_and_a_namespace_created_again_gets_the_new_one() -> None:
    api = Namespaces(fail=AssertionError("a watched namespace costs no read"))
    memo = memo_of(api)
    memo.namespaces.listed([namespace("ml", FIRST), namespace("other", AGAIN)])
    assert node_directory(await admitted(memo)) == f"ns-ml.{FIRST}"
    memo.namespaces.seen("ADDED", namespace("ml", FIRST))
    # Deleted and created again: Terminating, then gone, then a new UID.
    memo.namespaces.seen(
        "MODIFIED", namespace("ml", FIRST, deletionTimestamp="2026-11-28T15:00:00Z")
    )
    memo.namespaces.seen("DELETED", namespace("ml", FIRST))
    memo.namespaces.seen("ADDED", namespace("ml", AGAIN))
    assert node_directory(await admitted(memo)) == f"ns-ml.{AGAIN}"
    assert api.reads == 0


async def test_a_terminating_namespaces_uid_is_no_longer_served_from_memory() -> None:
    """From its first event with a deletionTimestamp: the watch's DELETED may come late,
    and the name may be given again soon after."""
    store = namespace_uids.Store()
    store.listed([namespace("ml", FIRST)])
    assert store.cached("ml") == FIRST
    store.seen("MODIFIED", namespace("ml", FIRST, deletionTimestamp="2026-11-28T15:00:00Z"))
    assert store.cached("ml") is None
    api = Namespaces(uid=AGAIN)
    assert await store.uid("ml", api.read_namespace_uid) == AGAIN
    assert api.reads == 1


async def test_a_lost_watch_serves_nothing_from_memory_and_reads_the_api() -> None:
    store = namespace_uids.Store()
    store.listed([namespace("ml", FIRST)])
    store.lost()
    api = Namespaces(uid=AGAIN)
    assert await store.uid("ml", api.read_namespace_uid) == AGAIN
    assert await store.uid("ml", api.read_namespace_uid) == AGAIN
    assert api.reads == 2, "a GET's answer is never kept: only the watch sees deletions"


async def test_admissions_of_one_namespace_share_one_read() -> None:
    store = namespace_uids.Store()
    api = Namespaces(uid=FIRST)
    api.hold = asyncio.Event()
    waiting = [asyncio.ensure_future(store.uid("ml", api.read_namespace_uid)) for _ in range(20)]
    await asyncio.sleep(0)
    api.hold.set()
    assert await asyncio.gather(*waiting) == [FIRST] * 20
    assert api.reads == 1


@pytest.mark.parametrize(
    ("api", "said"),
    [
        (Namespaces(fail=PermissionError("the operator's identity may not get namespace ml")),
         "reading namespace ml failed (PermissionError: the operator's identity may not get "
         "namespace ml)"),
        (Namespaces(uid=None), "namespace ml does not exist"),
        (Namespaces(uid="not-a-uuid"),
         "namespace ml: expected metadata.uid to be a lowercase UUID (8-4-4-4-12 hex digits), "
         "found 'not-a-uuid'"),
    ],
)  # fmt: skip
async def test_a_pod_whose_namespaces_uid_cannot_be_read_is_refused_saying_why(
    api: Namespaces, said: str
) -> None:
    memo = memo_of(api)
    response = (await webhook.answer(review_request(pod()), memo))["response"]
    assert response["allowed"] is False
    assert "patch" not in response
    message = response["status"]["message"]
    assert message.startswith(f"the UID of namespace ml could not be read: {said}; ")
    assert "the node disk tier is keyed by it" in message


async def test_a_read_that_does_not_answer_refuses_the_pod_within_the_bound() -> None:
    store = namespace_uids.Store(read_timeout_seconds=0.01)
    api = Namespaces()
    api.hold = asyncio.Event()  # never set: the API server does not answer
    with pytest.raises(namespace_uids.Unavailable, match=r"reading namespace ml took over 0\.01 s"):
        await store.uid("ml", api.read_namespace_uid)


async def test_a_pod_with_nothing_to_inject_is_admitted_without_a_read() -> None:
    api = Namespaces(fail=AssertionError("no mount to inject: no UID needed"))
    memo = memo_of(api)
    response = (await webhook.answer(review_request(pod(label=None)), memo))["response"]
    assert response["allowed"] is True and api.reads == 0


def test_a_namespaced_watch_asks_for_each_served_namespace_by_name() -> None:
    """RBAC's resourceNames allows list and watch only with a metadata.name selector."""
    assert namespace_uids.selections(()) == {"": {}}
    assert namespace_uids.selections(("a", "b")) == {
        "a": {"fieldSelector": "metadata.name=a"},
        "b": {"fieldSelector": "metadata.name=b"},
    }


def test_the_node_directory_is_keyed_by_name_and_uid_and_legacy_without_a_uid() -> None:
    assert pod_env.namespace_subdir("team-a", FIRST) == f"ns-team-a.{FIRST}"
    assert pod_env.namespace_subdir("team-a", None) == "ns-team-a"
    # The sidecar's own path stays the name's: only the node's directory is keyed.
    assert pod_env.disk_dir("team-a") == f"{contract.DEFAULT_DISK_DIR}/ns-team-a"


@pytest.mark.parametrize(
    ("namespace_name", "uid"),
    [("team-a", "../../etc"), ("team-a", FIRST.upper()), ("team-a", ""), ("../x", FIRST)],
)
def test_a_directory_is_never_named_from_anything_but_a_namespace_and_its_uid(
    namespace_name: str, uid: str
) -> None:
    with pytest.raises(ValueError, match="expected"):
        namespace_dirs.keyed(namespace_name, uid)
