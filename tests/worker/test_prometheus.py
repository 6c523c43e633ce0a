"""contrib.prometheus with the real prometheus_client, fed by a real worker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from prometheus_client import CollectorRegistry, generate_latest

from celery_redislock import SingletonTask, Wait
from celery_redislock.contrib.prometheus import LockMetrics
from tests.conftest import embedded_worker
from tests.helpers import hold_lock
from tests.servers import wait_until

pytestmark = pytest.mark.worker


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = LockMetrics(registry).connect()
    yield registry
    metrics.disconnect()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_counts_acquisitions_contentions_losses_releases_and_times(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, registry: CollectorRegistry
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, name="m.job", lock_ttl=0.6)
    def job(self: Any, n: int) -> None:
        record.set(f"key:{n}", self.lock.key)
        if n == 3:
            wait_until(lambda: self.lock.lost, timeout=10, message="the loss")

    @app.task(
        base=SingletonTask, shared=False, name="m.waiter", lock_on_contention=Wait(timeout=20)
    )
    def waiter() -> None:
        pass

    with embedded_worker(app, "threads", 2):
        job.delay(1).get(timeout=20)
        hold_lock(lock_client, job, (2,))
        job.delay(2).get(timeout=20)  # skipped
        stolen = job.delay(3)
        key = wait_until(lambda: record.get("key:3"), timeout=20)
        lock_client.set(key, "v1|thief|0|h|1|n|t|0", px=60_000)
        stolen.get(timeout=20)
        waited_key, _ = hold_lock(lock_client, waiter, ttl=0.4)
        waiter.delay().get(timeout=20)

    task = {"task": "m.job"}
    assert value(registry, "celery_redislock_acquired_total", **task) == 2
    assert value(registry, "celery_redislock_contended_total", policy="skip", **task) == 1
    assert value(registry, "celery_redislock_lost_total", reason="stolen", **task) == 1
    assert value(registry, "celery_redislock_released_total", outcome="released", **task) == 1
    assert value(registry, "celery_redislock_released_total", outcome="not_ours", **task) == 1
    assert value(registry, "celery_redislock_hold_seconds_count", **task) == 2
    assert value(registry, "celery_redislock_hold_seconds_sum", **task) > 0
    waited = {"task": "m.waiter"}
    assert value(registry, "celery_redislock_contended_total", policy="wait", **waited) == 1
    # The waiter got the lock when the holder's 0.4 s TTL ran out.
    assert value(registry, "celery_redislock_wait_seconds_sum", **waited) >= 0.2
    assert value(registry, "celery_redislock_wait_seconds_bucket", le="0.1", **waited) == 0
    assert b"celery_redislock_acquired_total" in generate_latest(registry)
    assert lock_client.exists(waited_key) == 0


def test_disconnect_stops_counting_and_two_registries_are_independent(
    app: Celery, registry: CollectorRegistry
) -> None:
    @app.task(base=SingletonTask, shared=False, name="m.once")
    def once() -> None:
        pass

    other = CollectorRegistry()
    metrics = LockMetrics(other, namespace="second").connect()
    metrics.connect()  # idempotent: still counted once
    with embedded_worker(app, "solo"):
        once.delay().get(timeout=20)
        metrics.disconnect()
        once.delay().get(timeout=20)
    assert value(registry, "celery_redislock_acquired_total", task="m.once") == 2
    assert value(other, "second_acquired_total", task="m.once") == 1


def test_a_standalone_locks_samples_carry_an_empty_task_label(
    registry: CollectorRegistry, lock_client: redis.Redis
) -> None:
    """As documented: a lock name per label value would grow without bound (``orders:<id>``)."""
    from celery_redislock import RedisLock

    for order in range(3):
        with RedisLock(lock_client, f"orders:{order}", ttl=5):
            pass
    assert value(registry, "celery_redislock_acquired_total", task="") == 3
    assert value(registry, "celery_redislock_released_total", task="", outcome="released") == 3
    assert "orders:" not in generate_latest(registry).decode()
