"""The store's hot path written out (issue 24): the rare replies still go the long way.

A free key's acquire is one ``SET NX PX GET`` through ``Endpoint.round_trip``
and a plain release one ``_ReleaseExchange``; these tests give them the
replies they hand on: their own value found after a lost reply, a server
whose scripts were flushed, a waiter behind the holder. Real servers, faults
from a real TCP proxy.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis
import redis.asyncio

from celery_redislock import RedisLock
from celery_redislock.store import LockStore, ReleaseOutcome
from tests.conftest import LOCK_DB
from tests.servers import FaultProxy, RedisServer, wait_until

KEY = "redislock:t:{hot}"
MINE = "v1|mine|0|here|1|n1|job|0"
HOLDER = "v1|holder|0|elsewhere|1|n2|job|0"


def test_a_free_keys_acquire_whose_reply_was_lost_is_granted_by_its_retry(
    proxy: FaultProxy, lock_client: redis.Redis
) -> None:
    """The ``SET`` ran, its reply was lost, the retry found our own value: taken over, granted."""
    store = LockStore(f"{proxy.url}/{LOCK_DB}", {"socket_timeout": 0.3})
    try:
        # Both kinds of connection made (a handshake's reply is not the one to lose).
        assert store.acquire(KEY + "warm", MINE, 30_000).acquired
        assert store.release(KEY + "warm", MINE) is ReleaseOutcome.RELEASED
        proxy.lose_replies = 1
        result = store.acquire(KEY, MINE, 30_000)
        assert result.acquired
        assert lock_client.get(KEY) == MINE.encode()
        assert lock_client.pttl(KEY) > 25_000
        assert store.release(KEY, MINE) is ReleaseOutcome.RELEASED
    finally:
        store.close()


def test_a_free_keys_acquire_finds_the_holder_in_its_one_round_trip(
    lock_client: redis.Redis, server: RedisServer
) -> None:
    store = LockStore(server.url_for(LOCK_DB))
    lock_client.set(KEY, HOLDER, px=30_000)
    result = store.acquire(KEY, MINE, 30_000)
    assert not result.acquired
    assert result.holder == HOLDER
    assert result.holder_task_id == "holder"
    assert lock_client.get(KEY) == HOLDER.encode()
    store.close()


def test_a_plain_release_after_a_script_flush_and_behind_a_waiter(
    lock_client: redis.Redis, server: RedisServer
) -> None:
    """``NOSCRIPT`` is answered with the script's source; a waited-for release publishes."""
    store = LockStore(server.url_for(LOCK_DB))
    lock = RedisLock(lock_client, KEY, ttl=30, store=store)
    assert lock.acquire()
    lock_client.script_flush()
    assert lock.release() is ReleaseOutcome.RELEASED
    assert lock_client.get(KEY) is None

    assert lock.acquire()
    waiter = RedisLock(lock_client, KEY, ttl=30, store=LockStore(server.url_for(LOCK_DB)))
    outcome: list[bool] = []
    thread = threading.Thread(target=lambda: outcome.append(waiter.acquire(timeout=20)))
    thread.start()
    # The waiter marks the holder waited for: its release must publish (the
    # full script after the lean one's 2), or the waiter sleeps out the TTL.
    wait_until(lambda: lock_client.get(KEY).endswith(b"|w"), timeout=5)
    released_at = time.monotonic()
    assert lock.release() is ReleaseOutcome.RELEASED
    thread.join(20)
    assert outcome == [True]
    assert time.monotonic() - released_at < 5
    assert waiter.release() is ReleaseOutcome.RELEASED
    store.close()


def test_a_do_acquire_set_after_its_class_was_made_still_sees_every_acquire(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    """Set on the class later (a patch, instrumentation) or on one store (helper-49 F1)."""

    class Store(LockStore):
        pass

    seen: list[str] = []
    original = LockStore.do_acquire

    def counting(self: LockStore, key: str, *args: object, **kwargs: object) -> object:
        seen.append(key)
        return original(self, key, *args, **kwargs)  # type: ignore[arg-type]

    Store.do_acquire = counting  # type: ignore[method-assign]
    store = Store(server.url_for(LOCK_DB))
    assert store.acquire(KEY, MINE, 30_000).acquired
    assert seen == [KEY]
    assert store.release(KEY, MINE) is ReleaseOutcome.RELEASED

    plain = LockStore(server.url_for(LOCK_DB))
    plain.do_acquire = lambda key, *args, **kwargs: (  # type: ignore[method-assign]
        seen.append(key) or original(plain, key, *args, **kwargs)  # type: ignore[arg-type]
    )
    assert plain.acquire(KEY, MINE, 30_000).acquired
    assert seen == [KEY, KEY]
    assert plain.release(KEY, MINE) is ReleaseOutcome.RELEASED
    store.close()
    plain.close()


@pytest.mark.parametrize(
    ("value", "ttl_ms"), [(b"v1|bytes", 1000), (5, 1000), ("v1|a", "1000"), ("v1|a", True)]
)
def test_a_value_or_ttl_redis_would_take_but_the_lock_cannot_is_refused_before_sending(
    server: RedisServer, lock_client: redis.Redis, value: object, ttl_ms: object
) -> None:
    """Review helper-49 F2: a bytes or int value and a str TTL were sent and stored."""
    store = LockStore(server.url_for(LOCK_DB))
    with pytest.raises(TypeError, match=r"as a lock (value|TTL): it must be"):
        store.acquire(KEY, value, ttl_ms)  # type: ignore[arg-type]
    assert not lock_client.exists(KEY)
    lock_client.set(KEY, b"v1|bytes")
    with pytest.raises(TypeError, match="as a lock value: it must be a str"):
        store.release(KEY, b"v1|bytes")  # type: ignore[arg-type]
    assert lock_client.exists(KEY)
    store.close()


def test_the_asyncio_store_refuses_them_too(server: RedisServer, lock_client: redis.Redis) -> None:
    import asyncio

    from celery_redislock.aiostore import AsyncLockStore

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(server.url_for(LOCK_DB))
        store = AsyncLockStore.for_client(client)
        with pytest.raises(TypeError, match="as a lock value: it must be a str"):
            await store.acquire(KEY, b"v1|bytes", 1000)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="as a lock TTL: it must be an int"):
            await store.acquire(KEY, MINE, "1000")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="as a lock value: it must be a str"):
            await store.release(KEY, 5)  # type: ignore[arg-type]
        await client.aclose()

    asyncio.run(main())
    assert not lock_client.exists(KEY)
