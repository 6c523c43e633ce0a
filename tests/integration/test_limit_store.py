"""``lock_limit`` slots at the script level, against a real redis-server."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from celery_redislock import LockBackendError, ReleaseOutcome
from celery_redislock.keys import fence_key, release_channel, slot_key, slot_keys, split_slot
from celery_redislock.store import LockStore
from celery_redislock.takeback import take_back_value
from celery_redislock.tokens import LockOwner, LockValue
from tests.conftest import LOCK_DB
from tests.servers import RedisServer

KEY = "redislock:proj.export:{tenant-7}"


@pytest.fixture(params=[False, True], ids=["bytes", "decoded"])
def store(request: pytest.FixtureRequest, server: RedisServer) -> LockStore:
    return LockStore(server.url_for(LOCK_DB), {"decode_responses": request.param})


def value(task_id: str, pid: int = 1, attempt: int = 0) -> str:
    return LockValue.new(LockOwner(task_id, attempt, "w1@host", pid), "proj.export").encode()


def test_slot_keys_share_the_hash_tag_and_the_fence_counter() -> None:
    assert slot_key(KEY, 1) == KEY  # slot 1 is today's key, unchanged
    assert slot_keys(KEY, 3) == [KEY, f"{KEY}:slot:2", f"{KEY}:slot:3"]
    for key in slot_keys(KEY, 3):
        assert key.count("{tenant-7}") == 1 and key.index("{") == KEY.index("{")
        assert fence_key(key) == fence_key(KEY) == f"{KEY}:fence"
        assert release_channel(key) == f"{KEY}:released"
    assert split_slot(f"{KEY}:slot:3") == (KEY, 3)
    assert split_slot(KEY) == (KEY, 1)
    # A custom key ending in the suffix text is still a base key: it ends with "}".
    odd = "redislock:{x}:slot:2}"
    assert split_slot(odd) == (odd, 1)
    with pytest.raises(ValueError, match="hash tag"):
        slot_key("plain-name", 2)


def test_n_slots_then_the_next_is_refused_with_the_holder_that_frees_first(
    store: LockStore, lock_client: redis.Redis
) -> None:
    ttls = [30000, 5000, 20000]
    taken = []
    for index, ttl in enumerate(ttls):
        result = store.acquire_slot(KEY, 3, value(f"t{index}"), ttl)
        assert result.acquired
        taken.append(result.key)
    assert taken == slot_keys(KEY, 3)
    refused = store.acquire_slot(KEY, 3, value("t3"), 30000)
    assert not refused.acquired
    assert refused.holder_task_id == "t1"  # the 5 s slot
    assert refused.ttl_remaining is not None and 4.0 < refused.ttl_remaining <= 5.0
    assert lock_client.exists(f"{KEY}:slot:4") == 0
    # The freed slot is the one taken next.
    assert store.release(f"{KEY}:slot:2", lock_client.get(f"{KEY}:slot:2").decode()) is (
        ReleaseOutcome.RELEASED
    )
    again = store.acquire_slot(KEY, 3, value("t4"), 30000)
    assert again.acquired and again.key == f"{KEY}:slot:2"


def test_a_retried_acquire_finds_its_own_slot(store: LockStore, lock_client: redis.Redis) -> None:
    """A lost reply retried: the value is found in whichever slot it landed, never a second."""
    store.acquire_slot(KEY, 3, value("other"), 30000)
    mine = value("mine")
    first = store.acquire_slot(KEY, 3, mine, 1000)
    lock_client.delete(KEY)  # slot 1 frees meanwhile
    retried = store.acquire_slot(KEY, 3, mine, 60000)
    assert retried.acquired and retried.key == first.key == f"{KEY}:slot:2"
    assert retried.fence == first.fence  # still the same acquisition
    assert lock_client.pttl(f"{KEY}:slot:2") > 50000
    assert lock_client.exists(KEY) == 0


def test_an_adopted_value_in_any_slot_is_taken_over_and_never_doubled(
    store: LockStore, lock_client: redis.Redis
) -> None:
    lost_1, lost_2 = value("me", pid=1), value("me", pid=2)
    lock_client.set(f"{KEY}:slot:2", lost_1, px=30000)
    lock_client.set(f"{KEY}:slot:3", lost_2, px=30000)
    mine = value("me", pid=3)
    result = store.acquire_slot(KEY, 3, mine, 30000, adopt=[lost_1, lost_2])
    assert result.acquired and result.key == f"{KEY}:slot:2"
    assert lock_client.get(f"{KEY}:slot:2").decode() == mine
    assert lock_client.exists(f"{KEY}:slot:3") == 0  # the other copy is dropped


def test_a_slot_held_by_the_same_task_is_contention(
    store: LockStore, lock_client: redis.Redis
) -> None:
    """One message never runs twice at once, even with free slots."""
    earlier = value("same-task", pid=1)
    assert store.acquire_slot(KEY, 3, earlier, 30000).acquired
    prefix = LockOwner.task_prefix("same-task")
    refused = store.acquire_slot(KEY, 3, value("same-task", pid=2), 30000, task_prefix=prefix)
    assert not refused.acquired and refused.holder == earlier
    other = store.acquire_slot(KEY, 3, value("other"), 30000, task_prefix="v1|other|")
    assert other.acquired and other.key == f"{KEY}:slot:2"


def test_fences_increase_across_slots(store: LockStore, lock_client: redis.Redis) -> None:
    fences = []
    for index in range(6):
        taken = value(f"f{index}")
        result = store.acquire_slot(KEY, 3, taken, 30000)
        assert result.acquired
        fences.append(store.fence(result.key or KEY, taken))
        if index >= 2:
            # Free the slot just taken: the next acquire reuses it.
            store.release(result.key or KEY, lock_client.get(result.key or KEY).decode())
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    assert lock_client.exists(KEY, f"{KEY}:slot:2", f"{KEY}:slot:3") == 2
    assert lock_client.exists(f"{KEY}:slot:2:fence") == 0  # one counter for the key


def test_releases_by_owner_and_by_value_find_the_slot(
    store: LockStore, lock_client: redis.Redis
) -> None:
    store.acquire_slot(KEY, 3, value("a", pid=10), 30000)
    store.acquire_slot(KEY, 3, value("b", pid=11, attempt=2), 30000)
    stale = LockOwner("b", 1, "w1@host", 11).prefix()  # an earlier attempt
    assert store.release_slot_of(KEY, 3, stale, "prefix") is ReleaseOutcome.ALREADY_GONE
    assert lock_client.exists(f"{KEY}:slot:2") == 1
    owner = LockOwner("b", 2, "w1@host", 11).prefix()
    assert store.release_slot_of(KEY, 3, owner, "prefix") is ReleaseOutcome.RELEASED
    assert lock_client.exists(f"{KEY}:slot:2") == 0 and lock_client.exists(KEY) == 1
    store.acquire_slot(KEY, 2, value("c"), 30000)
    assert store.release_slot_of(KEY, 2, "v1|nobody|0|x|1|", "prefix") is ReleaseOutcome.NOT_OURS
    exact = lock_client.get(f"{KEY}:slot:2").decode()
    assert store.release_slot_of(KEY, 2, exact) is ReleaseOutcome.RELEASED


def test_a_waiter_wakes_when_any_slot_is_released(
    store: LockStore, lock_client: redis.Redis
) -> None:
    holders = [value("h1"), value("h2")]
    for holder in holders:
        assert store.acquire_slot(KEY, 2, holder, 30000).acquired
    releaser = threading.Timer(0.3, store.release, (f"{KEY}:slot:2", holders[1]))
    releaser.start()
    started = time.monotonic()
    try:
        result = store.acquire_waiting(KEY, value("waiter"), 30000, 20.0, limit=2)
    finally:
        releaser.join()
    assert result.acquired and result.key == f"{KEY}:slot:2"
    assert time.monotonic() - started < 10.0  # woken by the release, not the 30 s TTL
    assert lock_client.pttl(f"{KEY}:slot:2") > 25000


def test_wait_released_watches_every_slot(store: LockStore, lock_client: redis.Redis) -> None:
    store.acquire_slot(KEY, 2, value("a", pid=1), 30000)
    child = value("b", pid=2)
    store.acquire_slot(KEY, 2, child, 30000)
    prefix = LockOwner("b", 0, "w1@host", 2).prefix()
    assert not store.wait_released(KEY, prefix, 0.2, limit=2)
    threading.Timer(0.2, store.release, (f"{KEY}:slot:2", child)).start()
    assert store.wait_released(KEY, prefix, 10.0, limit=2)


def test_too_few_replicas_releases_the_slot_again(
    store: LockStore, lock_client: redis.Redis
) -> None:
    store.acquire_slot(KEY, 2, value("first"), 30000)
    with pytest.raises(LockBackendError, match="replica"):
        store.acquire_slot(KEY, 2, value("second"), 30000, min_replicas=1, replicas_timeout=0.05)
    assert lock_client.exists(f"{KEY}:slot:2") == 0 and lock_client.exists(KEY) == 1


def test_an_unanswered_acquire_is_taken_back_from_whichever_slot(
    store: LockStore, lock_client: redis.Redis
) -> None:
    store.acquire_slot(KEY, 3, value("first"), 30000)
    late = value("late")
    assert store.acquire_slot(KEY, 3, late, 30000).key == f"{KEY}:slot:2"
    take_back_value(store, KEY, late, limit=3)
    assert lock_client.exists(f"{KEY}:slot:2") == 0 and lock_client.exists(KEY) == 1
