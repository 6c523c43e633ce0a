"""The pending-call index and its sweep scripts against a real redis-server (no Celery)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import redis

from celery_redislock.keys import debounce_key, handoff_keys, next_run_key, queued_key
from celery_redislock.pending import Member, PendingIndex, Reaping, RevocableCall
from celery_redislock.store import LockStore, ReleaseOutcome
from tests.conftest import LOCK_DB
from tests.helpers import held
from tests.integration.test_acl import HANDOFF_RULES, LOCK_USER_RULES
from tests.servers import FaultProxy, RedisServer, wait_until

KEY = "redislock:t:{abc}"
TTL = 10_000
PARK_TTL = 60_000
HANDOFF_TTL = 5_000


@pytest.fixture
def store(lock_client: redis.Redis) -> LockStore:
    backend = LockStore(client=lock_client)
    handed: list[tuple[str, str, bytes]] = []
    backend.on_handoff = lambda key, waiter, message: handed.append((key, waiter, message))
    backend.handed = handed  # type: ignore[attr-defined]
    backend.handoff_ttl_ms = HANDOFF_TTL
    return backend


@pytest.fixture
def index(store: LockStore) -> PendingIndex:
    return PendingIndex(store, "redislock", "proj")


def park(store: LockStore, index: PendingIndex, value: str, handoff: str, msg: bytes) -> bool:
    touch = index.touch_call(Member.parked(KEY, 1), 0)
    return store.park(KEY, value, TTL, handoff, "o", msg, PARK_TTL, touch=touch).parked


def test_a_sweep_hands_a_dead_holders_key_to_the_first_parked_call(
    store: LockStore, index: PendingIndex, lock_client: redis.Redis
) -> None:
    assert store.acquire(KEY, "holder", TTL).acquired
    assert park(store, index, "a", "handoff-a", b"message-a")
    assert park(store, index, "b", "handoff-b", b"message-b")
    _, due = index.due(10, 1000)
    assert due == [Member.parked(KEY, 1)]  # touched by the parks: look at once
    still_held = index.reap_parked(KEY, 1, HANDOFF_TTL, 0)
    assert still_held.outcome is Reaping.LATER and 9_000 < still_held.later_ms <= TTL
    lock_client.delete(KEY)  # the holder's worker died; its TTL ran out
    handed = index.reap_parked(KEY, 1, HANDOFF_TTL, 0)
    assert handed.outcome is Reaping.PUBLISH
    assert (handed.handoff, handed.message) == ("handoff-a", b"message-a")
    assert held(lock_client, KEY) == b"handoff-a"
    assert 0 < lock_client.pttl(KEY) <= HANDOFF_TTL
    # The hold expired unused (the woken message died): a is handed again, first.
    lock_client.delete(KEY)
    again = index.reap_parked(KEY, 1, HANDOFF_TTL, 0)
    assert (again.outcome, again.handoff) == (Reaping.PUBLISH, "handoff-a")
    # a runs (its copy is granted) and releases: b next, by the release itself.
    assert store.park(KEY, "a-run", TTL, "handoff-a", "r:1", b"", PARK_TTL).result.acquired
    assert store.release(KEY, "a-run") is ReleaseOutcome.RELEASED
    assert held(lock_client, KEY) == b"handoff-b"
    assert store.park(KEY, "b-run", TTL, "handoff-b", "w:1", b"", PARK_TTL).result.acquired
    store.release(KEY, "b-run")
    assert index.reap_parked(KEY, 1, HANDOFF_TTL, 0).outcome is Reaping.DONE


def test_a_copy_that_finds_the_key_free_hands_it_to_the_call_that_parked_first(
    store: LockStore, index: PendingIndex, lock_client: redis.Redis
) -> None:
    assert store.acquire(KEY, "holder", TTL).acquired
    for name in "abc":
        assert park(store, index, name, f"handoff-{name}", f"message-{name}".encode())
    lock_client.delete(KEY)
    # c's safety net comes first: it hands the key to a and stays parked.
    late = store.park(KEY, "c-net", TTL, "handoff-c", "f:1", b"", PARK_TTL)
    assert not late.result.acquired and late.parked
    assert late.result.holder == "handoff-a"
    assert held(lock_client, KEY) == b"handoff-a"
    assert store.handed == [(KEY, "handoff-a", b"message-a")]  # type: ignore[attr-defined]
    assert lock_client.lrange(handoff_keys(KEY)[0], 0, -1) == [b"handoff-b", b"handoff-c"]


def test_a_member_touched_while_claimed_is_not_removed(index: PendingIndex) -> None:
    member = Member.parked(KEY, 1)
    runner = index.store.run_scripts
    runner([index.touch_call(member, 0)])
    claim, due = index.due(10, 5000)
    assert due == [member]
    assert index.due(10, 5000)[1] == []  # claimed: another sweep leaves it
    runner([index.touch_call(member, 0)])  # a call parks meanwhile
    index.settle(member, claim, None)  # the sweep found nothing: remove... not this
    assert index.due(10, 5000)[1] == [member]


def test_a_coalesced_run_not_started_in_time_is_copied_after_a_grace_then_less_often(
    store: LockStore, index: PendingIndex, lock_client: redis.Redis
) -> None:
    queued = index.queue_run(
        KEY, "token-1", PARK_TTL, "handoff-1", b"run-1", 300, "id-1", grace_ms=200
    )
    assert queued[0]
    assert index.reap_queued(KEY, "id-1", PARK_TTL).outcome is Reaping.LATER
    copies: list[float] = []
    started = time.monotonic()

    def reap() -> bool:  # due at 0.3 s, then 0.2 s later, then 0.4 s later
        if index.reap_queued(KEY, "id-1", PARK_TTL).outcome is Reaping.PUBLISH:
            copies.append(time.monotonic() - started)
        return len(copies) == 3

    wait_until(reap, timeout=10, message="three copies")
    assert lock_client.hget(handoff_keys(KEY)[2], "handoff-1") == b"?"  # copies exist
    gaps = [b - a for a, b in itertools.pairwise(copies)]
    assert 0.15 < gaps[0] < gaps[1]  # a backlog is copied less and less often
    # A duplicate call joins the queued run.
    assert not index.queue_run(
        KEY, "token-2", PARK_TTL, "handoff-2", b"run-2", 300, "id-2", grace_ms=200
    )[0]
    # The copy is granted: the queued key and its record go; the original is dropped.
    slot = (queued_key(KEY), "token-1")
    granted = store.park(KEY, "v", TTL, "handoff-1", "r:1", b"", PARK_TTL, slot)
    assert granted.result.acquired
    assert not lock_client.exists(queued_key(KEY), next_run_key(KEY))
    store.release(KEY, "v")
    assert store.park(KEY, "v2", TTL, "handoff-1", "o", b"", PARK_TTL, slot).already_ran
    assert index.reap_queued(KEY, "id-1", PARK_TTL).outcome is Reaping.DONE


def test_a_run_stuck_in_a_backlog_is_copied_five_times_at_most(index: PendingIndex) -> None:
    index.queue_run(KEY, "token-1", PARK_TTL, "handoff-1", b"run-1", 0, "id-1", grace_ms=1)
    reaped: list[Reaping] = []

    def reap() -> bool:
        reaped.append(index.reap_queued(KEY, "id-1", PARK_TTL).outcome)
        return reaped[-1] is Reaping.DONE

    wait_until(reap, timeout=10, interval=0.02, message="the run given up")
    assert len(reaped) - 1 == 5


def test_the_member_of_a_run_that_started_or_parked_is_forgotten_in_the_same_round_trip(
    store: LockStore, index: PendingIndex, lock_client: redis.Redis
) -> None:
    index.queue_run(KEY, "token-1", PARK_TTL, "handoff-1", b"run-1", 60_000, "id-1", 1000)
    assert lock_client.zcard(index.index) == 1
    slot = (queued_key(KEY), "token-1")
    forget = index.forget_queued_call(KEY, "id-1", "token-1", "handoff-1")
    assert store.acquire(KEY, "running", TTL).acquired
    # Contended and not parking yet (a first try): the member stays.
    store.park(KEY, "v", TTL, "handoff-1", "o", b"", PARK_TTL, slot, after=forget)
    assert lock_client.zcard(index.index) == 1
    # It parks: the key's parked member covers it now.
    store.park(KEY, "v", TTL, "handoff-1", "o", b"m", PARK_TTL, slot, after=forget)
    assert lock_client.zrange(index.index, 0, -1) == []
    assert index.reap_queued(KEY, "id-1", PARK_TTL).outcome is Reaping.DONE


def test_a_debounced_run_not_started_in_time_is_published_again(
    store: LockStore, index: PendingIndex, lock_client: redis.Redis
) -> None:
    touch = index.touch_call(Member.debounced(KEY), 150)
    new, burst, due = store.debounce(KEY, "burst-1", 100, 1000, b"run", "handoff-d", touch, 50)
    assert new and burst == "burst-1" and due == pytest.approx(0.1)
    # Every later call of the burst touches the same member: one per key.
    later = store.debounce(KEY, "burst-2", 100, 1000, b"run-2", "handoff-2", touch, 50)
    assert not later[0] and lock_client.zcard(index.index) == 1
    assert index.reap_debounced(KEY, PARK_TTL).outcome is Reaping.LATER
    wait_until(lambda: index.reap_debounced(KEY, PARK_TTL).outcome is Reaping.PUBLISH, timeout=5)
    assert lock_client.hget(handoff_keys(KEY)[2], "handoff-d") == b"?"
    # Its run starts: the record goes, and with it (same round trip) the member.
    forget = index.forget_debounced_call(KEY)
    assert store.debounce_due(KEY, "burst-1", after=forget) == 0
    assert not lock_client.exists(debounce_key(KEY))
    assert lock_client.zcard(index.index) == 0
    assert index.reap_debounced(KEY, PARK_TTL).outcome is Reaping.DONE


def test_a_debounced_run_with_a_longer_countdown_is_not_copied_before_it(
    store: LockStore, index: PendingIndex
) -> None:
    """``delay(countdown=...)`` longer than the window: the run is due then, not sooner."""
    store.debounce(KEY, "burst-1", 100, 1000, b"run", "handoff-d", None, 50, 1500)
    reaped = index.reap_debounced(KEY, PARK_TTL)
    # Due at the countdown (1.5 s) and its grace, not at the window (0.1 s).
    assert reaped.outcome is Reaping.LATER and reaped.later_ms > 1400


def test_apps_sharing_a_store_and_a_prefix_keep_their_pending_calls_apart(
    store: LockStore,
) -> None:
    """A sweep publishes through its own app's broker: it never sees another app's calls."""
    mine, theirs = PendingIndex(store, "redislock", "a"), PendingIndex(store, "redislock", "b")
    theirs.put_outbox("id-1", b"message", 0, 60_000)
    assert mine.due(10, 1000)[1] == []
    assert theirs.due(10, 1000)[1] == [Member.OUTBOX + "|id-1"]


def test_the_outbox_gives_a_refused_message_to_one_sweep_once(index: PendingIndex) -> None:
    index.put_outbox("id-1", b"message", 0, 60_000)
    _, due = index.due(10, 1000)
    assert due == [Member.OUTBOX + "|id-1"]
    assert index.take_outbox("id-1") == b"message"
    assert index.take_outbox("id-1") is None  # another sweep, or the lease ran out: gone
    assert index.due(10, 1000)[1] == []


def test_a_sweep_retried_after_its_reply_was_lost_publishes_the_hand_over(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    """REAP_PARKED handed the key over; the reply never came; the retry says so."""
    proxy = FaultProxy(server.port)
    store = LockStore(url=f"{proxy.url}/{LOCK_DB}")
    index = PendingIndex(store, "redislock", "proj")
    try:
        assert store.acquire(KEY, "holder", TTL).acquired
        assert store.park(KEY, "a", TTL, "handoff-a", "o", b"message-a", PARK_TTL).parked
        lock_client.delete(KEY)  # the holder died
        index.due(10, 1000)  # the sweep's connection is up
        proxy.lose_replies = 1
        reaped = index.reap_parked(KEY, 1, HANDOFF_TTL, 0)
        assert (reaped.outcome, reaped.handoff) == (Reaping.PUBLISH, "handoff-a")
        assert held(lock_client, KEY) == b"handoff-a"
    finally:
        store.close()
        proxy.close()


def test_a_release_retried_after_its_reply_was_lost_publishes_the_hand_over(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    """The first try handed the key over, its reply never came: the retry says so."""
    proxy = FaultProxy(server.port)
    store = LockStore(url=f"{proxy.url}/{LOCK_DB}")
    handed: list[str] = []
    store.on_handoff = lambda key, waiter, message: handed.append(waiter)
    try:
        assert store.acquire(KEY, "holder", TTL).acquired
        assert store.park(KEY, "a", TTL, "handoff-a", "o", b"message-a", PARK_TTL).parked
        store.release("redislock:t:{warm}", "x")  # the releases' connection is up
        proxy.lose_replies = 1  # the release runs; its reply is lost; the retry's is not
        assert store.release(KEY, "holder") is ReleaseOutcome.RELEASED
        assert held(lock_client, KEY) == b"handoff-a"
        assert handed == ["handoff-a"]
    finally:
        store.close()
        proxy.close()


def test_a_lock_store_user_with_the_documented_rules_runs_the_sweep(
    redis_server_factory: Any,
) -> None:
    """The ACL of docs/_parts/topologies.md covers the index, the outbox and every reap."""
    server: RedisServer = redis_server_factory(
        "--user", "parker", "on", ">pw", *LOCK_USER_RULES, *HANDOFF_RULES
    )  # fmt: skip
    store = LockStore(url=f"redis://parker:pw@127.0.0.1:{server.port}/0")
    store.handoff_ttl_ms = HANDOFF_TTL
    admin = server.client()
    index = PendingIndex(store, "redislock", "proj")
    try:
        assert store.acquire(KEY, "holder", TTL).acquired
        assert park(store, index, "a", "handoff-a", b"message-a")
        claim, due = index.due(10, 1000)
        assert due == [Member.parked(KEY, 1)]
        assert index.reap_parked(KEY, 1, HANDOFF_TTL, 0).outcome is Reaping.LATER
        index.settle(due[0], claim, 1000)
        admin.delete(KEY)  # the holder died
        assert index.reap_parked(KEY, 1, HANDOFF_TTL, 0).handoff == "handoff-a"
        other = "redislock:t:{queued}"
        assert index.queue_run(other, "token", PARK_TTL, "handoff-q", b"run", 0, "id-q", 10)[0]
        wait_until(lambda: index.reap_queued(other, "id-q", PARK_TTL).outcome is Reaping.PUBLISH)
        touch = index.touch_call(Member.debounced(KEY), 0)
        store.debounce(KEY, "burst", 10, 100, b"run", "handoff-d", touch, 10)
        wait_until(lambda: index.reap_debounced(KEY, PARK_TTL).outcome is Reaping.PUBLISH)
        index.put_outbox("id-1", b"message", 0, 60_000)
        assert index.take_outbox("id-1") == b"message"
    finally:
        store.close()


def test_a_revoke_record_is_read_forgotten_expires_and_is_no_lock(
    redis_server_factory: Any,
) -> None:
    """Kept and taken by a user with only the base rules; ``celery redislock ls`` skips it."""
    server: RedisServer = redis_server_factory(
        "--user", "locker", "on", ">pw", *LOCK_USER_RULES
    )  # fmt: skip
    store = LockStore(url=f"redis://locker:pw@127.0.0.1:{server.port}/0")
    index = PendingIndex(store, "redislock", "proj")
    call = RevocableCall("proj.job", KEY, "token", False)
    try:
        index.keep_revocable("id-1", call, 60_000)
        index.keep_revocable("id-2", RevocableCall("proj.job", KEY, None, True), 50)
        assert [key for batch in store.scan_keys("redislock:*") for key in batch] == []
        assert index.read_revocable("id-1") == call
        assert index.read_revocable("id-1") == call  # read, not taken: until given back
        index.forget_revocable("id-1")
        assert index.read_revocable("id-1") is None
        wait_until(lambda: server.client().dbsize() == 0, timeout=5)  # id-2 expired
        assert index.read_revocable("id-2") is None
        server.client().set("redislock:{pending:proj}:id-3:revocable", "not what we wrote")
        assert index.read_revocable("id-3") is None
    finally:
        store.close()


@pytest.mark.parametrize("ran_mark", ["withdrawn", "?"])
def test_a_failed_coalesced_publish_is_withdrawn_unless_a_copy_was_granted_or_parked(
    index: PendingIndex, lock_client: redis.Redis, ran_mark: str
) -> None:
    """Neither a sweep's claim ('?') nor a copy that gave up ('withdrawn') is a copy that runs."""
    from celery_redislock.tokens import LockValue

    key, task_id, name = "redislock:t:{withdraw}", "task-a", "t"
    token = LockValue.queued(task_id, name).encode()
    handoff = LockValue.parked(task_id, 0, name).encode()
    queued, _holder, _ttl = index.queue_run(key, token, 60_000, handoff, b"m", 0, task_id, 1_000)
    assert queued
    ran = handoff_keys(key)[2]
    lock_client.hset(ran, handoff, ran_mark)
    assert index.withdraw_run(key, token, task_id, handoff) is False
    assert lock_client.exists(queued_key(key), next_run_key(key)) == 0

    # A copy that was granted the lock (its tag) or is parked: the call runs.
    assert index.queue_run(key, token, 60_000, handoff, b"m", 0, task_id, 1_000)[0]
    lock_client.hset(ran, handoff, "w:tag")
    assert index.withdraw_run(key, token, task_id, handoff) is True
    lock_client.hdel(ran, handoff)
    lock_client.hset(handoff_keys(key)[1], handoff, "message")
    assert index.withdraw_run(key, token, task_id, handoff) is True
    assert lock_client.get(queued_key(key)) == token.encode()
