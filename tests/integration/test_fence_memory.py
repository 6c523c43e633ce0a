"""Issue 13: what a released key leaves in the lock store, and fencing kept intact.

A fence is issued on demand (issue 24: a holder that never reads one costs
nothing for it). A key's fence counter then lives with the lock (its TTL
at least, renewed with it) and goes with the release, unless it is still
ahead of the server clock: then it stays until the clock has passed it.
Every fence is therefore either above a counter still present or derived
from a clock that has passed every earlier fence.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import redis
import redis.asyncio

from celery_redislock import AsyncRedisLock, RedisLock
from celery_redislock.aiostore import AsyncLockStore
from celery_redislock.keys import fence_key, handoff_keys, slot_keys
from celery_redislock.scripts import FENCE_SCRIPT, RELEASE_FULL_SCRIPT
from celery_redislock.store import LockStore, ReleaseOutcome, release_call
from tests.conftest import LOCK_DB
from tests.helpers import held
from tests.servers import RedisServer, wait_until

#: Distinct keys per run: the issue's target is at most N/100 resident keys.
N = 2000


def server_micros(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


@pytest.fixture
def store(server: RedisServer) -> LockStore:
    return LockStore(server.url_for(LOCK_DB))


def fenced(store: LockStore, key: str, value: str, ttl_ms: int) -> int:
    """Take ``key`` and read a fence, as a holder reading ``self.lock.fence`` does."""
    assert store.acquire(key, value, ttl_ms).acquired
    fence = store.fence(key, value)
    assert fence is not None
    return fence


# -- memory: N distinct keys leave at most N/100 keys ------------------------


def test_distinct_keys_leave_no_fence_counters_behind(
    store: LockStore, lock_client: redis.Redis
) -> None:
    for i in range(N):
        result = store.acquire(f"webhook:{i}", "v", 30_000)
        assert result.acquired
        assert store.release(f"webhook:{i}", "v") is ReleaseOutcome.RELEASED
    assert lock_client.dbsize() <= N // 100


def test_every_way_a_hold_ends_takes_its_counter_along(
    store: LockStore, lock_client: redis.Redis
) -> None:
    owner = "v1|task|1|celery@here|42|"
    for i in range(N // 4):
        # exact release, release by owner prefix (a worker's parent for a
        # dead child), a slot of lock_limit=3, and a granted PARK (hand-off)
        store.acquire(f"a:{i}", "v", 30_000)
        store.release(f"a:{i}", "v")
        store.acquire(f"b:{i}", f"{owner}x", 30_000)
        store.release_owner(f"b:{i}", owner)
        slot_key = f"c:{{{i}}}"
        taken = store.acquire_slot(slot_key, 3, "v", 30_000)
        assert taken.acquired and taken.key is not None
        store.release(taken.key, "v")
        taken = store.acquire_slot(slot_key, 3, "w", 30_000)
        assert taken.acquired
        assert store.release_slot_of(slot_key, 3, "w") is ReleaseOutcome.RELEASED
        park_key = f"d:{{{i}}}"
        parked = store.park(park_key, "v", 30_000, "handoff", "o", b"message", 60_000)
        assert parked.result.acquired
        store.release(park_key, "v")
    assert lock_client.dbsize() <= N // 100


def test_redis_lock_and_async_lock_leave_nothing(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    for i in range(N // 2):
        with RedisLock(lock_client, f"sync:{i}", ttl=30):
            pass

    async def run() -> None:
        client = redis.asyncio.Redis.from_url(server.url_for(LOCK_DB))
        try:
            for i in range(N // 2):
                async with AsyncRedisLock(client, f"async:{i}", ttl=30):
                    pass
        finally:
            await AsyncLockStore.for_client(client).aclose()
            await client.aclose()

    asyncio.run(run())
    assert lock_client.dbsize() <= N // 100


def test_a_positive_fence_ttl_keeps_the_counter_after_release(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    store = LockStore(server.url_for(LOCK_DB), fence_ttl=60)
    fenced(store, "k", "v", 1000)
    store.release("k", "v", fenced=True)
    # At least the fence TTL after the release (never less than the hold it had left).
    assert 55_000 < lock_client.pttl(fence_key("k")) <= 61_000


# -- the counter lives as long as the key holds anything ----------------------


def test_the_counter_lives_and_is_renewed_with_the_lock(
    store: LockStore, lock_client: redis.Redis
) -> None:
    fence = fenced(store, "k", "v", 2_000)
    assert 0 < lock_client.pttl(fence_key("k")) <= 2_000  # expires with the lock
    store.renew_many([("k", "v", 60_000, True)])
    assert lock_client.pttl(fence_key("k")) > 55_000  # renewed with it
    store.renew_many([("k", "v", 90_000, True)])  # the renewer's batch
    assert lock_client.pttl(fence_key("k")) > 85_000
    assert int(lock_client.get(fence_key("k")) or 0) == fence  # what `ls` shows


def test_a_kept_value_and_a_hand_off_keep_the_counter(
    store: LockStore, lock_client: redis.Redis
) -> None:
    # lock_hold_after_success: the kept value holds the key, and so does the counter
    fenced(store, "kept", "v", 1_000)
    store.release("kept", "v", keep="kept-value", keep_ms=60_000, fenced=True)
    assert lock_client.pttl(fence_key("kept")) > 55_000
    # a release that hands the key to a parked execution: held again
    key = "handed:{x}"
    store.handoff_ttl_ms = 60_000
    fenced(store, key, "holder", 1_000)
    assert store.park(key, "w", 1_000, "handoff", "o", b"message", 60_000).parked
    store.release(key, "holder", fenced=True)
    assert held(lock_client, key) == b"handoff"
    assert lock_client.pttl(fence_key(key)) > 55_000
    # the parked execution withdraws (UNPARK): the key is free, no counter left
    store.withdraw(key, "handoff", 60_000)
    assert lock_client.get(key) is None
    assert not lock_client.exists(fence_key(key))
    for companion in handoff_keys(key):
        lock_client.delete(companion)


def test_a_slot_release_leaves_the_counter_while_another_slot_is_held(
    store: LockStore, lock_client: redis.Redis
) -> None:
    key = "limited:{k}"
    first = store.acquire_slot(key, 2, "a", 30_000)
    second = store.acquire_slot(key, 2, "b", 30_000)
    assert first.key and second.key and first.key != second.key
    store.fence(first.key, "a")
    second_fence = store.fence(second.key, "b")
    assert store.release_slot_of(key, 2, "a") is ReleaseOutcome.RELEASED
    assert lock_client.get(fence_key(key)) == str(second_fence).encode()
    assert store.release_slot_of(key, 2, "b") is ReleaseOutcome.RELEASED
    assert not lock_client.exists(fence_key(key), *slot_keys(key, 2))


# -- the fencing guarantee, unchanged ----------------------------------------


def test_fence_increases_across_release_and_acquire(
    store: LockStore, lock_client: redis.Redis
) -> None:
    fences = []
    for n in range(50):
        fences.append(fenced(store, "k", f"v{n}", 30_000))
        store.release("k", f"v{n}", fenced=True)
        assert not lock_client.exists(fence_key("k"))  # the counter went with the lock
    assert all(isinstance(f, int) for f in fences)
    assert all(b > a for a, b in itertools.pairwise(fences))  # type: ignore[operator]


def test_fence_increases_for_back_to_back_cycles_in_one_pipeline(
    lock_client: redis.Redis,
) -> None:
    # Pipelined scripts run back to back, microseconds apart (on a 2-core VM
    # about 20-40 µs per pair, so the same microsecond is rare here): an
    # acquisition in the same microsecond as the last fence gets last + 1,
    # and the counter it leaves is ahead of the clock, so the release keeps
    # it. That state is set up deterministically by the tests below.
    pipe = lock_client.pipeline(transaction=False)
    for n in range(300):
        value = f"v{n}"
        pipe.set("k", value, nx=True, px=30_000)
        pipe.eval(FENCE_SCRIPT, 2, "k", fence_key("k"), value, 0)
        keys, args = release_call("k", value, "exact", "", 0, 1000)
        pipe.eval(RELEASE_FULL_SCRIPT, len(keys), *keys, *args)
    replies = pipe.execute()
    assert all(replies[0::3])
    fences = [int(reply[1]) for reply in replies[1::3]]
    assert all(reply == 1 for reply in replies[2::3])
    assert all(b > a for a, b in itertools.pairwise(fences))


def test_a_counter_ahead_of_the_clock_is_kept_until_the_clock_passes_it(
    store: LockStore, lock_client: redis.Redis
) -> None:
    first = fenced(store, "k", "a", 30_000)
    ahead = server_micros(lock_client) + 10_000_000  # the clock stepped back 10 s
    lock_client.set(fence_key("k"), ahead, px=30_000)
    store.release("k", "a", fenced=True)
    assert 9_000 < lock_client.pttl(fence_key("k")) <= 10_100  # kept, only that long
    second = fenced(store, "k", "b", 30_000)
    assert second == ahead + 1 > first
    store.release("k", "b", fenced=True)
    third = fenced(store, "k", "c", 30_000)
    assert third == ahead + 2


def test_a_counter_ahead_of_the_clock_outlives_an_expired_lock(
    store: LockStore, lock_client: redis.Redis
) -> None:
    ahead = server_micros(lock_client) + 5_000_000
    lock_client.set(fence_key("k"), ahead, px=30_000)
    fence = fenced(store, "k", "a", 100)  # a holder that dies: its lock expires
    assert fence == ahead + 1
    wait_until(lambda: not lock_client.exists("k"), timeout=5, message="the lock to expire")
    assert lock_client.pttl(fence_key("k")) > 4_000  # kept until the clock passes it
    assert fenced(store, "k", "b", 30_000) > fence


def test_the_counter_does_not_outlive_the_clock_passing_it(
    store: LockStore, lock_client: redis.Redis
) -> None:
    lock_client.set(fence_key("k"), server_micros(lock_client) + 300_000, px=30_000)
    fence = fenced(store, "k", "a", 30_000)
    store.release("k", "a", fenced=True)
    assert lock_client.pttl(fence_key("k")) <= 400
    wait_until(lambda: not lock_client.exists(fence_key("k")), timeout=5, message="expiry")
    assert server_micros(lock_client) > fence
    assert fenced(store, "k", "b", 30_000) > fence


def test_a_positive_fence_ttl_never_shortens_the_counter_of_a_key_still_held(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    """A slot released while another slot of the key is held keeps the shared counter."""
    store = LockStore(server.url_for(LOCK_DB), fence_ttl=2)
    key = "limited:{ttl}"
    first = store.acquire_slot(key, 2, "a", 30_000)
    second = store.acquire_slot(key, 2, "b", 30_000)
    assert first.acquired and second.acquired
    store.fence(first.key or "", "a")
    store.fence(second.key or "", "b")
    assert store.release(second.key or "", "b", fenced=True) is ReleaseOutcome.RELEASED
    assert lock_client.pttl(fence_key(key)) > 25_000  # slot 1's hold, plus the fence TTL
    assert store.release(first.key or "", "a", fenced=True) is ReleaseOutcome.RELEASED
    assert lock_client.pttl(fence_key(key)) > 1_000  # and the fence TTL after the last release


def test_the_counter_never_expires_before_its_lock(
    store: LockStore, lock_client: redis.Redis
) -> None:
    """The counter is made from the lock's own PTTL: it never expires before the lock."""
    for i in range(3000):
        fenced(store, f"k{i}", "v", 30_000)
    pipe = lock_client.pipeline(transaction=False)
    for i in range(3000):
        pipe.pexpiretime(f"k{i}")
        pipe.pexpiretime(fence_key(f"k{i}"))
    times = pipe.execute()
    early = [i for i in range(3000) if times[2 * i + 1] < times[2 * i]]
    assert early == []
