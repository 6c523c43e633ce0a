"""The run-time locking problems users hit with celery-singleton, celery-once and
celery-heimdall (shared/notes/peers.md §3), each as a scenario we must pass."""

from __future__ import annotations

import datetime
import decimal
import time
import uuid
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import Retry, SingletonTask, is_skipped
from celery_redislock._clock import clock
from tests.conftest import embedded_worker
from tests.helpers import held_locks
from tests.servers import wait_until

pytestmark = pytest.mark.worker


def test_p1_retry_is_delivered_not_swallowed(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """celery-singleton #20, heimdall: a retry re-enters its own lock and runs."""

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: Any) -> int:
        record.rpush("attempts", self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return int(self.request.retries)

    with embedded_worker(app, "prefork", 2):
        assert job.delay().get(timeout=30) == 1
    assert record.lrange("attempts", 0, -1) == ["0", "1"]
    assert held_locks(lock_client) == []  # nothing left behind, no TTL wait


def test_p3_renewal_prevents_a_second_instance_and_release_is_owner_checked(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """celery/celery#4344, celery-once PR #101: TTL 1 s, a 3 s task, duplicates at 1.6 s."""

    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=1.0, lock_args=("n",))
    def job(self: Any, n: int, seconds: float = 3.0) -> str:
        active = record.incr("active")
        record.rpush("peak", active)
        record.set("started", clock())
        time.sleep(seconds)
        record.decr("active")
        return "ran"

    with embedded_worker(app, "threads", 3):
        first = job.delay(1)
        started = float(wait_until(lambda: record.get("started"), timeout=20))
        wait_until(lambda: clock() > started + 1.6, timeout=10)  # past the 1 s TTL
        duplicate = job.delay(1)
        assert is_skipped(duplicate.get(timeout=20))  # renewal kept the first's lock
        assert first.get(timeout=20) == "ran"
        assert job.delay(1, 0).get(timeout=20) == "ran"  # free again afterwards
    assert max(int(p) for p in record.lrange("peak", 0, -1)) == 1


KEY_DRIFT_CALLS = [
    ((1, 2),),
    ({1: "x", "nested": {"b": [1, (2, 3)], "a": None}},),
    (uuid.UUID("12345678-1234-5678-1234-567812345678"),),
    (datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc),),
    (decimal.Decimal("10.50"),),
]


def test_p4_producer_and_worker_agree_on_the_key(app: Celery, record: redis.Redis) -> None:
    """celery-once #93/#58, celery-once-task: tuple args, int keys, UUID, datetime, Decimal."""

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: Any, value: Any, flag: bool = False) -> str:
        return str(self.lock.key)

    with embedded_worker(app, "prefork", 2):
        for args in KEY_DRIFT_CALLS:
            expected = job.lock_key_for(args, {})
            assert job.delay(*args).get(timeout=20) == expected
            assert (
                job.apply_async(kwargs={"value": args[0], "flag": False}).get(timeout=20)
                == expected
            )


def test_p5_subset_keys_name_only_keys_and_key_functions(
    app: Celery, lock_client: redis.Redis
) -> None:
    """celery-singleton #15/#23/#52, celery-once #91."""

    @app.task(base=SingletonTask, shared=False, lock_args=("user_id",))
    def by_user(user_id: int, note: str = "", retries: int = 3) -> None: ...

    @app.task(base=SingletonTask, shared=False, lock_args=())
    def name_only(x: int) -> None: ...

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_key=lambda args, kwargs: f"payment:{kwargs['payment_id']}",
    )
    def pay(payment_id: str, amount: int) -> None: ...

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_key=lambda args, kwargs: f"payment:{kwargs['payment_id']}",
    )
    def refund(payment_id: str) -> None: ...

    assert by_user.lock_key_for((1, "a"), {}) == by_user.lock_key_for(
        (1,), {"note": "b", "retries": 9}
    )
    assert by_user.lock_key_for((1,), {}) != by_user.lock_key_for((2,), {})
    assert name_only.lock_key_for((1,), {}) == name_only.lock_key_for((2,), {})
    assert pay.lock_key_for((), {"payment_id": "p1", "amount": 5}) == "redislock:{payment:p1}"
    # Two tasks sharing one lock through a key function: the second is skipped.
    key = pay.lock_key_for((), {"payment_id": "p1", "amount": 5})
    lock_client.set(key, "v1|other|0|h|1|n|t|0", px=30000)
    assert is_skipped(refund.apply(kwargs={"payment_id": "p1"}).get())


def test_p6_send_task_duplicates_are_stopped_at_run_time_without_touching_the_holder(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """celery-once #113/#136, celery-singleton #24/#37, heimdall: send_task bypasses apply_async."""

    @app.task(base=SingletonTask, bind=True, shared=False, name="peers.long")
    def long(self: Any, n: int) -> str:
        record.set("key", self.lock.key)
        record.set("value", lock_client.get(self.lock.key) or b"")
        wait_until(lambda: record.get("go"), timeout=30)
        return "first"

    with embedded_worker(app, "threads", 2):
        first = app.send_task("peers.long", args=(1,))
        key = wait_until(lambda: record.get("key"), timeout=20)
        value = lock_client.get(key)
        assert is_skipped(app.send_task("peers.long", args=(1,)).get(timeout=20))
        assert lock_client.get(key) == value  # the duplicate left the holder's lock alone
        record.set("go", 1)
        assert first.get(timeout=20) == "first"
    assert lock_client.exists(key) == 0


def test_p7_a_second_delivery_of_the_same_task_id_never_runs_concurrently(
    app: Celery, record: redis.Redis
) -> None:
    """celery-singleton #38, celery#5306: visibility-timeout redelivery (same task id)."""

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="peers.same_id",
        lock_on_contention=Retry(countdown=0.3, jitter=0.1),
    )
    def job(self: Any) -> None:
        active = record.incr("active")
        record.rpush("peak", active)
        record.rpush("runs", self.request.id)
        time.sleep(1.0)
        record.decr("active")
        record.rpush("done", self.request.id)

    with embedded_worker(app, "threads", 2):
        first = app.send_task("peers.same_id", task_id="same-id")
        wait_until(lambda: record.llen("runs") == 1, timeout=20)
        app.send_task("peers.same_id", task_id="same-id")  # the "redelivered" copy
        # Same id as the holder: not skipped (it may be the only copy left),
        # retried, and run only once the first has finished.
        wait_until(lambda: record.llen("done") == 2, timeout=30)
        first.get(timeout=20)
    assert max(int(p) for p in record.lrange("peak", 0, -1)) == 1
