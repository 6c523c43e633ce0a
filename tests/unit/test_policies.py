"""Contention policies as small objects (no Redis needed)."""

from __future__ import annotations

import json
from typing import Any, NoReturn

import pytest

from celery_redislock import (
    ConfigurationError,
    HandOff,
    LockContended,
    Raise,
    Retry,
    Skip,
    Wait,
    is_skipped,
)
from celery_redislock.policies import LOCK_ACQUIRED, Contention, resolve_policy


class Retried(Exception):
    def __init__(self, countdown: float) -> None:
        self.countdown = countdown


def contention(lock_retries: int = 0, ttl: float | None = 4.0, waits: bool = False) -> Contention:
    def retry_later(countdown: float, exc: BaseException) -> NoReturn:
        raise Retried(countdown)

    return Contention(
        key="k",
        task_name="t",
        task_id="me",
        holder_task_id="holder",
        ttl_remaining=ttl,
        redelivered=False,
        lock_retries=lock_retries,
        wait_for_lock=lambda timeout: waits,
        retry_later=retry_later,
    )


def test_skip_returns_a_json_value_callers_can_recognise() -> None:
    result = Skip().handle(contention())
    assert is_skipped(json.loads(json.dumps(result)))
    assert result["holder"] == "holder" and result["key"] == "k"
    assert not is_skipped({"key": "k"}) and not is_skipped(None) and not is_skipped("skipped")


def test_raise_raises_lock_contended_with_holder_and_ttl() -> None:
    with pytest.raises(LockContended) as info:
        Raise().handle(contention())
    assert (info.value.holder_task_id, info.value.ttl_remaining) == ("holder", 4.0)


def test_retry_countdown_is_the_holders_ttl_plus_jitter() -> None:
    countdowns = []
    for _ in range(50):
        with pytest.raises(Retried) as info:
            Retry(jitter=1.0).handle(contention(ttl=4.0))
        countdowns.append(info.value.countdown)
    assert all(4.0 <= c <= 5.0 for c in countdowns)
    assert len(set(countdowns)) > 1


def test_retry_with_fixed_countdown_and_unknown_ttl() -> None:
    with pytest.raises(Retried) as info:
        Retry(countdown=7, jitter=0).handle(contention())
    assert info.value.countdown == 7
    with pytest.raises(Retried) as info:
        Retry(jitter=0).handle(contention(ttl=None))
    assert info.value.countdown == 1.0


def test_retry_budget_then_fallback() -> None:
    with pytest.raises(LockContended):
        Retry(max_retries=3).handle(contention(lock_retries=3))
    assert is_skipped(Retry(max_retries=3, then="skip").handle(contention(lock_retries=3)))


def test_wait_returns_acquired_or_falls_back() -> None:
    assert Wait(timeout=1).handle(contention(waits=True)) is LOCK_ACQUIRED
    assert is_skipped(Wait(timeout=1, then=Skip()).handle(contention(waits=False)))
    with pytest.raises(Retried):
        Wait(timeout=1).handle(contention(waits=False))  # default fallback: Retry


@pytest.mark.parametrize("name", ["skip", "retry", "raise", "wait", "SKIP"])
def test_shorthands(name: str) -> None:
    assert resolve_policy(name).name == name.lower()


@pytest.mark.parametrize("bad", ["skipp", "", None, 3, Skip])
def test_unknown_policy_is_a_clear_error(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="must be one of 'skip', 'retry', 'raise', 'wait'"):
        resolve_policy(bad)


@pytest.mark.parametrize(
    "factory",
    [lambda: Retry(countdown=-1), lambda: Retry(max_retries=-1), lambda: Wait(timeout=-1)],
)
def test_bad_policy_arguments(factory: Any) -> None:
    with pytest.raises(ConfigurationError):
        factory()


@pytest.mark.parametrize(
    ("factory", "named"),
    [
        (lambda: Retry(countdown="5"), "Retry countdown"),
        (lambda: Retry(max_retries="3"), "Retry max_retries"),
        (lambda: Retry(max_retries=2.5), "Retry max_retries"),
        (lambda: Retry(max_retries=True), "Retry max_retries"),
        (lambda: Retry(jitter=None), "Retry jitter"),
        (lambda: Wait(timeout=None), "Wait timeout"),
        (lambda: Wait(timeout="10"), "Wait timeout"),
        (lambda: HandOff(max_wait="60"), "HandOff max_wait"),
        (lambda: HandOff(jitter=None), "HandOff jitter"),
        (lambda: Retry(countdown=float("nan")), "Retry countdown"),
        (lambda: Retry(jitter=float("inf")), "Retry jitter"),
        (lambda: Wait(timeout=float("inf")), "Wait timeout"),
        (lambda: HandOff(max_wait=float("nan")), "HandOff max_wait"),
    ],
)
def test_a_policy_argument_of_the_wrong_type_is_a_configuration_error_naming_it(
    factory: Any, named: str
) -> None:
    with pytest.raises(ConfigurationError, match=named):
        factory()


def test_retry_max_retries_none_retries_without_limit_as_celery_does() -> None:
    with pytest.raises(Retried):
        Retry(max_retries=None, jitter=0).handle(contention(lock_retries=10**9))


def test_policies_compare_by_value() -> None:
    assert Retry(countdown=3) == Retry(countdown=3)
    assert Retry(countdown=3) != Retry(countdown=4)
    assert "Wait(timeout=2" in repr(Wait(timeout=2))


def test_the_lock_store_backoff_doubles_with_equal_jitter_up_to_a_minute() -> None:
    from celery_redislock.policies import BACKEND_BACKOFF_MAX, backend_error_countdown

    for attempt, ceiling in [(0, 1), (1, 2), (3, 8), (5, 32), (6, 60), (40, 60)]:
        samples = [backend_error_countdown(attempt) for _ in range(200)]
        assert all(ceiling / 2 <= s <= ceiling for s in samples), (attempt, min(samples))
    assert BACKEND_BACKOFF_MAX == 60


@pytest.mark.parametrize("policy", [Skip(), Retry(max_retries=15, jitter=0, then=Skip())])
def test_a_redelivered_message_is_retried_past_any_retry_budget_never_dropped(
    policy: Any,
) -> None:
    """The skip a redelivered message would get becomes a retry, however often it met the key.

    It may be the only surviving copy: the default ``Retry``'s budget of 10
    turned it into a FAILURE once another holder outlived 10 retries
    (review helper-31, RabbitMQ acks_late, 2 of 2 runs).
    """
    from celery_redislock.policies import RetryInsteadOfSkip

    for retries in (0, 10, 16, 10_000):
        with pytest.raises(Retried):
            RetryInsteadOfSkip(policy).handle(contention(lock_retries=retries))
