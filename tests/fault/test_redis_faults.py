"""Faults on the Redis side: restart, pause, partition, latency, NOSCRIPT, eviction."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import RedisLock, SingletonTask, lock_lost
from celery_redislock.fencing import FencedStore
from tests.conftest import embedded_worker
from tests.servers import FaultProxy, RedisServer, wait_until

pytestmark = [pytest.mark.fault]


@pytest.fixture
def losses() -> Iterator[list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        events.append({**kwargs, "at": time.monotonic()})

    lock_lost.connect(receiver, weak=False)
    yield events
    lock_lost.disconnect(receiver)


def test_redis_restarted_empty_old_holder_told_and_fenced_out(
    redis_server_factory: Any, server: RedisServer, losses: list[dict[str, Any]]
) -> None:
    store_server: RedisServer = redis_server_factory()
    resource = FencedStore(server.client(5))  # the protected resource lives elsewhere
    old = RedisLock(store_server.client(), "account:7", ttl=1.5)
    assert old.acquire(blocking=False)
    old_fence = old.fence
    assert old_fence is not None and resource.write("account:7", "old-1", old_fence)
    restarted_at = time.monotonic()
    store_server.restart()  # no persistence: the key and the fence counter are gone
    wait_until(lambda: old.lost, timeout=5, message="the old holder to learn of the loss")
    told_after = time.monotonic() - restarted_at
    new = RedisLock(store_server.client(), "account:7", ttl=1.5)
    assert new.acquire(blocking=False)
    assert new.fence is not None and new.fence > old_fence
    assert resource.write("account:7", "new-1", new.fence)
    assert not resource.write("account:7", "old-2", old_fence)  # the stale holder is refused
    assert resource.read("account:7") == (b"new-1", new.fence)
    print(f"\n[measured] redis restart: holder told after {told_after:.2f}s (TTL 1.5s)")
    # The signal follows the flag from the renewer thread: wait for it.
    wait_until(lambda: losses, timeout=5, message="the lock_lost signal")
    assert [e["reason"] for e in losses if e["key"] == "account:7"] == ["gone"]
    new.release()
    old.release()


def test_redis_paused_longer_than_the_ttl(
    redis_server_factory: Any, losses: list[dict[str, Any]]
) -> None:
    store_server: RedisServer = redis_server_factory()
    client = store_server.client(socket_timeout=0.5, socket_connect_timeout=0.5)
    lock = RedisLock(client, "paused", ttl=1.0)
    assert lock.acquire(blocking=False)
    store_server.pause()  # SIGSTOP: connections open, no answers
    paused_at = time.monotonic()
    try:
        wait_until(lambda: lock.lost, timeout=5, message="loss while Redis is frozen")
        detected = time.monotonic() - paused_at
        assert lock.handle is not None and lock.handle.lost_reason == "expired_locally"
        started = time.monotonic()
        assert lock.release() is None  # bounded by the client's timeouts; never raises
        release_took = time.monotonic() - started
    finally:
        store_server.resume()
    print(
        f"\n[measured] redis SIGSTOP: loss reported after {detected:.2f}s (TTL 1.0s), "
        f"release gave up after {release_took:.2f}s"
    )
    assert detected < 1.0 + 1.0  # within the TTL plus one renewal timeout and a tick
    wait_until(lambda: losses, timeout=5, message="the lock_lost signal")
    assert [e["reason"] for e in losses if e["key"] == "paused"] == ["expired_locally"]


def test_task_finishes_within_its_bound_while_redis_is_frozen(
    app_factory: Any, redis_server_factory: Any, record: redis.Redis
) -> None:
    store_server: RedisServer = redis_server_factory()
    app: Celery = app_factory(
        redislock_url=store_server.url,
        redislock_redis_options={"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
    )

    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=1.0)
    def job(self: Any) -> bool:
        record.set("started", 1)
        wait_until(lambda: record.get("go"), timeout=30)
        return bool(self.lock.lost)

    with embedded_worker(app, "threads", 2):
        result = job.delay()
        wait_until(lambda: record.get("started"), timeout=20)
        store_server.pause()
        try:
            record.set("go", 1)
            began = time.monotonic()
            assert result.get(timeout=20) in (True, False)  # finished despite the frozen store
            took = time.monotonic() - began
        finally:
            store_server.resume()
    print(f"\n[measured] task finished {took:.2f}s after Redis froze (release bounded)")


def test_latency_below_ttl_over_6_loses_nothing(
    redis_server_factory: Any, losses: list[Any]
) -> None:
    store_server: RedisServer = redis_server_factory()
    proxy = FaultProxy(store_server.port)
    try:
        client = redis.Redis(port=proxy.port, socket_timeout=2)
        lock = RedisLock(client, "slow-link", ttl=1.5)
        assert lock.acquire(blocking=False)
        proxy.latency = 0.1  # per chunk, each way: ~0.2 s per round trip
        handle = lock.handle
        assert handle is not None
        wait_until(lambda: handle.renewals >= 6, timeout=15)
        assert not lock.lost and [e for e in losses if e["key"] == "slow-link"] == []
        lock.release()
    finally:
        proxy.close()


def test_blackhole_reports_loss_at_the_lease_deadline(
    redis_server_factory: Any, losses: list[dict[str, Any]]
) -> None:
    store_server: RedisServer = redis_server_factory()
    proxy = FaultProxy(store_server.port)
    try:
        client = redis.Redis(port=proxy.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        lock = RedisLock(client, "partitioned", ttl=1.5)
        assert lock.acquire(blocking=False)
        handle = lock.handle
        assert handle is not None
        proxy.blackhole()
        cut_at = time.monotonic()
        wait_until(lambda: lock.lost, timeout=10, message="loss during the partition")
        detected = time.monotonic() - cut_at
        assert handle.lost_reason == "expired_locally"
        print(f"\n[measured] partition: loss reported {detected:.2f}s after the cut (TTL 1.5s)")
        assert detected <= 1.5 + 0.5 + 0.5
        proxy.heal()
        # A successor takes the key after it expires; the healed old holder's
        # release leaves it alone.
        successor = RedisLock(store_server.client(), "partitioned", ttl=5)
        assert successor.acquire(timeout=5)
        lock.release()
        assert store_server.client().get("partitioned") is not None
        successor.release()
    finally:
        proxy.close()


@pytest.mark.parametrize("mode", ["fail", "run"])
def test_blackholed_store_at_acquire_honours_on_backend_error(
    app_factory: Any, redis_server_factory: Any, record: redis.Redis, mode: str
) -> None:
    store_server: RedisServer = redis_server_factory()
    proxy = FaultProxy(store_server.port)
    app: Celery = app_factory(
        redislock_url=proxy.url,
        redislock_on_backend_error=mode,
        redislock_backend_error_max_retries=1,
        redislock_redis_options={"socket_timeout": 0.3, "socket_connect_timeout": 0.3},
    )

    @app.task(base=SingletonTask, shared=False)
    def job() -> str:
        record.incr("runs")
        return "ran"

    proxy.blackhole()
    try:
        with embedded_worker(app, "threads", 2):
            result = job.delay()
            if mode == "run":
                assert result.get(timeout=30) == "ran"
            else:
                with pytest.raises(Exception, match="unavailable"):
                    result.get(timeout=30)
                assert record.get("runs") is None  # never ran unprotected
    finally:
        proxy.close()


def test_script_flush_between_acquire_and_release(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: Any) -> str:
        record.set("key", self.lock.key)
        lock_client.script_flush()
        return "ok"

    with embedded_worker(app, "prefork", 1):
        assert job.delay().get(timeout=20) == "ok"
    assert lock_client.exists(record.get("key")) == 0


def test_eviction_under_volatile_ttl_is_reported(
    redis_server_factory: Any, losses: list[dict[str, Any]]
) -> None:
    store_server: RedisServer = redis_server_factory(
        "--maxmemory", "4mb", "--maxmemory-policy", "volatile-ttl"
    )
    client = store_server.client()
    lock = RedisLock(client, "evictable", ttl=5)
    assert lock.acquire(blocking=False)
    filler = "x" * 1024
    pipe = client.pipeline(transaction=False)
    for n in range(8000):  # ~8 MB of keys with a longer TTL than the lock's
        pipe.set(f"cache:{n}", filler, ex=3600)
        if n % 500 == 0:
            pipe.execute()
    pipe.execute()
    evicted = int(client.info("stats")["evicted_keys"])
    assert evicted > 0
    wait_until(lambda: lock.lost, timeout=10, message="the evicted lock to be reported")
    assert lock.handle is not None and lock.handle.lost_reason == "gone"
    print(f"\n[measured] volatile-ttl evicted {evicted} keys, the lock among the first")
    lock.release()


def test_a_late_acquire_reply_is_taken_over_by_the_executions_own_retry(
    app_factory: Any, redis_server_factory: Any, record: redis.Redis
) -> None:
    """Redis frozen: the acquire gives up, but its script runs once Redis thaws.

    The key then holds the execution's own earlier value. Its backoff retry
    must take that value over, not contend with itself (policy raise would
    fail the task with LockContended naming itself).
    """
    store_server: RedisServer = redis_server_factory()
    app: Celery = app_factory(
        redislock_url=store_server.url,
        redislock_on_contention="raise",
        redislock_redis_options={"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
    )

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: Any) -> str:
        record.rpush("runs", self.request.id)
        return "ran"

    with embedded_worker(app, "threads", 2):
        job.delay().get(timeout=20)  # connections open before the freeze
        record.delete("runs")
        store_server.pause()
        try:
            result = job.delay()
            wait_until(lambda: result.state == "RETRY", timeout=30, message="a backoff retry")
        finally:
            store_server.resume()
        key = job.lock_key_for((), {})
        # The frozen attempt's script ran after all: the key holds its value.
        wait_until(lambda: store_server.client(0).exists(key), timeout=5)
        assert result.get(timeout=30) == "ran"
    assert record.lrange("runs", 0, -1) == [result.id]
    assert store_server.client(0).exists(key) == 0


def test_acquire_gives_up_on_a_frozen_store_within_the_stated_bound(
    app_factory: Any, redis_server_factory: Any, record: redis.Redis
) -> None:
    """README: an acquire gives up within (retries + 1) x (connect + socket timeout)
    + retries x 0.2 s, with the package's 2 client retries."""
    timeout = 1.0
    bound = (2 + 1) * (timeout + timeout) + 2 * 0.2
    store_server: RedisServer = redis_server_factory()
    app: Celery = app_factory(
        redislock_url=store_server.url,
        redislock_backend_error_max_retries=0,
        redislock_redis_options={"socket_timeout": timeout, "socket_connect_timeout": timeout},
    )

    @app.task(base=SingletonTask, shared=False)
    def job() -> None:
        record.incr("runs")

    store_server.pause()
    try:
        with embedded_worker(app, "threads", 1):
            started = time.monotonic()
            with pytest.raises(Exception, match="unavailable"):
                job.delay().get(timeout=60)
            took = time.monotonic() - started
    finally:
        store_server.resume()
    print(f"\n[measured] frozen store: acquire gave up after {took:.2f}s (bound {bound:.1f}s)")
    assert took <= bound + 0.5
    assert record.get("runs") is None
