"""The lock is released on every in-process exit path, on every pool."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import Ignore, Reject

from celery_redislock import SingletonTask
from tests.conftest import embedded_worker
from tests.helpers import decoded, held_locks
from tests.servers import wait_until

pytestmark = pytest.mark.worker


def test_success_releases_before_the_result_is_stored(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, pool: str
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False)
    def work(self: Any, n: int) -> int:
        assert self.lock is not None and self.lock.owned
        record.rpush("held", lock_client.get(self.lock.key) or b"")
        record.set("key", self.lock.key)
        return n * 2

    with embedded_worker(app, pool, 2):
        result = work.delay(21)
        assert result.get(timeout=20) == 42
        # No waiting: get() returning means the lock is already free.
        assert lock_client.exists(record.get("key")) == 0
    held = decoded(record.lrange("held", 0, -1)[0])
    assert held is not None and held.owner.task_id == result.id and held.task_name == work.name


def test_exception_releases(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, pool: str
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False)
    def fail(self: Any) -> None:
        record.set("key", self.lock.key)
        raise KeyError("boom")

    with embedded_worker(app, pool, 2):
        result = fail.delay()
        with pytest.raises(KeyError):
            result.get(timeout=20)
        assert lock_client.exists(record.get("key")) == 0


def test_retry_releases_and_the_retry_is_delivered_and_relocks(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, pool: str
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, max_retries=3)
    def flaky(self: Any, n: int) -> str:
        value = decoded(lock_client.get(self.lock.key))
        assert value is not None
        record.rpush(
            "attempts", f"{self.request.retries}:{value.owner.attempt}:{value.owner.task_id}"
        )
        record.set("key", self.lock.key)
        if self.request.retries < 2:
            raise self.retry(countdown=0)
        return "done"

    with embedded_worker(app, pool, 2):
        result = flaky.delay(1)
        assert result.get(timeout=30) == "done"
        assert lock_client.exists(record.get("key")) == 0
    assert record.lrange("attempts", 0, -1) == [f"{n}:{n}:{result.id}" for n in range(3)]


def test_autoretry_for_is_delivered(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, pool: str
) -> None:
    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        autoretry_for=(ValueError,),
        retry_kwargs={"countdown": 0, "max_retries": 2},
    )
    def auto(self: Any) -> int:
        record.set("key", self.lock.key)
        if record.incr("runs") < 2:
            raise ValueError("again")
        return 7

    with embedded_worker(app, pool, 2):
        assert auto.delay().get(timeout=30) == 7
        assert lock_client.exists(record.get("key")) == 0
    assert record.get("runs") == "2"


@pytest.mark.parametrize("exc", [Ignore(), Reject("no", requeue=False)], ids=["ignore", "reject"])
def test_ignore_and_reject_release(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, pool: str, exc: Exception
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False)
    def stop(self: Any) -> None:
        record.set("key", self.lock.key)
        raise exc

    with embedded_worker(app, pool, 2):
        stop.delay()
        key = wait_until(lambda: record.get("key"), timeout=20)
        wait_until(lambda: lock_client.exists(key) == 0, timeout=10, message="lock released")


def test_soft_time_limit_releases(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, soft_time_limit=0.5)
    def slow(self: Any) -> None:
        record.set("key", self.lock.key)
        import time

        time.sleep(30)

    with embedded_worker(app, "prefork", 1):
        result = slow.delay()
        with pytest.raises(Exception, match="SoftTimeLimitExceeded"):
            result.get(timeout=20)
        assert lock_client.exists(record.get("key")) == 0


def test_eager_apply_locks_and_releases(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False)
    def eager(self: Any, n: int) -> int:
        assert self.lock is not None
        record.set("key", self.lock.key)
        record.set("held", lock_client.get(self.lock.key) or b"")
        return n

    result = eager.apply((5,))
    assert result.get() == 5
    assert lock_client.exists(record.get("key")) == 0
    held = decoded(record.get("held"))
    assert held is not None and held.owner.task_id == result.id


def test_task_always_eager_locks(
    app_factory: Any, record: redis.Redis, lock_client: redis.Redis
) -> None:
    app = app_factory(task_always_eager=True, task_eager_propagates=True)

    @app.task(base=SingletonTask, bind=True, shared=False)
    def eager(self: Any) -> None:
        record.set("locked", int(self.lock is not None))
        raise RuntimeError("propagates")

    with pytest.raises(RuntimeError):
        eager.delay()
    assert record.get("locked") == "1"
    assert held_locks(lock_client) == []


def test_direct_call_is_a_plain_call_without_a_lock(app: Celery, lock_client: redis.Redis) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False)
    def direct(self: Any, n: int) -> Any:
        return self.lock, n

    assert direct(3) == (None, 3)
    assert held_locks(lock_client) == []


def test_lock_enabled_false_runs_without_lock(app: Celery, lock_client: redis.Redis) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, lock_enabled=False)
    def off(self: Any) -> bool:
        return self.lock is None

    assert off.apply().get() is True
    assert held_locks(lock_client) == []


def test_a_base_with_its_own_call_is_still_called_under_the_lock(
    app: Celery, record: redis.Redis, lock_client: redis.Redis, pool: str
) -> None:
    """A base's ``__call__`` after the mixin runs inside the lock, around the body."""
    from celery import Task

    from celery_redislock import SingletonTaskMixin

    class Session(Task):  # type: ignore[type-arg]
        abstract = True

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            record.rpush("session", "open")
            try:
                return super().__call__(*args, **kwargs)
            finally:
                record.rpush("session", "closed")

    class LockedSession(SingletonTaskMixin, Session):
        abstract = True

    @app.task(base=LockedSession, bind=True, shared=False)
    def job(self: Any, n: int) -> list[Any]:
        record.rpush("session", "body")
        return [self.request.id, self.lock is not None, lock_client.exists(self.lock.key)]

    with embedded_worker(app, pool, 2):
        result = job.delay(1)
        assert result.get(timeout=20) == [result.id, True, 1]
        assert record.lrange("session", 0, -1) == ["open", "body", "closed"]
    assert held_locks(lock_client) == []


def test_a_task_call_wrapper_installed_before_the_task_exists_still_runs(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    """An instrumentation hook that wraps Celery's ``Task.__call__`` at start-up (APM agents)."""
    import functools

    from celery import Task

    original = Task.__call__

    @functools.wraps(original)
    def instrumented(self: Any, *args: Any, **kwargs: Any) -> Any:
        record.rpush("wrapped", self.name)
        return original(self, *args, **kwargs)

    Task.__call__ = instrumented  # type: ignore[method-assign]
    try:

        @app.task(base=SingletonTask, bind=True, shared=False)
        def job(self: Any, n: int) -> bool:
            return lock_client.exists(self.lock.key) == 1

        with embedded_worker(app, "solo"):
            assert job.delay(1).get(timeout=20) is True
    finally:
        Task.__call__ = original  # type: ignore[method-assign]
    assert record.lrange("wrapped", 0, -1) == [job.name]
    assert held_locks(lock_client) == []
