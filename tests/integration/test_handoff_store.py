"""PARK and RELEASE scripts against a real redis-server: the hand-off queue, copies, ACLs."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from celery_redislock import LockBackendError
from celery_redislock.keys import debounce_key, handoff_keys, queued_key
from celery_redislock.store import LockStore, ReleaseOutcome
from tests.helpers import held
from tests.integration.test_acl import HANDOFF_RULES, LOCK_USER_RULES
from tests.servers import RedisServer

KEY = "redislock:t:{abc}"
TTL = 10_000
PARK_TTL = 60_000


@pytest.fixture
def store(lock_client: redis.Redis) -> LockStore:
    backend = LockStore(client=lock_client)
    handed: list[tuple[str, str, bytes]] = []
    backend.on_handoff = lambda key, waiter, message: handed.append((key, waiter, message))
    backend.handed = handed  # type: ignore[attr-defined]
    return backend


def park(store: LockStore, value: str, handoff: str, copy: str = "c", msg: bytes = b"m") -> Any:
    return store.park(KEY, value, TTL, handoff, copy, msg, PARK_TTL)


def test_release_hands_the_lock_to_parked_executions_in_arrival_order(
    store: LockStore, lock_client: redis.Redis
) -> None:
    assert store.acquire(KEY, "holder", TTL).acquired
    for n in range(3):
        parked = park(store, f"value-{n}", f"handoff-{n}", msg=f"message-{n}".encode())
        assert parked.parked and not parked.result.acquired
        assert parked.result.holder == "holder"
    # Parking again (a safety-net copy) never queues twice.
    assert park(store, "value-0b", "handoff-0", msg=b"message-0").parked
    assert lock_client.llen(handoff_keys(KEY)[0]) == 3

    assert store.release(KEY, "holder") is ReleaseOutcome.RELEASED
    assert held(lock_client, KEY) == b"handoff-0"  # held for the first parked execution
    assert store.handed == [(KEY, "handoff-0", b"message-0")]  # type: ignore[attr-defined]
    # A newcomer meets the handed-over lock: it cannot jump the queue.
    assert not store.acquire(KEY, "newcomer", TTL).acquired
    # The first parked execution takes it over (its hand-off value is its own).
    granted = park(store, "value-0", "handoff-0", copy="woken", msg=b"")
    assert granted.result.acquired
    assert store.release(KEY, "value-0") is ReleaseOutcome.RELEASED
    assert held(lock_client, KEY) == b"handoff-1"
    assert store.handed[-1][1] == "handoff-1"  # type: ignore[attr-defined]


def test_a_second_copy_is_refused_but_a_redelivery_of_the_granted_copy_is_not(
    store: LockStore,
) -> None:
    assert store.acquire(KEY, "holder", TTL).acquired
    assert park(store, "v", "handoff", copy="first").parked
    store.release(KEY, "holder")
    assert park(store, "v-woken", "handoff", copy="woken", msg=b"").result.acquired
    store.release(KEY, "v-woken")
    # The safety-net copy of the same parked execution arrives later: dropped.
    assert park(store, "v-net", "handoff", copy="net", msg=b"").already_ran
    # The granted copy redelivered (acks_late, its worker died): runs again.
    again = park(store, "v-again", "handoff", copy="woken", msg=b"")
    assert again.result.acquired and not again.already_ran


def test_entries_of_executions_that_already_ran_are_skipped_at_release(
    store: LockStore, lock_client: redis.Redis
) -> None:
    assert store.acquire(KEY, "holder", TTL).acquired
    assert park(store, "a", "handoff-a", msg=b"message-a").parked
    assert park(store, "b", "handoff-b", msg=b"message-b").parked
    lock_client.delete(KEY)  # the holder died; its TTL ran out
    # a's safety-net copy noticed first and ran.
    assert park(store, "a-net", "handoff-a", copy="net", msg=b"").result.acquired
    assert lock_client.lrange(handoff_keys(KEY)[0], 0, -1) == [b"handoff-b"]
    store.release(KEY, "a-net")
    assert held(lock_client, KEY) == b"handoff-b"
    store.release(KEY, "handoff-b")  # b's woken copy ran and released
    assert store.release(KEY, "x") is ReleaseOutcome.ALREADY_GONE
    # Nothing parked any more: a new holder's value is unmarked, its release
    # only reads and deletes the key.
    assert store.acquire(KEY, "y", TTL).acquired
    assert lock_client.get(KEY) == b"y"


def test_a_coalesced_run_frees_its_queued_key_only_when_granted(
    store: LockStore, lock_client: redis.Redis
) -> None:
    queued = queued_key(KEY)
    lock_client.set(queued, "queued-value", px=PARK_TTL)
    assert store.acquire(KEY, "running", TTL).acquired
    slot = (queued, "queued-value")
    parked = store.park(KEY, "v", TTL, "h", "c", b"m", PARK_TTL, slot)
    assert parked.parked
    assert lock_client.get(queued) == b"queued-value"  # later calls still join it
    store.release(KEY, "running")
    assert store.park(KEY, "v", TTL, "h", "w", b"", PARK_TTL, slot).result.acquired
    assert not lock_client.exists(queued)


def test_debounce_moves_the_due_time_up_to_the_cap(
    store: LockStore, lock_client: redis.Redis
) -> None:
    new, burst, due = store.debounce(KEY, "t1", 1000, 1500)
    assert (new, burst) == (True, "t1") and due == pytest.approx(1.0)
    new, burst, due = store.debounce(KEY, "t2", 1000, 1500)
    assert (new, burst) == (False, "t1") and 0.9 <= due <= 1.0
    assert 0.8 <= store.debounce_due(KEY, "t1") <= 1.0  # not yet: re-send
    lock_client.hset(debounce_key(KEY), "due", 0)  # its time has come
    assert store.debounce_due(KEY, "t1") == 0
    assert not lock_client.exists(debounce_key(KEY))  # a new call starts a new burst
    assert store.debounce_due(KEY, "t1") < 0  # a second delivery: run, never drop
    assert store.debounce(KEY, "t3", 1000, 1500)[0]


def test_plain_acl_rules_still_release_and_hand_off_needs_its_own(
    redis_server_factory: Any,
) -> None:
    handoff_rules = HANDOFF_RULES
    server: RedisServer = redis_server_factory(
        "--user", "plain", "on", ">pw", *LOCK_USER_RULES,
        "--user", "parker", "on", ">pw", *LOCK_USER_RULES, *handoff_rules,
    )  # fmt: skip
    plain = LockStore(url=f"redis://plain:pw@127.0.0.1:{server.port}/0")
    parker = LockStore(url=f"redis://parker:pw@127.0.0.1:{server.port}/0")
    try:
        # A user with the plain rules locks and releases as before.
        assert plain.acquire(KEY, "v", TTL).acquired
        assert plain.release(KEY, "v") is ReleaseOutcome.RELEASED
        # Parking needs the list and hash commands, and says which.
        assert plain.acquire(KEY, "holder", TTL).acquired
        # Redis 7 says "can't run this command", Valkey 9 "has no permissions to run".
        refused = r"(can.t run this command|no permissions to run).*list, hash and sorted-set"
        with pytest.raises(LockBackendError, match=refused):
            plain.park(KEY, "w", TTL, "h", "c", b"m", PARK_TTL)
        assert parker.park(KEY, "w", TTL, "h", "c", b"m", PARK_TTL).parked
        assert parker.release(KEY, "holder") is ReleaseOutcome.RELEASED
    finally:
        plain.close()
        parker.close()


def test_a_freed_slot_is_handed_to_the_first_parked_call(
    store: LockStore, lock_client: redis.Redis
) -> None:
    """lock_limit=2: the parked call takes the slot its holder frees, also by owner prefix."""
    assert store.acquire_slot(KEY, 2, "v1|a|0|h|1|n|t|0", TTL).acquired
    assert store.acquire_slot(KEY, 2, "v1|b|0|h|1|n|t|0", TTL).acquired
    parked = store.park(KEY, "v1|c|0|h|1|n|t|0", TTL, "handoff-c", "o", b"m", PARK_TTL, limit=2)
    assert parked.parked and not parked.result.acquired
    # A worker's parent releases the dead child b's slot by its owner prefix.
    assert store.release_slot_of(KEY, 2, "v1|b|0|h|", "prefix") is ReleaseOutcome.RELEASED
    slot2 = f"{KEY}:slot:2"
    assert held(lock_client, slot2) == b"handoff-c"
    assert store.handed == [(KEY, "handoff-c", b"m")]  # type: ignore[attr-defined]
    granted = store.park(KEY, "v1|c|0|h|1|n2|t|0", TTL, "handoff-c", "w", b"", PARK_TTL, limit=2)
    assert granted.result.acquired and granted.result.key == slot2
    assert store.park(KEY, "x", TTL, "handoff-c", "f", b"", PARK_TTL, limit=2).already_ran


def test_a_handed_over_holder_gets_a_larger_fence(store: LockStore) -> None:
    assert store.acquire(KEY, "holder", TTL).acquired
    first = store.fence(KEY, "holder")
    assert park(store, "v", "handoff").parked
    store.release(KEY, "holder", fenced=True)
    granted = park(store, "v", "handoff", copy="woken", msg=b"")
    assert granted.result.acquired
    second = store.fence(KEY, "v")
    assert first is not None and second is not None and second > first


def test_a_withdrawn_call_leaves_the_queue_and_no_copy_of_it_runs(
    store: LockStore, lock_client: redis.Redis
) -> None:
    assert store.acquire(KEY, "holder", TTL).acquired
    assert park(store, "a", "handoff-a", msg=b"message-a").parked
    assert park(store, "b", "handoff-b", msg=b"message-b").parked
    store.withdraw(KEY, "handoff-a", PARK_TTL)
    assert park(store, "a2", "handoff-a", copy="net", msg=b"").already_ran
    store.release(KEY, "holder")  # straight to b
    assert held(lock_client, KEY) == b"handoff-b"
    # A lock already handed to a call that then gives up passes on.
    assert park(store, "c", "handoff-c", msg=b"message-c").parked
    store.withdraw(KEY, "handoff-b", PARK_TTL)
    assert held(lock_client, KEY) == b"handoff-c"
    assert store.handed[-1][1] == "handoff-c"  # type: ignore[attr-defined]


def test_copies_of_a_call_whose_handed_lock_expired_unused_run_once(
    store: LockStore, lock_client: redis.Redis
) -> None:
    """The woken message came late: the hand-off hold expired; its copies still run once."""
    store.handoff_ttl_ms = 50
    assert store.acquire(KEY, "holder", TTL).acquired
    assert park(store, "x", "handoff-x", copy="o").parked
    store.release(KEY, "holder")
    assert held(lock_client, KEY) == b"handoff-x"
    lock_client.delete(KEY)  # the hold ran out before any copy came
    woken = park(store, "x-woken", "handoff-x", copy="w:1", msg=b"")
    assert woken.result.acquired
    store.release(KEY, "x-woken")
    assert park(store, "x-net", "handoff-x", copy="f:1", msg=b"").already_ran


def test_a_new_call_meeting_a_dead_holders_free_key_queues_behind_the_parked_ones(
    store: LockStore, lock_client: redis.Redis
) -> None:
    """The holder died: its key expired with calls parked behind it, before the sweep came."""
    assert store.acquire(KEY, "dead-holder", TTL).acquired
    assert park(store, "a", "handoff-a", msg=b"message-a").parked
    lock_client.delete(KEY)  # the dead holder's TTL ran out; no release handed on
    # Its first try (no message yet: a task's first acquire) is refused...
    first_try = park(store, "n", "handoff-n", msg=b"")
    assert not first_try.result.acquired and not first_try.parked
    assert first_try.result.holder == "handoff-a" and lock_client.exists(KEY) == 0
    # ...and its park hands the key to the first parked call.
    newcomer = park(store, "n", "handoff-n", msg=b"message-n")
    assert newcomer.parked and not newcomer.result.acquired
    assert held(lock_client, KEY) == b"handoff-a"  # handed to the first parked call
    assert store.handed == [(KEY, "handoff-a", b"message-a")]  # type: ignore[attr-defined]
    waiters = handoff_keys(KEY)[0]
    assert lock_client.lrange(waiters, 0, -1) == [b"handoff-n"]
    # Its turn comes at a's release, in arrival order.
    assert park(store, "a", "handoff-a", copy="woken", msg=b"").result.acquired
    store.release(KEY, "a")
    assert held(lock_client, KEY) == b"handoff-n"
    assert store.handed[-1] == (KEY, "handoff-n", b"message-n")  # type: ignore[attr-defined]
    # A call that only tries (no message: it never parks) is refused meanwhile.
    assert not park(store, "t", "handoff-t", msg=b"").result.acquired


def test_a_call_whose_handed_lock_expired_unused_goes_before_later_parked_calls(
    store: LockStore, lock_client: redis.Redis
) -> None:
    assert store.acquire(KEY, "holder", TTL).acquired
    assert park(store, "x", "handoff-x", msg=b"message-x").parked
    assert park(store, "y", "handoff-y", msg=b"message-y").parked
    store.release(KEY, "holder")
    assert held(lock_client, KEY) == b"handoff-x"
    lock_client.delete(KEY)  # x's hold ran out before its woken message came
    woken = park(store, "x-woken", "handoff-x", copy="w:1", msg=b"")
    assert woken.result.acquired  # x was first in line: not handed on to y
    store.release(KEY, "x-woken")
    assert held(lock_client, KEY) == b"handoff-y"


def test_a_soft_time_limit_inside_the_hand_off_publish_is_not_swallowed(
    lock_client: redis.Redis,
) -> None:
    """It reaches the holder's release, which sends the release again: that one publishes.

    A publish that fails (the broker) is logged and left to the safety net;
    a soft time limit (an ``Exception`` too) landing in it was swallowed
    with it, and the task reported SUCCESS (as helper-47 F1 found for the
    kept release's hook).
    """
    from celery.exceptions import SoftTimeLimitExceeded

    from celery_redislock import RedisLock

    store = LockStore(client=lock_client)
    handed: list[str] = []

    def publish(key: str, waiter: str, message: bytes) -> None:
        handed.append(waiter)
        if len(handed) == 1:
            raise SoftTimeLimitExceeded()

    store.on_handoff = publish
    lock = RedisLock(lock_client, KEY, ttl=10, store=store)
    assert lock.acquire()
    assert park(store, "value-0", "handoff-0").parked
    with pytest.raises(SoftTimeLimitExceeded):
        lock.release()
    assert handed == ["handoff-0", "handoff-0"]  # published by the release sent again
    assert held(lock_client, KEY) == b"handoff-0"
    assert not lock.owned


@pytest.mark.parametrize("swept", [True, False])
def test_the_apps_publisher_keeps_a_publish_the_broker_refuses(
    caplog: pytest.LogCaptureFixture, lock_client: redis.Redis, swept: bool
) -> None:
    """A failed publish is kept for a sweep (or, where none runs, left to the safety net).

    Logged, never raised; kept in the app's outbox.
    """
    import socket

    from celery import Celery

    from celery_redislock.handoff import pack_signature, publisher
    from celery_redislock.headers import HANDOFF_COPY_HEADER
    from celery_redislock.keys import pending_keys

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens on it once closed
    app = Celery("refused", broker=f"redis://127.0.0.1:{port}/0", set_as_current=False)
    app.conf.update(task_publish_retry=False, broker_connection_timeout=0.5)
    options = {"retries": 0, "task_id": "t-1", "headers": {HANDOFF_COPY_HEADER: "w:x"}}
    message = pack_signature(app.signature("refused.job", options=options), "json")
    store = LockStore(client=lock_client)
    with caplog.at_level("ERROR", logger="celery_redislock"):
        publisher(app, store, "redislock", swept)(KEY, "handoff-0", message)  # does not raise
    assert any("could not publish" in record.getMessage() for record in caplog.records)
    index, outbox = pending_keys("redislock", "refused")
    kept = lock_client.hgetall(outbox)
    if not swept:
        assert not kept and "re-sent copy runs" in caplog.text
        return
    assert "kept in the lock store" in caplog.text
    ((message_id, stored),) = kept.items()
    assert (
        message_id.startswith(b"t-1:") and lock_client.zscore(index, b"o|" + message_id) is not None
    )
    assert stored == message  # the sweep tags each publish of it (test_copy_tags.py)
