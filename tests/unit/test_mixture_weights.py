"""Mixture weights: the per-step draw, schedules, and their checks (pure functions)."""

from __future__ import annotations

import math

import pytest

from shardcache import errors, mixtures

pytestmark = pytest.mark.unit

NAMES = ("web", "code", "math")


def bound(p: float, n: int) -> float:
    """Six standard deviations of a binomial count: a fixed seed beyond it means a bias,
    not bad luck (the chance for an unbiased draw is about 2e-9)."""
    return 6 * math.sqrt(n * p * (1 - p)) + 1


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_draws_match_the_weights_within_a_binomial_bound(seed: int) -> None:
    weights = mixtures.Schedule.of({"web": 5, "code": 3, "math": 2}, names=NAMES).at(0)
    n = 20_000
    counts = [0, 0, 0]
    for step in range(n):
        counts[mixtures.draw(seed, step, weights)] += 1
    for p, count in zip((0.5, 0.3, 0.2), counts, strict=True):
        assert abs(count - p * n) <= bound(p, n), (p, count)


def test_draws_follow_a_schedule_step_by_step_within_the_bound() -> None:
    schedule = mixtures.Schedule.of(
        [(0, {"web": 1, "code": 0, "math": 0}), (10_000, {"web": 0, "code": 1, "math": 0})],
        names=NAMES,
    )
    n = 10_000
    web = sum(mixtures.draw(9, t, schedule.at(t)) == 0 for t in range(n))
    # A sum of Bernoulli(p_t): mean sum p_t, variance sum p_t (1 - p_t).
    ps = [schedule.at(t)[0] for t in range(n)]
    mean, var = sum(ps), sum(p * (1 - p) for p in ps)
    assert abs(web - mean) <= 6 * math.sqrt(var) + 1
    assert all(mixtures.draw(9, t, schedule.at(t)) == 1 for t in range(10_000, 10_200))


def test_a_source_of_weight_zero_is_never_drawn() -> None:
    weights = mixtures.Schedule.of({"web": 1, "code": 0, "math": 1}, names=NAMES).at(0)
    assert {mixtures.draw(4, t, weights) for t in range(5_000)} == {0, 2}


def test_draws_depend_on_the_seed_and_not_on_how_they_are_reached() -> None:
    weights = (0.5, 0.25, 0.25)
    a = [mixtures.draw(1, t, weights) for t in range(200)]
    assert a == [mixtures.draw(1, t, weights) for t in range(200)]
    assert a[100:] == [mixtures.draw(1, t, weights) for t in range(100, 200)]
    assert a != [mixtures.draw(2, t, weights) for t in range(200)]


def test_schedule_is_linear_between_points_and_flat_outside() -> None:
    s = mixtures.Schedule.of(
        [(100, {"web": 3, "code": 1, "math": 0}), (200, {"web": 1, "code": 1, "math": 2})],
        names=NAMES,
    )
    assert s.at(0) == s.at(100) == (0.75, 0.25, 0.0)
    assert s.at(150) == pytest.approx((2 / 4, 1 / 4, 1 / 4))
    assert s.at(200) == s.at(10**9) == (0.25, 0.25, 0.5)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"web": 1, "code": 1}, r"expected a weight for each source \['code', 'math', 'web'\]"),
        ({"web": 1, "code": -1, "math": 0}, "code: expected a finite number >= 0, found -1"),
        ({"web": float("nan"), "code": 1, "math": 0}, "web: expected a finite number"),
        ({"web": 0, "code": 0, "math": 0}, "expected some weight > 0"),
        ({"web": "1", "code": 1, "math": 0}, "web: expected a finite number >= 0, found '1'"),
        (
            [(5, {"web": 1, "code": 1, "math": 1}), (5, {"web": 1, "code": 1, "math": 1})],
            "schedule steps must increase, found 5 after 5",
        ),
        ([(-1, {"web": 1, "code": 1, "math": 1})], "a step must be an int >= 0, found -1"),
        ([], "at least one schedule point"),
        ("web", "expected a mapping"),
    ],
)
def test_bad_weights_are_refused_saying_what_was_expected(weights: object, message: str) -> None:
    with pytest.raises(errors.InputError, match=message):
        mixtures.Schedule.of(weights, names=NAMES)


def test_schedule_survives_json() -> None:
    points = [(0, {"web": 1, "code": 2, "math": 0}), (50, {"web": 0, "code": 1, "math": 1})]
    s = mixtures.Schedule.of(points, names=NAMES)
    assert mixtures.Schedule.of([tuple(p) for p in s.to_json()], names=NAMES) == s
