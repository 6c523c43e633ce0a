"""Contention policies in a real worker: what the caller gets back."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
from celery import Celery
from celery.app.trace import build_tracer

from celery_redislock import (
    LockContended,
    Raise,
    Retry,
    SingletonTask,
    Skip,
    Wait,
    is_skipped,
    lock_acquired,
    lock_contended,
)
from celery_redislock.task import LOCK_RETRIES_HEADER
from tests.brokers import QUORUM, declare_as_a_worker_would, queue_length
from tests.conftest import embedded_worker
from tests.helpers import held_locks, hold_lock
from tests.servers import RedisServer, wait_until

pytestmark = pytest.mark.worker


@pytest.fixture
def signal_log() -> Any:
    events: list[tuple[str, dict[str, Any]]] = []

    def on_contended(sender: Any = None, **kw: Any) -> None:
        events.append(("contended", kw))

    def on_acquired(sender: Any = None, **kw: Any) -> None:
        events.append(("acquired", kw))

    lock_contended.connect(on_contended, weak=False)
    lock_acquired.connect(on_acquired, weak=False)
    yield events
    lock_contended.disconnect(on_contended)
    lock_acquired.disconnect(on_acquired)


def test_skip_returns_the_skip_result_and_is_visible(
    app: Celery,
    record: redis.Redis,
    lock_client: redis.Redis,
    signal_log: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @app.task(base=SingletonTask, shared=False, lock_on_contention="skip")
    def job(n: int) -> int:
        record.incr("runs")
        return n

    key, _ = hold_lock(lock_client, job, (1,))
    with caplog.at_level("INFO", logger="celery_redislock"), embedded_worker(app, "threads", 2):
        result = job.delay(1).get(timeout=20)
        assert job.delay(2).get(timeout=20) == 2  # other arguments: other key, runs
    assert is_skipped(result)
    assert result == {
        "__redislock__": "skipped",
        "key": key,
        "task": job.name,
        "holder": "holder-task-id",
    }
    assert record.get("runs") == "1"
    contended = [kw for name, kw in signal_log if name == "contended"]
    assert len(contended) == 1 and contended[0]["holder_task_id"] == "holder-task-id"
    assert contended[0]["policy"] == "skip" and contended[0]["key"] == key
    assert f"lock {key} is held by holder-task-id" in caplog.text


def test_raise_fails_with_a_picklable_lock_contended(
    app: Celery, lock_client: redis.Redis, pool: str
) -> None:
    @app.task(base=SingletonTask, shared=False, lock_on_contention=Raise())
    def job() -> None: ...

    key, _ = hold_lock(lock_client, job, ttl=30)
    with embedded_worker(app, pool, 2):
        result = job.delay()
        with pytest.raises(LockContended) as info:
            result.get(timeout=20)
    assert result.state == "FAILURE"
    assert info.value.key == key and info.value.holder_task_id == "holder-task-id"
    assert info.value.ttl_remaining is not None and 0 < info.value.ttl_remaining <= 30


def test_retry_waits_for_the_holder_without_spending_max_retries(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, pool: str
) -> None:
    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        max_retries=0,
        lock_on_contention=Retry(countdown=0.2, jitter=0.1, max_retries=50),
    )
    def job(self: Any) -> str:
        record.rpush(
            "ran",
            f"{self.request.retries}:{(self.request.headers or {}).get(LOCK_RETRIES_HEADER, 0)}",
        )
        return "ran"

    # A holder that died (not renewed); 2 s leaves room for several 0.2 s
    # retries even when the worker is slow to start on a loaded machine (on
    # quorum queues retries are whole seconds: 4 s).
    hold_lock(lock_client, job, ttl=4.0 if QUORUM else 2.0)
    with embedded_worker(app, pool, 2):
        result = job.delay()
        assert result.get(timeout=30) == "ran"
    [ran] = record.lrange("ran", 0, -1)
    retries, lock_retries = map(int, ran.split(":"))
    assert retries == 0  # the task's own max_retries=0 was not spent
    assert lock_retries >= 2


def test_retry_countdown_defaults_to_the_holders_remaining_ttl(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, shared=False, lock_on_contention=Retry(jitter=0))
    def job() -> str:
        return "ran"

    hold_lock(lock_client, job, ttl=1.5)
    with embedded_worker(app, "threads", 2):
        result = job.delay()
        assert result.get(timeout=30) == "ran"


def test_retry_budget_spent_then_fallback(
    app: Celery, lock_client: redis.Redis, record: redis.Redis
) -> None:
    @app.task(
        base=SingletonTask,
        shared=False,
        lock_on_contention=Retry(countdown=0.05, jitter=0, max_retries=3),
    )
    def job() -> None:
        record.incr("runs")

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_on_contention=Retry(countdown=0.05, jitter=0, max_retries=2, then=Skip()),
    )
    def job2() -> None:
        record.incr("runs")

    hold_lock(lock_client, job, ttl=60)
    hold_lock(lock_client, job2, ttl=60)
    with embedded_worker(app, "threads", 2):
        with pytest.raises(LockContended):
            job.delay().get(timeout=30)
        assert is_skipped(job2.delay().get(timeout=30))
    assert record.get("runs") is None


def test_wait_takes_the_lock_when_the_holder_releases(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, pool: str
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, lock_on_contention=Wait(timeout=60))
    def job(self: Any) -> int:
        return int((self.request.headers or {}).get(LOCK_RETRIES_HEADER) or 0)

    key, value = hold_lock(lock_client, job, ttl=60)
    backend = job._lock_settings().backend
    threading.Timer(0.5, lambda: backend.release(key, value)).start()
    with embedded_worker(app, pool, 2):
        # Woken by the holder's release notification, long before its 60 s
        # TTL and within this get() timeout; no retry was needed.
        assert job.delay().get(timeout=20) == 0
    assert lock_client.exists(key) == 0


def test_wait_hand_off_from_a_real_holder(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, lock_on_contention=Wait(timeout=30))
    def job(self: Any, tag: str) -> str:
        record.rpush("order", f"start:{tag}")
        import time

        time.sleep(0.3)
        record.rpush("order", f"end:{tag}")
        return tag

    with embedded_worker(app, "threads", 3):
        results = [job.apply_async(("x",), headers={"n": n}) for n in range(3)]
        assert [r.get(timeout=30) for r in results] == ["x", "x", "x"]
    order = record.lrange("order", 0, -1)
    assert order == ["start:x", "end:x"] * 3  # strictly one at a time


def test_wait_times_out_then_falls_back(app: Celery, lock_client: redis.Redis) -> None:
    @app.task(base=SingletonTask, shared=False, lock_on_contention=Wait(timeout=0.3, then=Skip()))
    def job() -> None: ...

    hold_lock(lock_client, job, ttl=30)
    with embedded_worker(app, "solo"):
        assert is_skipped(job.delay().get(timeout=20))


def test_redelivered_message_is_retried_not_skipped(
    app: Celery, lock_client: redis.Redis, server: RedisServer
) -> None:
    """Worker-mode tracer with delivery_info.redelivered: Skip turns into Retry."""

    @app.task(base=SingletonTask, shared=False, lock_on_contention="skip")
    def job() -> None: ...

    hold_lock(lock_client, job, ttl=30)
    before = queue_length(app)
    declare_as_a_worker_would(app)  # the re-send is published from this process
    trace = build_tracer(job.name, job, app=app, eager=False)
    request = {
        "delivery_info": {"redelivered": True, "routing_key": "tests", "exchange": ""},
        "headers": {},
        "retries": 0,
        "hostname": "celery@test",
    }
    trace("redelivered-id", (), {}, {**request, "id": "redelivered-id"})
    assert app.AsyncResult("redelivered-id").state == "RETRY"
    # The retry message was published.
    wait_until(lambda: queue_length(app) == before + 1, timeout=10)

    # The same call not redelivered is skipped, as configured.
    request["delivery_info"] = {"redelivered": False, "routing_key": "tests", "exchange": ""}
    trace("fresh-id", (), {}, {**request, "id": "fresh-id"})
    fresh = app.AsyncResult("fresh-id")
    assert fresh.state == "SUCCESS" and is_skipped(fresh.result)


def test_eager_retry_policy_spends_its_budget_at_once(
    app: Celery, lock_client: redis.Redis
) -> None:
    @app.task(
        base=SingletonTask, shared=False, lock_on_contention=Retry(countdown=10, max_retries=3)
    )
    def job() -> None: ...

    hold_lock(lock_client, job, ttl=30)
    result = job.apply()
    assert result.state == "FAILURE" and isinstance(result.result, LockContended)


def test_a_retry_waits_for_its_own_previous_attempt_to_release(
    app: Celery, lock_client: redis.Redis
) -> None:
    """The retry message is published before the previous attempt's finally
    releases: the new attempt waits for that release instead of retrying."""

    @app.task(base=SingletonTask, bind=True, shared=False, lock_on_contention=Raise())
    def job(self: Any) -> int:
        return int(self.request.retries)

    key, value = hold_lock(lock_client, job, holder_task_id="same-task", ttl=30)
    backend = job._lock_settings().backend
    threading.Timer(0.3, lambda: backend.release(key, value)).start()
    assert job.apply(task_id="same-task", retries=1).get() == 1  # not LockContended


def test_a_waiter_whose_subscription_drops_resubscribes_and_runs(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, lock_on_contention=Wait(timeout=30))
    def job(self: Any) -> str:
        record.rpush("runs", self.request.id)
        return "ran"

    key, value = hold_lock(lock_client, job, ttl=30)
    backend = job._lock_settings().backend
    with embedded_worker(app, "threads", 2):
        result = job.delay()

        def subscriptions() -> list[Any]:
            return [c for c in lock_client.client_list(_type="pubsub") if c["db"] == "2"]

        waiting = wait_until(subscriptions, timeout=20)
        for client in waiting:
            lock_client.client_kill_filter(_id=client["id"])  # Redis stays up
        backend.release(key, value)
        assert result.get(timeout=20) == "ran"
    assert record.lrange("runs", 0, -1) == [result.id]


def test_nested_calls_inside_a_running_task(app: Celery, lock_client: redis.Redis) -> None:
    """Tasks are not reentrant. A direct call inside the body is a plain call in the
    running execution (no lock of its own); a same-key apply() is another execution:
    it meets the held lock and follows the policy; another key runs."""
    seen: dict[str, Any] = {}

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_on_contention="skip", lock_args=["n"]
    )
    def job(self: Any, n: int, nest: bool = False) -> str:
        if nest:
            seen["held"] = lock_client.get(self.lock.key)
            seen["direct"] = job(n)  # a direct call inside the running task
            seen["still held"] = lock_client.get(self.lock.key)
            seen["apply"] = job.apply((n,)).get()
            seen["other key"] = job.apply((n + 1,)).get()
        return "ran"

    assert job.apply((1, True)).get() == "ran"  # eager
    assert seen["direct"] == "ran" and seen["still held"] == seen["held"] is not None
    assert is_skipped(seen["apply"])
    assert seen["other key"] == "ran"
    assert held_locks(lock_client) == []
    seen.clear()
    with embedded_worker(app, "threads", 2):  # and in a worker
        assert job.delay(5, True).get(timeout=30) == "ran"
    assert seen["direct"] == "ran" and seen["still held"] == seen["held"] is not None
    assert is_skipped(seen["apply"]) and seen["other key"] == "ran"
    assert held_locks(lock_client) == []
