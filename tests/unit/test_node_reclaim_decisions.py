"""Which namespace directories of a node path the node-cache DaemonSet reclaims
(`reclaim_decisions.decide`, pure): `ns-<namespace>.<uid>` once no live namespace has
that (name, UID) pair; legacy `ns-<namespace>` once its namespace is gone or the live
namespace's keyed directory exists; refused names said, anything else ignored;
leftovers removed."""

from __future__ import annotations

import pytest
from shardcache_operator import pod_env, reclaim_decisions

pytestmark = pytest.mark.unit

OLD = "11111111-2222-4333-8444-555555555555"
NEW = "66666666-7777-4888-9999-aaaaaaaaaaaa"
OTHER = "bbbbbbbb-cccc-4ddd-8eee-ffffffffffff"


def test_a_deleted_namespaces_directory_is_reclaimed_and_a_live_ones_kept() -> None:
    decision = reclaim_decisions.decide(
        [f"ns-gone.{OLD}", f"ns-live.{NEW}"], {"live": NEW, "kube-system": OTHER}
    )
    assert decision.reclaim == ((f"ns-gone.{OLD}", "gone", "deleted namespace gone"),)
    assert not decision.refused and not decision.leftovers


def test_a_namespace_created_again_with_the_same_name_has_its_predecessors_directory_reclaimed() -> (
    None
):
    """The name is live again, under a new UID: the earlier tenant's entries go."""
    decision = reclaim_decisions.decide([f"ns-team.{OLD}", f"ns-team.{NEW}"], {"team": NEW})
    ((name, namespace, why),) = decision.reclaim
    assert (name, namespace) == (f"ns-team.{OLD}", "team")
    assert why == f"deleted namespace team UID {OLD}; the live one's UID is {NEW}"


def test_every_directory_is_kept_while_its_namespace_exists() -> None:
    live = {"a": OLD, "team-b": NEW, "x" * 63: OTHER}
    names = [pod_env.namespace_subdir(ns, uid) for ns, uid in live.items()]
    assert reclaim_decisions.decide(names, live) == reclaim_decisions.Decision()


def test_a_legacy_directory_of_a_deleted_namespace_is_reclaimed() -> None:
    decision = reclaim_decisions.decide(["ns-gone"], {"live": NEW})
    assert decision.reclaim == (("ns-gone", "gone", "deleted namespace gone"),)


def test_a_legacy_directory_is_reclaimed_once_its_live_namespaces_keyed_one_exists() -> None:
    """Its pods use the keyed one now; the legacy one only serves pods injected before,
    which hold locks in it while they run (the I/O side checks those)."""
    decision = reclaim_decisions.decide(["ns-team", f"ns-team.{NEW}"], {"team": NEW})
    assert decision.reclaim == (
        (
            "ns-team",
            "team",
            f"legacy directory of namespace team, whose pods now use ns-team.{NEW}",
        ),
    )


def test_a_legacy_directory_is_kept_while_its_live_namespace_has_no_keyed_one_here() -> None:
    # Only a stale keyed one (a predecessor's) is there: the live namespace's pods have
    # not run on this node since the upgrade; the stale one goes.
    decision = reclaim_decisions.decide(["ns-team", f"ns-team.{OLD}"], {"team": NEW})
    assert [name for name, _, _ in decision.reclaim] == [f"ns-team.{OLD}"]


def test_a_live_namespace_without_a_uid_keeps_every_directory_of_its_name() -> None:
    decision = reclaim_decisions.decide(["ns-team", f"ns-team.{OLD}"], {"team": ""})
    assert decision == reclaim_decisions.Decision()


def test_the_directory_name_is_the_one_the_webhook_mounts() -> None:
    assert reclaim_decisions.namespace_of(pod_env.namespace_subdir("team-a", NEW)) == "team-a"
    assert reclaim_decisions.namespace_of(pod_env.namespace_subdir("team-a", None)) == "team-a"


def test_names_outside_the_ns_prefix_are_ignored() -> None:
    # An older chart's flat tier files, a lost+found, an administrator's own files.
    decision = reclaim_decisions.decide(
        ["abc123", "abc123.meta.json", ".tier.lock", "lost+found", "nsgone"], {}
    )
    assert decision == reclaim_decisions.Decision()


@pytest.mark.parametrize(
    "name",
    [
        "ns-",
        "ns-UPPER",
        "ns-../etc",
        "ns-a/b",
        "ns--lead",
        "ns-trail-",
        "ns-" + "x" * 64,
        "ns-a.b",
        f"ns-a.{NEW.upper()}",
        f"ns-a.{OLD}.x",
        f"ns-.{OLD}",
        f"ns-a.{OLD[:-1]}",
        f"ns-a-{OLD}.",
    ],
)
def test_a_name_that_is_no_namespace_is_refused_with_what_was_expected(name: str) -> None:
    decision = reclaim_decisions.decide([name], {})
    assert not decision.reclaim
    ((refused, why),) = decision.refused
    assert refused == name
    assert "expected 'ns-' followed by a namespace name" in why and repr(name) in why
    assert "followed by '.' and the namespace's UID" in why


def test_a_dash_before_a_uid_is_part_of_a_legacy_namespace_name() -> None:
    """A namespace may be called `a-<uuid>`: only the dot separates a UID, so a reclaim
    from before the change never read a keyed name as a namespace it did not find."""
    assert reclaim_decisions.namespace_of(f"ns-a-{OLD}") == f"a-{OLD}"
    assert reclaim_decisions.namespace_of(f"ns-a.{OLD}") == "a"
    decision = reclaim_decisions.decide([f"ns-a-{OLD}", f"ns-a.{OLD}"], {"a": OLD})
    assert decision.reclaim == ((f"ns-a-{OLD}", f"a-{OLD}", f"deleted namespace a-{OLD}"),)


def test_a_directory_renamed_aside_earlier_is_removed_again() -> None:
    aside = reclaim_decisions.aside_name("gone")
    assert aside.startswith(".") and not aside.startswith(reclaim_decisions.NAMESPACE_PREFIX)
    decision = reclaim_decisions.decide([aside, f"ns-live.{NEW}"], {"live": NEW})
    assert decision.leftovers == (aside,)
    assert not decision.reclaim


def test_aside_names_never_collide() -> None:
    assert len({reclaim_decisions.aside_name("gone") for _ in range(100)}) == 100
