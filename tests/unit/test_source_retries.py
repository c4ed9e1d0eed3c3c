"""How long a source read retries, and which errors it never retries.

A fake clock stands in for `time`: the budget is minutes of store outage, the test
milliseconds."""

from __future__ import annotations

import errno

import pytest

from shardcache import errors, source

pytestmark = pytest.mark.unit


class Clock:
    """`source.time`'s monotonic and sleep, advancing only when slept."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(source.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(source.time, "sleep", fake.sleep)
    return fake


def refused() -> OSError:
    return OSError(
        "When reading information for key 'k': AWS Error NETWORK_CONNECTION during "
        "GetObject operation: curlCode: 7, Couldn't connect to server"
    )


class Outage:
    """A store that refuses connections for `seconds` from the first try on."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds
        self.tries: list[float] = []

    def read(self) -> str:
        self.tries.append(self.clock.now)
        if self.clock.now - self.tries[0] < self.seconds:
            raise refused()
        return "bytes"


@pytest.mark.parametrize("outage", [8.0, 30.0, 50.0])
def test_a_store_restarting_for_seconds_is_ridden_out_with_the_default_policy(
    clock: Clock, outage: float
) -> None:
    store = Outage(clock, outage)
    assert source.with_retries(store.read, what="fetching") == "bytes"
    assert store.tries[-1] - store.tries[0] >= outage


def test_a_store_down_past_the_budget_fails_saying_how_many_tries_over_how_long(
    clock: Clock,
) -> None:
    store = Outage(clock, 3600)
    policy = source.RetryPolicy(budget_seconds=20.0)
    with pytest.raises(errors.SourceError) as info:
        source.with_retries(store.read, what="fetching", policy=policy)
    assert 20.0 - policy.max_delay <= store.tries[-1] - store.tries[0] <= 20.0
    assert f"failed after {len(store.tries)} attempts in" in str(info.value)
    assert "Couldn't connect" in str(info.value)


def test_attempts_cap_the_tries_inside_the_budget(clock: Clock) -> None:
    store = Outage(clock, 3600)
    policy = source.RetryPolicy(attempts=2, initial_delay=0.05, max_delay=0.1)
    with pytest.raises(errors.SourceError, match="failed after 2 attempts"):
        source.with_retries(store.read, what="fetching", policy=policy)
    assert len(store.tries) == 2
    assert clock.now - 1000.0 < 1.0


def test_delays_double_up_to_their_cap(clock: Clock) -> None:
    store = Outage(clock, 3600)
    policy = source.RetryPolicy(budget_seconds=60.0, initial_delay=1.0, max_delay=4.0)
    with pytest.raises(errors.SourceError):
        source.with_retries(store.read, what="fetching", policy=policy)
    delays = [b - a for a, b in zip(store.tries, store.tries[1:], strict=False)]
    caps = [1.0, 2.0, 4.0] + [4.0] * (len(delays) - 3)
    assert all(cap / 2 <= delay <= cap for delay, cap in zip(delays, caps, strict=True))


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError(errno.ENOENT, "No such file"),
        OSError("AWS Error NO_SUCH_BUCKET during ListObjectsV2 operation"),
        OSError("AWS Error UNKNOWN (HTTP status 400) during PutObject operation: KeyTooLong"),
    ],
)
def test_a_permanent_error_fails_at_once_whatever_the_budget(clock: Clock, exc: OSError) -> None:
    tries = []

    def op() -> None:
        tries.append(1)
        raise exc

    with pytest.raises(errors.InputError) as info:
        source.with_retries(op, what="listing", policy=source.RetryPolicy(budget_seconds=3600))
    assert not isinstance(info.value, errors.AccessDeniedError)
    assert len(tries) == 1 and clock.now == 1000.0


@pytest.mark.parametrize(
    "text",
    [
        "AWS Error ACCESS_DENIED during HeadObject operation: No response body.",
        "AWS Error UNKNOWN (HTTP status 403) during GetObject operation: AccessDenied",
        "AWS Error INVALID_ACCESS_KEY_ID during ListObjectsV2 operation",
        "AWS Error UNKNOWN (HTTP status 403) during HeadObject operation: SignatureDoesNotMatch",
        "AWS Error UNKNOWN (HTTP status 403) during HeadObject operation: No response body.",
        "AWS Error UNKNOWN (HTTP status 401) during HeadObject operation: No response body.",
    ],
)
def test_refused_credentials_fail_at_once_as_access_denied(clock: Clock, text: str) -> None:
    tries = []

    def op() -> None:
        tries.append(1)
        raise OSError(text)

    with pytest.raises(errors.AccessDeniedError):
        source.with_retries(op, what="listing")
    assert len(tries) == 1


def test_a_skewed_clock_is_a_403_that_is_retried_not_access_denied(clock: Clock) -> None:
    skewed = OSError(
        "AWS Error UNKNOWN (HTTP status 403) during GetObject operation: RequestTimeTooSkewed"
    )
    assert not source.is_access_denied(skewed)
    assert not source.is_permanent(skewed)


def test_a_policy_with_a_negative_budget_or_no_tries_is_refused() -> None:
    with pytest.raises(errors.InputError, match="budget_seconds"):
        source.RetryPolicy(budget_seconds=-1)
    with pytest.raises(errors.InputError, match="attempts"):
        source.RetryPolicy(attempts=0)
