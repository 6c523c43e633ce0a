"""Lock store unreachable at acquire: never run unprotected by default, never drop."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import LockBackendError, SingletonTask
from celery_redislock.task import BACKEND_RETRIES_HEADER
from tests.conftest import embedded_worker
from tests.servers import RedisServer

pytestmark = pytest.mark.worker


def test_fail_mode_retries_until_the_store_is_back(
    app_factory: Any, redis_server_factory: Any, record: redis.Redis
) -> None:
    store: RedisServer = redis_server_factory()
    app: Celery = app_factory(
        redislock_url=store.url,
        redislock_redis_options={"socket_timeout": 0.3, "socket_connect_timeout": 0.3},
    )

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: Any) -> int:
        record.rpush("ran", int((self.request.headers or {}).get(BACKEND_RETRIES_HEADER) or 0))
        return 1

    store.kill()
    with embedded_worker(app, "threads", 2):
        result = job.delay()
        # The body must not run while the store is down: wait for a retry.
        from tests.servers import wait_until

        wait_until(lambda: app.AsyncResult(result.id).state == "RETRY", timeout=20)
        assert record.llen("ran") == 0
        store.start()
        assert result.get(timeout=30) == 1
    ran = [int(x) for x in record.lrange("ran", 0, -1)]
    assert len(ran) == 1 and ran[0] >= 1


def test_fail_mode_gives_up_visibly_after_its_budget(
    app_factory: Any, redis_server_factory: Any, record: redis.Redis
) -> None:
    store: RedisServer = redis_server_factory()
    app: Celery = app_factory(
        redislock_url=store.url,
        redislock_backend_error_max_retries=1,
        redislock_redis_options={"socket_timeout": 0.3, "socket_connect_timeout": 0.3},
    )

    @app.task(base=SingletonTask, shared=False)
    def job() -> None:
        record.incr("runs")

    store.kill()
    with embedded_worker(app, "solo"):
        result = job.delay()
        with pytest.raises(LockBackendError, match="unavailable"):
            result.get(timeout=30)
    assert result.state == "FAILURE"
    assert record.get("runs") is None


def test_run_mode_runs_unprotected_with_a_warning(
    app_factory: Any, redis_server_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store: RedisServer = redis_server_factory()
    app: Celery = app_factory(
        redislock_url=store.url,
        redislock_redis_options={"socket_timeout": 0.3, "socket_connect_timeout": 0.3},
    )

    @app.task(base=SingletonTask, bind=True, shared=False, lock_on_backend_error="run")
    def job(self: Any) -> bool:
        return self.lock is None

    store.kill()
    with caplog.at_level("WARNING", logger="celery_redislock"), embedded_worker(app, "threads", 2):
        assert job.delay().get(timeout=30) is True
    assert "runs WITHOUT its lock" in caplog.text


def test_a_hung_store_cannot_hang_the_task(
    app_factory: Any, redis_server_factory: Any, record: redis.Redis
) -> None:
    store: RedisServer = redis_server_factory()
    app: Celery = app_factory(
        redislock_url=store.url,
        redislock_backend_error_max_retries=0,
        redislock_redis_options={"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
    )

    @app.task(base=SingletonTask, shared=False)
    def job() -> None: ...

    store.pause()  # SIGSTOP: accepts TCP, never answers
    try:
        with embedded_worker(app, "threads", 2):
            result = job.delay()
            with pytest.raises(LockBackendError):
                result.get(timeout=30)  # bounded client timeouts, not forever
    finally:
        store.resume()


def test_two_apps_use_their_own_lock_stores(
    app_factory: Any, redis_server_factory: Any, record: redis.Redis
) -> None:
    one: RedisServer = redis_server_factory()
    two: RedisServer = redis_server_factory()
    app_one: Celery = app_factory(redislock_url=one.url)
    app_two: Celery = app_factory(redislock_url=two.url)
    started = threading.Barrier(2, timeout=20)

    def define(app: Celery) -> Any:
        @app.task(base=SingletonTask, bind=True, shared=False, name="shared.name")
        def job(self: Any) -> str:
            record.rpush("stores", self.lock.backend.url)
            started.wait()  # both run at the same moment: different stores, no contention
            return str(self.lock.backend.url)

        return job

    job_one, job_two = define(app_one), define(app_two)
    r1 = job_one.apply_async()
    r2_thread = threading.Thread(target=lambda: record.set("r2", job_two.apply().get()))
    with embedded_worker(app_one, "threads", 2):
        r2_thread.start()
        assert r1.get(timeout=20) == one.url
        r2_thread.join(20)
    assert record.get("r2") == two.url
    assert sorted(record.lrange("stores", 0, -1)) == sorted([one.url, two.url])


def test_run_mode_takes_back_an_acquire_that_lands_after_the_run(
    app_factory: Any, server: RedisServer, record: redis.Redis
) -> None:
    """lock_on_backend_error="run": the body ran unprotected; the timed-out acquire lands later."""
    from tests.conftest import LOCK_DB
    from tests.servers import FaultProxy, wait_until

    proxy = FaultProxy(server.port)
    try:
        app: Celery = app_factory(
            redislock_url=f"{proxy.url}/{LOCK_DB}",
            redislock_on_backend_error="run",
            redislock_redis_options={"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
        )

        @app.task(base=SingletonTask, shared=False)
        def job(n: int) -> int:
            record.rpush("runs", n)
            return n

        key = job.lock_key_for((1,), {})
        with embedded_worker(app, "threads", 1):
            assert job.delay(0).get(timeout=20) == 0  # connections open
            proxy.blackhole()
            assert job.delay(1).get(timeout=30) == 1  # ran without its lock
            proxy.heal_and_flush()  # the held acquire reaches Redis now
            locks = server.client(LOCK_DB)
            locks.ping()  # queued behind it
            # Well before its 30 s TTL would free it.
            wait_until(lambda: locks.exists(key) == 0, timeout=20, message="the late value")
    finally:
        proxy.close()


@pytest.mark.parametrize("beat", ["skip", "handoff"])
def test_a_call_of_a_task_whose_beat_calls_park_still_waits_for_its_replicas(
    app: Celery, beat: str
) -> None:
    """No replica here: refused whatever the beat policy (PARK sends no WAIT; helper-35)."""

    @app.task(
        base=SingletonTask,
        shared=False,
        lock_min_replicas=1,
        lock_min_replicas_timeout=0.2,
        lock_beat_on_contention=beat,
    )
    def job() -> str:
        return "ran"

    result = job.apply()
    assert result.state == "FAILURE" and isinstance(result.result, LockBackendError)
