"""Which namespace directories of a node path the node-cache DaemonSet reclaims
(`reclaim_decisions.decide`, pure): only `ns-` + a valid namespace name whose namespace
no longer exists; refused names said, anything else ignored; leftovers removed."""

from __future__ import annotations

import pytest
from shardcache_operator import pod_env, reclaim_decisions

pytestmark = pytest.mark.unit


def test_a_deleted_namespaces_directory_is_reclaimed_and_a_live_ones_kept() -> None:
    decision = reclaim_decisions.decide(["ns-gone", "ns-live"], ["live", "kube-system"])
    assert decision.reclaim == (("ns-gone", "gone"),)
    assert not decision.refused and not decision.leftovers


def test_every_directory_is_kept_while_its_namespace_exists() -> None:
    names = [pod_env.namespace_subdir(ns) for ns in ("a", "team-b", "x" * 63)]
    assert (
        reclaim_decisions.decide(names, ["a", "team-b", "x" * 63]) == reclaim_decisions.Decision()
    )


def test_the_directory_name_is_the_one_the_webhook_mounts() -> None:
    assert reclaim_decisions.namespace_of(pod_env.namespace_subdir("team-a")) == "team-a"


def test_names_outside_the_ns_prefix_are_ignored() -> None:
    # An older chart's flat tier files, a lost+found, an administrator's own files.
    decision = reclaim_decisions.decide(
        ["abc123", "abc123.meta.json", ".tier.lock", "lost+found", "nsgone"], []
    )
    assert decision == reclaim_decisions.Decision()


@pytest.mark.parametrize(
    "name",
    ["ns-", "ns-UPPER", "ns-../etc", "ns-a/b", "ns--lead", "ns-trail-", "ns-" + "x" * 64, "ns-a.b"],
)
def test_a_name_that_is_no_namespace_is_refused_with_what_was_expected(name: str) -> None:
    decision = reclaim_decisions.decide([name], [])
    assert not decision.reclaim
    ((refused, why),) = decision.refused
    assert refused == name
    assert "expected 'ns-' followed by a namespace name" in why and repr(name) in why


def test_a_directory_renamed_aside_earlier_is_removed_again() -> None:
    aside = reclaim_decisions.aside_name("gone")
    assert aside.startswith(".") and not aside.startswith(reclaim_decisions.NAMESPACE_PREFIX)
    decision = reclaim_decisions.decide([aside, "ns-live"], ["live"])
    assert decision.leftovers == (aside,)
    assert not decision.reclaim


def test_aside_names_never_collide() -> None:
    assert len({reclaim_decisions.aside_name("gone") for _ in range(100)}) == 100
