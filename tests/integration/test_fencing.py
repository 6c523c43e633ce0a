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


def test_retry_of_the_same_acquire_and_adoption_keep_the_fence(server: RedisServer) -> None:
    backend = LockStore(server.url_for(LOCK_DB))
    first = backend.acquire("k", "mine", 5000)
    again = backend.acquire("k", "mine", 5000)  # a client retry after a lost reply
    adopted = backend.acquire("k", "running", 5000, adopt=("mine",))
    assert first.fence == again.fence == adopted.fence
    backend.release("k", "running")
    assert (backend.acquire("k", "next", 5000).fence or 0) > (first.fence or 0)


def test_fences_keep_increasing_after_redis_restarts_empty(redis_server_factory) -> None:  # type: ignore[no-untyped-def]
    server: RedisServer = redis_server_factory()
    backend = LockStore(server.url)
    before = backend.acquire("k", "a", 60000).fence
    server.restart()  # the counter is gone with everything else
    after = backend.acquire("k", "b", 60000).fence
    assert before is not None and after is not None and after > before


def test_the_fence_counter_expires(server: RedisServer, lock_client: redis.Redis) -> None:
    backend = LockStore(server.url_for(LOCK_DB), fence_ttl=2)
    backend.acquire("k", "v", 1000)
    # The lock's TTL, then fence_ttl after it: no key left behind for ever.
    assert 2000 < lock_client.pttl(fence_key("k")) <= 3000
    backend.acquire("long", "v", 10_000)
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
