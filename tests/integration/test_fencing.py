"""Fencing tokens: strictly increasing per key, across restarts; fenced writes."""

from __future__ import annotations

import itertools

import pytest
import redis

from celery_redislock import RedisLock
from celery_redislock.fencing import FencedStore, StaleFence
from celery_redislock.keys import fence_key
from celery_redislock.store import LockStore
from tests.conftest import LOCK_DB
from tests.servers import RedisServer


def test_fences_strictly_increase_per_key(lock_client: redis.Redis) -> None:
    fences = []
    for _ in range(200):
        with RedisLock(lock_client, "fenced", ttl=5) as lock:
            fences.append(lock.fence)
    assert all(isinstance(f, int) for f in fences)
    assert all(b > a for a, b in itertools.pairwise(fences))


def test_a_holder_keeps_its_fence_and_later_holders_get_larger_ones(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    """Fences are issued on demand (issue 24): one per acquisition that reads one."""
    with RedisLock(lock_client, "k", ttl=5) as lock:
        first = lock.fence
        assert lock.fence == first  # read again: the same acquisition's
    backend = LockStore(server.url_for(LOCK_DB))
    assert backend.acquire("k", "mine", 5000).acquired
    assert backend.acquire("k", "mine", 5000).acquired  # a client retry after a lost reply
    assert backend.acquire("k", "running", 5000, adopt=("mine",)).acquired
    assert backend.fence("k", "mine") is None  # taken over: no fence for the old value
    adopted = backend.fence("k", "running")
    assert adopted is not None and adopted > first
    backend.release("k", "running", fenced=True)
    assert backend.acquire("k", "next", 5000).acquired
    assert (backend.fence("k", "next") or 0) > adopted


def test_fences_keep_increasing_after_redis_restarts_empty(redis_server_factory) -> None:  # type: ignore[no-untyped-def]
    server: RedisServer = redis_server_factory()
    backend = LockStore(server.url)
    assert backend.acquire("k", "a", 60000).acquired
    before = backend.fence("k", "a")
    server.restart()  # the counter is gone with everything else
    assert backend.acquire("k", "b", 60000).acquired
    after = backend.fence("k", "b")
    assert before is not None and after is not None and after > before


def test_the_fence_counter_expires(server: RedisServer, lock_client: redis.Redis) -> None:
    backend = LockStore(server.url_for(LOCK_DB), fence_ttl=2)
    backend.acquire("k", "v", 1000)
    backend.fence("k", "v")
    # The lock's TTL, then fence_ttl after it: no key left behind for ever.
    assert 2000 < lock_client.pttl(fence_key("k")) <= 3000
    backend.acquire("long", "v", 10_000)
    backend.fence("long", "v")
    assert lock_client.pttl(fence_key("long")) > 9000  # never shorter than the lock


def test_fenced_store_refuses_a_stale_writer(server: RedisServer) -> None:
    store = FencedStore(server.client(5))
    assert store.write("balance", "100", fence=10)
    assert store.write("balance", "90", fence=12)
    assert not store.write("balance", "stale", fence=11)
    assert store.read("balance") == (b"90", 12)
    with pytest.raises(StaleFence, match="fence 11 refused: fence 12"):
        store.write_or_raise("balance", "stale", fence=11)
    assert store.write("balance", "80", fence=12)  # the same holder may write again
    with pytest.raises(TypeError, match="fence must be an int"):
        store.write("balance", "x", fence=None)  # type: ignore[arg-type]


def test_fenced_store_survives_script_flush(server: RedisServer) -> None:
    client = server.client(5)
    store = FencedStore(client)
    assert store.write("k", "1", fence=1)
    client.script_flush()
    assert store.write("k", "2", fence=2)
