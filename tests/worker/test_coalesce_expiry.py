"""A call is lost only to its own expiry, never to another call's (review helper-44 F2).

Under coalescing a call made while a run is queued joins it: it gets that
run's handle and is not published. A queued run that may expire before it
starts (its own ``expires``, or the task's) would take the calls that
joined it along: they were REVOKED with it, and no run came after them.
Such a call is now published as a run of its own, which nobody joins.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from celery import Celery

from celery_redislock import SingletonTask
from celery_redislock.keys import queued_key
from tests.conftest import embedded_worker
from tests.servers import wait_until


def _coalesced(app: Celery, record: redis.Redis, **options: Any) -> Any:
    @app.task(
        base=SingletonTask,
        shared=False,
        lock_args=("account",),
        lock_enqueue="until_start",
        **options,
    )
    def recompute(account: int, label: str) -> str:
        record.rpush("runs", label)
        if label == "running":
            wait_until(lambda: record.get("go"), timeout=30)
        return label

    return recompute


def test_a_call_made_while_an_expiring_run_is_queued_runs_after_the_holder(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    recompute = _coalesced(app, record)
    with embedded_worker(app, "threads", 1):
        running = recompute.delay(1, "running")
        wait_until(lambda: record.llen("runs") == 1, timeout=20)
        expiring = recompute.apply_async((1, "expiring"), expires=0.5)
        expired_at = time.monotonic() + 0.5
        queued = queued_key(recompute.lock_key_for((1, "x"), {}))
        assert lock_client.exists(queued) == 0  # it took no key: nobody can join it
        later = recompute.delay(1, "later")
        assert later.id != expiring.id  # published: it does not share the expiring run's fate
        wait_until(lambda: time.monotonic() > expired_at + 0.2, timeout=5)
        record.set("go", 1)
        assert running.get(timeout=20) == "running"
        assert later.get(timeout=20) == "later"
    runs = record.lrange("runs", 0, -1)
    # The expiring run ran too if Celery handed it to the pool before it
    # expired (its expiry is checked then), else it was dropped.
    assert runs[0] == "running" and runs[-1] == "later" and "later" not in runs[:-1]


def test_with_the_tasks_own_expiry_a_later_call_still_runs_before_its_own(
    app: Celery, record: redis.Redis
) -> None:
    # Every call expires 3 s after it is made (the task's ``expires``): the
    # second call expires before the holder ends, the third after it.
    recompute = _coalesced(app, record, expires=3)
    with embedded_worker(app, "threads", 1):
        running = recompute.delay(1, "running")
        wait_until(lambda: record.llen("runs") == 1, timeout=20)
        second = recompute.delay(1, "second")
        second_made = time.monotonic()
        wait_until(lambda: time.monotonic() > second_made + 2.0, timeout=5)
        third = recompute.delay(1, "third")  # expires at second_made + 5
        assert third.id != second.id
        wait_until(lambda: time.monotonic() > second_made + 3.3, timeout=5)  # second expired
        record.set("go", 1)
        assert running.get(timeout=20) == "running"
        assert third.get(timeout=20) == "third"
    runs = record.lrange("runs", 0, -1)
    assert runs[0] == "running" and runs[-1] == "third" and "third" not in runs[:-1]


def test_the_tasks_own_expiry_bounds_how_long_its_enqueue_lock_is_kept(
    app: Celery, lock_client: redis.Redis
) -> None:
    # RabbitMQ drops an expired message itself: no worker sees it to free
    # the key, so the key must not outlive the message (the task's
    # ``expires`` was not read: the key stayed for the enqueue TTL, 1 h).
    @app.task(base=SingletonTask, shared=False, lock_enqueue=True, expires=5)
    def job(n: int) -> None: ...

    job.delay(1)
    assert 0 < lock_client.pttl(job.lock_key_for((1,), {})) <= 6_000
