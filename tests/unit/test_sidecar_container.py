"""The sidecar container's resources: defaults that keep every request within its limit,
and memory limits read by Kubernetes' quantity rules."""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from shardcache_operator import pod_names, pod_volumes, sidecar_container, specs

from shardcache import errors
from shardcache.contract import variables

pytestmark = pytest.mark.unit

NAMES = pod_names.MountNames(
    sidecar="shardcache-m",
    run_volume="shardcache-m-run",
    disk_volume="shardcache-m-disk",
    checkpoint_volume=None,
    port=8470,
    port_name="shardcache",
    ui_port=8490,
)


def parse(**spec: Any) -> specs.DatasetMountSpec:
    return specs.parse_spec({"source": {"uri": "s3://bucket/train/"}, **spec})


def sidecar_resources(spec: specs.DatasetMountSpec) -> dict[str, dict[str, str]]:
    container = sidecar_container.build(
        spec,
        NAMES,
        image="shardcache-sidecar:test",
        env=[],
        volume_mounts=[],
        run_as_user=65532,
        startup_timeout_seconds=600,
    )
    resources: dict[str, dict[str, str]] = container["resources"]
    return resources


_UNITS = {"Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30)}
_UNITS |= {"m": Fraction(1, 1000), "": Fraction(1)}


def amount(text: str) -> Fraction:
    """The value of the quantities these tests use, independent of the code under test."""
    parts = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|m|)", text)
    assert parts is not None, text
    return Fraction(parts[1]) * _UNITS[parts[2]]


def over_limit(resources: dict[str, dict[str, str]]) -> list[str]:
    """The resources whose request is above their limit: the API server refuses the pod."""
    requests, limits = resources["requests"], resources["limits"]
    return [
        key for key in requests if key in limits and amount(requests[key]) > amount(limits[key])
    ]


DISK = {"medium": "Disk"}


def test_a_limit_below_the_default_request_becomes_the_request() -> None:
    spec = parse(sidecar={"resources": {"limits": {"cpu": "100m"}}}, cache=DISK)
    resources = sidecar_resources(spec)
    assert resources["requests"] == {"cpu": "100m", "memory": "256Mi"}
    assert resources["limits"] == {"cpu": "100m"}


def test_a_memory_limit_below_the_default_request_becomes_the_request() -> None:
    spec = parse(sidecar={"resources": {"limits": {"memory": "200Mi"}}}, cache=DISK)
    resources = sidecar_resources(spec)
    assert resources["requests"] == {"cpu": "250m", "memory": "200Mi"}
    assert resources["limits"] == {"memory": "200Mi"}


def test_a_request_above_the_default_limit_becomes_the_limit() -> None:
    spec = parse(sidecar={"resources": {"requests": {"cpu": "4", "memory": "2Gi"}}}, cache=DISK)
    resources = sidecar_resources(spec)
    assert resources["limits"] == {"cpu": "4", "memory": "2Gi"}


def test_a_memory_limit_that_followed_the_request_is_still_raised_by_the_run_volume() -> None:
    spec = parse(
        sidecar={"resources": {"requests": {"memory": "2Gi"}}},
        cache={"memory": "1Gi", "medium": "Memory"},
    )
    resources = sidecar_resources(spec)
    assert resources["limits"] == {"cpu": "2", "memory": f"{2048 + 1280}Mi"}


def test_the_memory_request_is_raised_by_the_memory_tier_volume_as_the_limit_is() -> None:
    """The tmpfs pages of a Memory-medium tier are node memory the pod holds: the
    scheduler must count them, or a 64Gi tier is placed as a 256Mi sidecar and the
    node's memory is overcommitted under its neighbours."""
    spec = parse(cache={"memory": "64Gi", "medium": "Memory"})
    run_volume = pod_volumes.run_volume_bytes(64 * 2**30)
    assert run_volume == 80 * 2**30
    resources = sidecar_resources(spec)
    assert amount(resources["requests"]["memory"]) == 256 * 2**20 + run_volume
    assert amount(resources["limits"]["memory"]) == 2**30 + run_volume
    assert resources["requests"]["cpu"] == "250m"


def test_a_memory_request_without_a_memory_limit_is_still_raised_by_the_tier() -> None:
    spec = parse(sidecar={"resources": {"requests": {"memory": "512Mi"}, "limits": {}}})
    assert sidecar_resources(spec) == {
        "requests": {"memory": "3Gi"},
        "limits": {},
    }  # 512Mi + 2560Mi


def test_a_disk_medium_tier_raises_neither_the_memory_request_nor_the_limit() -> None:
    assert sidecar_resources(parse(cache=DISK)) == {
        "requests": dict(specs.DEFAULT_SIDECAR_REQUESTS),
        "limits": dict(specs.DEFAULT_SIDECAR_LIMITS),
    }


@pytest.mark.parametrize(
    "resources",
    [
        {},
        {"requests": {"cpu": "4", "memory": "2Gi"}},
        {"requests": {"cpu": "4"}},
        {"requests": {"memory": "16Gi"}},
        {"limits": {"cpu": "100m"}},
        {"limits": {"memory": "200Mi"}},
        {"limits": {"cpu": "10m", "memory": "192Mi"}},  # the floor (SIDECAR_MEMORY_FLOOR)
        {"requests": {"cpu": "1.5"}, "limits": {"cpu": "1500m"}},
    ],
)
@pytest.mark.parametrize("medium", ["Memory", "Disk"])
def test_every_request_the_pod_gets_is_within_its_limit(
    resources: dict[str, Any], medium: str
) -> None:
    spec = parse(sidecar={"resources": resources}, cache={"medium": medium})
    assert over_limit(sidecar_resources(spec)) == []


def test_requests_and_limits_the_user_wrote_are_kept_as_written() -> None:
    given = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"cpu": "4"}}
    assert sidecar_resources(parse(sidecar={"resources": given}, cache=DISK)) == given


def test_no_limits_at_all_stays_no_limits() -> None:
    spec = parse(sidecar={"resources": {"requests": {"cpu": "4"}, "limits": {}}}, cache=DISK)
    assert sidecar_resources(spec)["limits"] == {}


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        (
            {"requests": {"cpu": "4"}, "limits": {"cpu": "2"}},
            r"^spec\.sidecar\.resources\.requests\.cpu: '4' is above its limit "
            r"spec\.sidecar\.resources\.limits\.cpu, '2'",
        ),
        (
            {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}},
            r"^spec\.sidecar\.resources\.requests\.memory: '2Gi' is above its limit "
            r"spec\.sidecar\.resources\.limits\.memory, '1Gi'",
        ),
    ],
)
def test_a_request_above_the_limit_the_user_set_refuses_the_spec_naming_both(
    resources: dict[str, Any], message: str
) -> None:
    with pytest.raises(errors.InputError, match=message):
        parse(sidecar={"resources": resources}, cache=DISK)


def test_a_memory_request_within_the_limit_raised_by_the_memory_tier_is_accepted() -> None:
    # The pod's memory limit is 1Gi plus the 2560Mi run volume: a 3Gi request fits it,
    # and raised by the run volume too it stops at that limit.
    resources = {"requests": {"memory": "3Gi"}, "limits": {"memory": "1Gi"}}
    spec = parse(sidecar={"resources": resources}, cache={"memory": "2Gi", "medium": "Memory"})
    assert sidecar_resources(spec) == {
        "requests": {"memory": f"{1024 + 2560}Mi"},
        "limits": {"memory": f"{1024 + 2560}Mi"},
    }
    with pytest.raises(errors.InputError, match=r"requests\.memory: '3Gi' is above"):
        parse(sidecar={"resources": resources}, cache={"memory": "2Gi", "medium": "Disk"})


TIER = 2 * 2**30
RAISE = pod_volumes.run_volume_bytes(TIER)


@pytest.mark.parametrize(
    ("memory", "pod_limit"),
    [
        ("1.3Gi", 1395864372 + RAISE),  # 1395864371.2 bytes, rounded up
        # Each at least the floor (SIDECAR_MEMORY_FLOOR, 192Mi), which a smaller limit fails.
        ("0.2Gi", 214748365 + RAISE),  # 214748364.8
        ("201326592.5", 201326593 + RAISE),
        ("268435456500m", 268435457 + RAISE),
        ("201326592000m", 201326592 + RAISE),
        ("1e9", 10**9 + RAISE),
        ("2Gi", TIER + 2 * 2**30 + 512 * 2**20),
    ],
)
def test_a_sidecar_memory_limit_kubernetes_accepts_is_rounded_up_to_whole_bytes(
    memory: str, pod_limit: int
) -> None:
    spec = parse(sidecar={"resources": {"limits": {"cpu": "2", "memory": memory}}})
    limit = sidecar_resources(spec)["limits"]["memory"]
    assert amount(limit) == pod_limit


def test_a_memory_limit_beyond_what_a_kubernetes_quantity_holds_is_refused_at_the_spec() -> None:
    with pytest.raises(
        errors.InputError,
        match=r"^spec\.sidecar\.resources\.limits\.memory: '12345678901234567890123' is over",
    ):
        parse(sidecar={"resources": {"limits": {"memory": "12345678901234567890123"}}})


def test_a_memory_limit_that_is_no_quantity_names_the_memory_field() -> None:
    # Only a spec built in code can hold one: parsed specs are checked.
    spec = parse()
    bad = specs.SidecarSpec(resources=specs.ResourcesSpec(limits={"memory": "lots"}))
    with pytest.raises(errors.InputError, match=r"^spec\.sidecar\.resources\.limits\.memory: "):
        sidecar_resources(specs.DatasetMountSpec(source=spec.source, sidecar=bad))


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("250m", Decimal("0.25")),
        ("2", Decimal(2)),
        (3, Decimal(3)),
        ("+1.5Gi", Decimal(3 * 2**29)),
        ("1E", Decimal(10**18)),
        ("1e3", Decimal(1000)),
        ("1E3", Decimal(1000)),
        ("1e+3", Decimal(1000)),
        ("100u", Decimal("0.0001")),
        ("0.1n", Decimal("1e-9")),  # Kubernetes keeps nano units, rounded up
        (".5k", Decimal(500)),
        ("7.", Decimal(7)),
    ],
)
def test_resource_quantities_follow_kubernetes_rules(text: Any, value: Decimal) -> None:
    assert specs.resource_quantity(text, path="q") == value


@pytest.mark.parametrize("bad", ["-1", "1GB", "", " 2Gi", "2Gi\n", "1e-3", "1.5.2", True, 1.5])
def test_a_resource_quantity_kubernetes_refuses_is_refused_naming_the_path(bad: Any) -> None:
    with pytest.raises(errors.InputError, match=r"^limits\.memory: expected a non-negative"):
        specs.resource_quantity(bad, path="limits.memory")


def test_a_huge_exponent_is_refused_without_computing_the_number() -> None:
    with pytest.raises(errors.InputError, match=r"is over the largest quantity"):
        specs.resource_quantity("1e999999999", path="q")


def test_the_sidecar_says_why_it_exited_where_kubectl_describe_shows_it() -> None:
    """The path the container declares is the one the sidecar writes (the contract
    row's default), and a crash without a message shows its last log lines."""
    container = sidecar_container.build(
        parse(), NAMES, image="shardcache-sidecar:test", env=[], volume_mounts=[],
        run_as_user=65532, startup_timeout_seconds=600,
    )  # fmt: skip
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert container["terminationMessagePath"] == variables.TERMINATION_MESSAGE_PATH.default
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    names = {e["name"] for e in container["env"]}
    assert variables.TERMINATION_MESSAGE_PATH.env not in names  # the default is the path
