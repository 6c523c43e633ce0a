"""The same message delivered twice: the idempotency window and redelivery."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from celery import Celery
from celery.app.trace import build_tracer

from celery_redislock import Retry, SingletonTask, Skip, Wait, lock_contended
from celery_redislock.scripts import RENEW_SCRIPT
from tests.brokers import declare_as_a_worker_would, queue_length
from tests.conftest import embedded_worker
from tests.helpers import hold_lock
from tests.servers import RedisServer, wait_until

pytestmark = pytest.mark.worker


def test_a_second_delivery_of_a_succeeded_task_is_dropped_inside_its_window(
    app: Celery, record: redis.Redis, pool: str
) -> None:
    """acks_late and a crash before the ack, or the broker's visibility timeout:
    the message comes again with the same task id after its run succeeded."""
    window = 3.0

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="redelivery.job",
        lock_hold_after_success=window,
    )
    def job(self: Any, n: int) -> str:
        record.rpush("runs", self.request.id)
        return f"first result {n}"

    def seen(sender: Any = None, **kwargs: Any) -> None:
        record.rpush("contended", kwargs["policy"])

    lock_contended.connect(seen, weak=False)
    try:
        with embedded_worker(app, pool, 2):
            first = app.send_task("redelivery.job", (1,), task_id="delivered-twice")
            assert first.get(timeout=20) == "first result 1"
            again = app.send_task("redelivery.job", (1,), task_id="delivered-twice")
            wait_until(lambda: record.llen("contended"), timeout=20)
            # Past the window: a copy that was re-sent to wait it out would run now.
            time.sleep(window + 1.5)  # observation window: nothing may happen in it
            assert again.get(timeout=5) == "first result 1"
    finally:
        lock_contended.disconnect(seen)
    assert record.lrange("runs", 0, -1) == ["delivered-twice"]
    assert record.lrange("contended", 0, -1) == ["already_succeeded"]


def test_a_renewal_in_flight_at_release_cannot_shorten_the_window(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, lock_hold_after_success=3600)
    def job(self: Any) -> None:
        record.set("key", self.lock.key)
        record.set("value", self.lock.value)

    with embedded_worker(app, "threads", 1):
        job.delay().get(timeout=20)
    key, running_value = record.get("key"), record.get("value")
    assert lock_client.pttl(key) > 3_500_000
    # A renewal sent just before the release, arriving just after it.
    lock_client.eval(RENEW_SCRIPT, 1, key, running_value, 30_000)
    assert lock_client.pttl(key) > 3_500_000, "the window was cut to the lock TTL"


@pytest.mark.parametrize(
    "policy",
    [Wait(timeout=0.1, then=Skip()), Retry(max_retries=0, then=Skip()), "raise", "skip"],
    ids=["wait-then-skip", "retry-then-skip", "raise", "skip"],
)
def test_a_copy_whose_own_task_id_holds_the_key_is_retried_whatever_the_policy(
    app: Celery, lock_client: redis.Redis, server: RedisServer, policy: Any
) -> None:
    """Its holder is its own earlier delivery (dead, or still running past a
    visibility timeout): skipping or failing it would drop the only copy, or
    store a result under the id the running delivery will store its own."""

    @app.task(base=SingletonTask, shared=False, lock_on_contention=policy)
    def job() -> None: ...

    hold_lock(lock_client, job, holder_task_id="the-only-copy", ttl=30)
    before = queue_length(app)
    declare_as_a_worker_would(app)  # the re-send is published from this process
    trace = build_tracer(job.name, job, app=app, eager=False)
    trace(
        "the-only-copy",
        (),
        {},
        {
            "id": "the-only-copy",
            "delivery_info": {"redelivered": True, "routing_key": "tests", "exchange": ""},
            "headers": {},
            "retries": 0,
            "hostname": "celery@test",
        },
    )
    assert app.AsyncResult("the-only-copy").state == "RETRY"
    # Re-sent, to run once the holder is gone.
    wait_until(lambda: queue_length(app) == before + 1, timeout=10)


def test_a_redelivered_copy_held_off_by_another_task_is_never_skipped_by_a_composed_policy(
    app: Celery, lock_client: redis.Redis, server: RedisServer
) -> None:
    @app.task(base=SingletonTask, shared=False, lock_on_contention=Wait(timeout=0.1, then=Skip()))
    def job() -> None: ...

    hold_lock(lock_client, job, holder_task_id="someone-else", ttl=30)
    declare_as_a_worker_would(app)  # the re-send is published from this process
    trace = build_tracer(job.name, job, app=app, eager=False)
    trace(
        "redelivered",
        (),
        {},
        {
            "id": "redelivered",
            "delivery_info": {"redelivered": True, "routing_key": "tests", "exchange": ""},
            "headers": {},
            "retries": 0,
            "hostname": "celery@test",
        },
    )
    assert app.AsyncResult("redelivered").state == "RETRY"


def test_a_redelivered_copy_stays_protected_through_its_lock_retries(
    app: Celery, lock_client: redis.Redis, server: RedisServer
) -> None:
    """The re-send of a redelivered copy is not itself marked redelivered by
    the broker: the package's header must carry it, or its next contention
    skips the task."""
    from celery.signals import before_task_publish

    from celery_redislock.task import REDELIVERED_HEADER

    @app.task(base=SingletonTask, shared=False, lock_on_contention=Skip())
    def job() -> None: ...

    hold_lock(lock_client, job, holder_task_id="someone-else", ttl=30)
    published: list[dict[str, Any]] = []

    def capture(headers: dict[str, Any], **_: Any) -> None:
        published.append(dict(headers))

    before_task_publish.connect(capture, weak=False)
    try:
        declare_as_a_worker_would(app)  # the re-send is published from this process
        trace = build_tracer(job.name, job, app=app, eager=False)
        request = {
            "id": "copy",
            "delivery_info": {"redelivered": True, "routing_key": "tests", "exchange": ""},
            "headers": {},
            "retries": 0,
            "hostname": "celery@test",
        }
        trace("copy", (), {}, request)
        assert app.AsyncResult("copy").state == "RETRY"
        assert published and published[-1].get(REDELIVERED_HEADER) is True
        # The re-sent message, as the next worker receives it: not redelivered
        # by the broker, but carrying the header.
        resent = {**request, "delivery_info": {"routing_key": "tests", "exchange": ""}}
        resent["headers"] = {k: v for k, v in published[-1].items() if k.startswith("redislock")}
        published.clear()
        trace("copy", (), {}, resent)
        assert app.AsyncResult("copy").state == "RETRY"
        assert published, "the second contention must re-send again, not skip"
    finally:
        before_task_publish.disconnect(capture)
