"""The package's re-sends through every broker the suite runs on (``REDISLOCK_TEST_BROKER``).

On RabbitMQ quorum queues Celery delays countdown messages through native
delayed delivery: whole seconds only, and by dead-lettering through delay
queues (each pass adds ``x-death``). These tests run on every broker; the
first two failed on quorum queues before the re-send adapted to both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import Retry, SingletonTask, lock_contended
from tests.brokers import QUORUM
from tests.conftest import embedded_worker
from tests.helpers import hold_lock

pytestmark = pytest.mark.worker

#: The caller's own headers: each must reach every re-send and the run.
CALLER_HEADERS = {"tenant": "t-1", "x-request-id": "req-1"}


class Deliveries:
    """What each contended delivery of one task saw: when, its headers, its x-death counts."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, dict[str, Any]]] = []
        self.changed = threading.Condition()

    def __call__(self, sender: Any = None, **kwargs: Any) -> None:
        # Runs in the worker thread that is contended: its request is that delivery's.
        with self.changed:
            self.seen.append((time.monotonic(), dict(sender.request.headers or {})))
            self.changed.notify_all()

    def wait_for(self, count: int, timeout: float) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.seen) >= count, timeout), (
                f"{len(self.seen)} contended deliveries, expected {count}"
            )


@pytest.fixture
def deliveries() -> Iterator[Deliveries]:
    seen = Deliveries()
    lock_contended.connect(seen, weak=False)
    yield seen
    lock_contended.disconnect(seen)


def death_counts(headers: dict[str, Any]) -> list[int]:
    """How often the message passed each queue it was dead-lettered from (RabbitMQ's record)."""
    return [int(entry["count"]) for entry in headers.get("x-death") or []]


def test_a_lock_retry_resent_three_times_comes_back_and_runs(
    app: Celery, lock_client: redis.Redis, deliveries: Deliveries
) -> None:
    """Issue 23: the re-send copied ``x-death``; its second pass through the delay
    queues was then a dead-letter cycle, and RabbitMQ dropped it without a trace.

    3 s is delayed by two delay queues (2 s, then 1 s): the second pass goes
    through both again.
    """

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        lock_on_contention=Retry(countdown=3, jitter=0, max_retries=10),
    )
    def job(self: Any) -> dict[str, Any]:
        return dict(self.request.headers or {})

    key, _ = hold_lock(lock_client, job, ttl=120)
    with embedded_worker(app, "threads", 2):
        result = job.apply_async(headers=CALLER_HEADERS)
        deliveries.wait_for(3, timeout=30)
        lock_client.delete(key)  # the third re-send finds the key free
        ran_with = result.get(timeout=30)
    assert result.state == "SUCCESS"
    assert len(deliveries.seen) == 3
    for (earlier, _), (later, _) in zip(deliveries.seen, deliveries.seen[1:], strict=False):
        assert later - earlier >= 3  # each re-send came back no earlier than its countdown
    for _, headers in [*deliveries.seen, (0.0, ran_with)]:
        assert headers.items() >= CALLER_HEADERS.items()
        # Each delivery carries RabbitMQ's record of its own pass only: a
        # re-send never carries the record of the passes before.
        assert all(count == 1 for count in death_counts(headers)), headers.get("x-death")
    assert ran_with["redislock_lock_retries"] == 3
    if QUORUM:
        assert death_counts(ran_with)  # it did pass through the delay queues


def test_a_sub_second_lock_retry_is_resent_and_runs(
    app: Celery, lock_client: redis.Redis, deliveries: Deliveries
) -> None:
    """Issue 23: on quorum queues a 0.3 s countdown raised in Celery (``countdown must be
    a positive number``) and the package turned it into a FAILURE: the call never ran."""

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_on_contention=Retry(countdown=0.3, jitter=0, max_retries=10),
    )
    def job() -> str:
        return "ran"

    key, _ = hold_lock(lock_client, job, ttl=120)
    with embedded_worker(app, "threads", 2):
        result = job.delay()
        deliveries.wait_for(1, timeout=30)
        lock_client.delete(key)
        assert result.get(timeout=30) == "ran"
        ran_at = time.monotonic()
    contended_at = deliveries.seen[0][0]
    # Never earlier than intended; where delays are whole seconds, one second.
    assert ran_at - contended_at >= (1.0 if QUORUM else 0.3)


def test_a_resend_of_a_task_routed_to_another_queue_comes_back_to_that_queue(
    app_factory: Any, lock_client: redis.Redis, deliveries: Deliveries
) -> None:
    """What the docs tell users of several queues: route the task with ``task_routes``.

    A re-send (Celery's retry() too) is routed anew, and on quorum queues
    Celery then sends it to the default queue unless a route names its
    queue. Here the only worker consumes ``other``: a re-send sent anywhere
    else would never run.
    """
    # celery.ping: the embedded worker's start check, which it must consume.
    routes = {name: {"queue": "other"} for name in ("tests.brokers.routed", "celery.ping")}
    app = app_factory(task_routes=routes)

    @app.task(
        base=SingletonTask,
        name="tests.brokers.routed",
        shared=False,
        lock_on_contention=Retry(countdown=1, jitter=0, max_retries=10),
    )
    def routed() -> str:
        return "ran"

    key, _ = hold_lock(lock_client, routed, ttl=120)
    with embedded_worker(app, "threads", 2, queues=["other"]):
        result = routed.delay()
        deliveries.wait_for(1, timeout=30)
        lock_client.delete(key)
        assert result.get(timeout=30) == "ran"
