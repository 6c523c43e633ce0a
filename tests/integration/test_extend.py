"""``extend()`` of the standalone locks: a new TTL, a reply that never comes, a forked child.

Review helper-54: an extend to a shorter TTL whose reply was lost left
``owned`` True for the old TTL after the key expired (F1); a forked child's
extend shortened its parent's lock (F2).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock import AsyncRedisLock, LockBackendError, LockNotOwned, RedisLock
from tests.conftest import LOCK_DB
from tests.servers import FaultProxy, RedisServer, wait_until


def _run(body: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(body())


def _sync_through(proxy: FaultProxy) -> redis.Redis:
    """A client whose commands give up after 0.2 s, with no retry."""
    return redis.Redis(
        port=proxy.port,
        db=LOCK_DB,
        socket_timeout=0.2,
        socket_connect_timeout=1,
        retry=Retry(NoBackoff(), 0),
    )


def test_a_shorter_ttl_is_renewed_at_its_own_pace(lock_client: redis.Redis) -> None:
    """The renewer was asleep until the old TTL's renewal: the key expired first."""
    with RedisLock(lock_client, "shorter", ttl=30) as lock:
        lock.extend(1.2)
        renewals = lock.handle.renewals
        wait_until(lambda: lock.handle.renewals >= renewals + 3, timeout=5, message="renewals")
        assert lock.owned and 0 < lock_client.pttl("shorter") <= 1200


def test_an_async_shorter_ttl_is_renewed_at_its_own_pace(server: RedisServer) -> None:
    async def body() -> None:
        client = redis.asyncio.Redis(port=server.port, db=LOCK_DB)
        try:
            async with AsyncRedisLock(client, "shorter", ttl=30) as lock:
                await lock.extend(1.2)
                renewals = lock.handle.renewals
                for _ in range(500):
                    if lock.handle.renewals >= renewals + 3:
                        break
                    await asyncio.sleep(0.01)
                assert lock.handle.renewals >= renewals + 3
                assert lock.owned and 0 < await client.pttl("shorter") <= 1200
        finally:
            await client.aclose()

    _run(body)


def test_an_extend_to_a_shorter_ttl_whose_reply_is_lost_shortens_the_lease(
    proxy: FaultProxy, lock_client: redis.Redis
) -> None:
    """It may have run: ``owned`` follows the earlier of the two deadlines until a reply."""
    client = _sync_through(proxy)
    lock = RedisLock(client, "cut", ttl=30, renew=False)
    assert lock.acquire()
    lock.extend()  # the script is cached: the late extend runs at the server
    proxy.latency = 0.3
    with pytest.raises(LockBackendError):
        lock.extend(1)
    wait_until(lambda: lock_client.pttl("cut") == -2, timeout=5, message="the key's expiry")
    assert not lock.owned
    proxy.latency = 0.0
    client.close()


def test_an_async_extend_cancelled_before_its_reply_shortens_the_lease(
    proxy: FaultProxy, lock_client: redis.Redis
) -> None:
    async def body() -> None:
        client = redis.asyncio.Redis(port=proxy.port, db=LOCK_DB)
        try:
            lock = AsyncRedisLock(client, "cut", ttl=30, renew=False)
            assert await lock.acquire()
            await lock.extend()
            proxy.latency = 0.1
            extend = asyncio.create_task(lock.extend(1))
            await asyncio.sleep(0.05)
            extend.cancel()
            with pytest.raises(asyncio.CancelledError):
                await extend
            for _ in range(500):
                if lock_client.pttl("cut") == -2:
                    break
                await asyncio.sleep(0.01)
            assert lock_client.pttl("cut") == -2
            assert not lock.owned
            proxy.latency = 0.0
        finally:
            await client.aclose()

    _run(body)


def _in_child(check: Callable[[], None]) -> None:
    """Run ``check`` in a forked child; fail here if it raised."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            check()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the child's check failed"


def test_a_forked_child_cannot_extend_its_parents_lock(lock_client: redis.Redis) -> None:
    with RedisLock(lock_client, "forked", ttl=30) as lock:

        def child() -> None:
            with pytest.raises(LockNotOwned, match="pid"):
                lock.extend(0.05)

        _in_child(child)
        assert lock_client.pttl("forked") > 20_000
        assert lock.owned


def test_a_forked_child_cannot_extend_its_parents_async_lock(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    async def body() -> None:
        client = redis.asyncio.Redis(port=server.port, db=LOCK_DB)
        try:
            async with AsyncRedisLock(client, "forked", ttl=30) as lock:

                def child() -> None:
                    with pytest.raises(LockNotOwned, match="pid"):
                        asyncio.run(lock.extend(0.05))

                _in_child(child)
                assert lock_client.pttl("forked") > 20_000
                assert lock.owned
        finally:
            await client.aclose()

    _run(body)


def _lease_left(handle: Any) -> float:
    from celery_redislock._clock import clock

    return float(handle.valid_until - clock())


def test_a_renewal_an_extend_overtook_never_lengthens_the_lease(
    proxy: FaultProxy, lock_client: redis.Redis
) -> None:
    """Review helper-55 F1: the renewal's reply was read with the extend's TTL.

    The renewal (old TTL, 1 s) is late on the wire; ``extend(30)`` reaches
    Redis first; the renewal then sets 1 s. ``owned`` claimed 29 s more and
    another client took the key while it said True. The lease may claim no
    more than the key has, and the next renewal restores the new TTL.
    """
    client = redis.Redis(port=proxy.port, db=LOCK_DB)
    with RedisLock(client, "overtaken", ttl=1.0) as lock:
        proxy.slow_chunk, proxy.slow_chunk_delay = b"\r\n1000\r\n", 0.3
        assert proxy.slowed.wait(5)  # the renewal carrying 1000 ms is on its way, late
        renewals = lock.handle.renewals
        lock.extend(30)
        wait_until(lambda: lock.handle.renewals > renewals, timeout=5, message="its reply")
        assert _lease_left(lock.handle) <= lock_client.pttl("overtaken") / 1000 + 0.05
        wait_until(lambda: lock_client.pttl("overtaken") > 20_000, timeout=5, message="30 s again")
        assert lock.owned
    client.close()


def test_an_async_renewal_an_extend_overtook_never_lengthens_the_lease(
    proxy: FaultProxy, lock_client: redis.Redis
) -> None:
    async def body() -> None:
        client = redis.asyncio.Redis(port=proxy.port, db=LOCK_DB)
        try:
            async with AsyncRedisLock(client, "overtaken", ttl=1.0) as lock:
                proxy.slow_chunk, proxy.slow_chunk_delay = b"\r\n1000\r\n", 0.3
                for _ in range(500):
                    if proxy.slowed.is_set():
                        break
                    await asyncio.sleep(0.01)
                assert proxy.slowed.is_set()
                renewals = lock.handle.renewals
                await lock.extend(30)
                for _ in range(500):
                    if lock.handle.renewals > renewals:
                        break
                    await asyncio.sleep(0.01)
                assert lock.handle.renewals > renewals
                assert _lease_left(lock.handle) <= lock_client.pttl("overtaken") / 1000 + 0.05
                for _ in range(500):
                    if lock_client.pttl("overtaken") > 20_000:
                        break
                    await asyncio.sleep(0.01)
                assert lock_client.pttl("overtaken") > 20_000 and lock.owned
        finally:
            await client.aclose()

    _run(body)


def test_a_released_lock_registered_again_is_dropped_not_renewed_for_ever(
    lock_client: redis.Redis,
) -> None:
    """Review helper-55 F2: an extend racing the release re-registered the handle.

    Each renewal found the key gone and left ``renew_at`` in the past: the
    renewer sent renewals in a tight loop for the life of the process. The
    outcome of that race, made directly: the renewer drops such a handle.
    """
    from celery_redislock.renewer import renewer

    lock = RedisLock(lock_client, "raced", ttl=0.6)
    assert lock.acquire()
    handle = lock.handle
    lock.release()
    trips = renewer().round_trips
    renewer().register(handle)
    wait_until(lambda: id(handle) not in renewer()._handles, timeout=5, message="dropped")
    assert renewer().round_trips - trips <= 2
