"""A sidecar memory limit the sidecar cannot start in is refused with the field, the floor
and the value found (exploration s18-xnode, defect 3: a 40Mi sidecar was OOMKilled at every
start while its DatasetMount said Ready)."""

from __future__ import annotations

from typing import Any

import pytest
from shardcache_operator import specs

from shardcache import errors
from shardcache.contract import variables

pytestmark = pytest.mark.unit


def parse(**spec: Any) -> specs.DatasetMountSpec:
    return specs.parse_spec({"source": {"uri": "s3://bucket/train/"}, **spec}, path="spec")


@pytest.mark.parametrize("medium", ["Memory", "Disk"])
def test_a_sidecar_memory_limit_below_the_floor_is_refused_with_floor_and_value(
    medium: str,
) -> None:
    with pytest.raises(errors.InputError) as caught:
        parse(
            cache={"memory": "8Mi", "medium": medium},
            sidecar={"resources": {"requests": {"memory": "40Mi"}, "limits": {"memory": "40Mi"}}},
        )
    message = str(caught.value)
    assert "spec.sidecar.resources.limits.memory" in message
    assert "expected at least 192Mi" in message
    assert "found '40Mi'" in message


def test_a_limit_just_under_the_floor_is_refused_and_the_floor_itself_is_accepted() -> None:
    floor = variables.SIDECAR_MEMORY_FLOOR
    with pytest.raises(errors.InputError, match=r"limits\.memory"):
        parse(sidecar={"resources": {"limits": {"memory": str(floor - 1)}}})
    spec = parse(sidecar={"resources": {"limits": {"memory": str(floor)}}})
    assert spec.sidecar.resources.limits["memory"] == str(floor)


@pytest.mark.parametrize(
    "resources",
    [
        {},  # the defaults: the webhook's own sizing is never refused
        {"requests": {"memory": "40Mi"}},  # the default 1Gi limit applies
        {"limits": {"cpu": "100m"}},  # no memory limit at all
        {"limits": {"memory": "256Mi"}},
    ],
)
def test_what_the_defaults_give_and_limits_at_or_over_the_floor_are_accepted(
    resources: dict[str, Any],
) -> None:
    parse(cache={"memory": "64Gi"}, sidecar={"resources": resources})


def test_the_floor_leaves_room_under_the_sidecars_base_and_over_its_measured_resident() -> None:
    # 100-150 MiB resident measured; sidecars given 256Mi serve (quotas.process_base).
    assert 150 << 20 < variables.SIDECAR_MEMORY_FLOOR <= 256 << 20
