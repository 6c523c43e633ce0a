"""An ACL user allowed only what the package needs (the docs list it) is enough."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import (
    LockBackendError,
    RedisLock,
    ReleaseOutcome,
    SingletonTask,
    Wait,
    is_skipped,
)
from celery_redislock.admin import LockInventory
from celery_redislock.settings import forget_app_settings
from celery_redislock.store import LockStore
from tests.servers import RedisServer, wait_until

#: The rules docs/_parts/topologies.md (ACL) gives a lock-store user, key prefix "redislock".
LOCK_USER_RULES = (
    "~redislock:*",
    "&redislock:*",
    "+@connection",
    "+evalsha",
    "+eval",
    "+get",
    "+set",
    "+pexpire",
    "+pttl",
    "+del",
    "+time",
    "+append",
    "+publish",
    "+subscribe",
    "+unsubscribe",
    "+scan",
    "+script|load",
)

#: And for hand-off, coalescing and debounce, and the workers' sweep
#: (docs/_parts/topologies.md).
HANDOFF_RULES = (
    "+lpop",
    "+rpush",
    "+lpush",
    "+lrem",
    "+lpos",
    "+lindex",
    "+llen",
    "+lrange",
    "+hset",
    "+hget",
    "+hmget",
    "+hdel",
    "+hsetnx",
    "+hexists",
    "+hkeys",
    "+hlen",
    "+zadd",
    "+zscore",
    "+zrangebyscore",
    "+zrem",
)


#: What docs/_parts/topologies.md adds for standalone locks named without a hash tag.
STANDALONE_RULE = "~{redislock:*"


@pytest.fixture
def acl_server(redis_server_factory: Any) -> RedisServer:
    server: RedisServer = redis_server_factory(
        "--user", "locker", "on", ">s3cret", *LOCK_USER_RULES,
        "--user", "nopublish", "on", ">s3cret",
        *[rule for rule in LOCK_USER_RULES if rule != "+publish"],
        "--user", "noset", "on", ">s3cret",
        *[rule for rule in LOCK_USER_RULES if rule != "+set"],
        "--user", "standalone", "on", ">s3cret", *LOCK_USER_RULES, STANDALONE_RULE,
    )  # fmt: skip
    return server


@pytest.fixture
def make_app(acl_server: RedisServer) -> Iterator[Any]:
    apps: list[Celery] = []

    def make(user: str) -> Celery:
        app = Celery(f"acl-{user}", set_as_current=False)
        app.conf.update(
            broker_url="memory://",
            redislock_url=f"redis://{user}:s3cret@127.0.0.1:{acl_server.port}/0",
            redislock_ttl=0.6,
            redislock_backend_error_max_retries=0,
        )
        apps.append(app)
        return app

    yield make
    for app in apps:
        forget_app_settings(app)


def test_restricted_user_runs_every_lock_operation(make_app: Any, acl_server: RedisServer) -> None:
    app = make_app("locker")
    entered, leave = threading.Event(), threading.Event()
    seen: list[Any] = []

    @app.task(base=SingletonTask, bind=True, shared=False, lock_args=())
    def job(self: Any, mode: str) -> str:
        if mode == "hold":
            entered.set()
            wait_until(lambda: self.lock.renewals >= 2, timeout=10)  # PEXPIRE in a script
            leave.wait(20)
        return mode

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_args=(), lock_on_contention=Wait(20)
    )
    def queued(self: Any, mode: str) -> str:
        if mode == "hold":
            entered.set()
            leave.wait(20)
        return mode

    def in_thread(task: Any, mode: str) -> threading.Thread:
        thread = threading.Thread(target=lambda: seen.append(task.apply((mode,)).get()))
        thread.start()
        return thread

    holder = in_thread(job, "hold")
    assert entered.wait(20)
    assert is_skipped(job.apply(("other",)).get())  # GET and PTTL of the holder
    [record] = LockInventory(app).locks()  # SCAN under the ACL
    assert record.task_name == job.name
    leave.set()
    holder.join(20)
    assert seen == ["hold"]
    assert acl_server.client().exists(record.key) == 0  # released: DEL and PUBLISH

    entered.clear()
    leave.clear()
    first = in_thread(queued, "hold")
    assert entered.wait(20)
    second = in_thread(queued, "second")  # waits: SUBSCRIBE to the release channel
    channel = f"{queued.lock_key_for(('x',), {})}:released"
    wait_until(lambda: acl_server.client().pubsub_numsub(channel)[0][1] == 1, timeout=10)
    leave.set()
    first.join(20)
    second.join(20)
    # Both threads append after their apply() returned: once the first one
    # released, the woken second may append first. That it waited is shown
    # by its subscription above.
    assert sorted(seen) == ["hold", "hold", "second"]


def test_a_missing_permission_is_a_clear_error(
    make_app: Any, acl_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    cannot_set = make_app("noset")

    @cannot_set.task(base=SingletonTask, shared=False)
    def job() -> None:
        pass

    result = job.apply()
    assert result.failed() and isinstance(result.result, LockBackendError)
    assert "refused to acquire" in str(result.result)
    assert "must allow EVAL/EVALSHA, GET, SET" in str(result.result)

    # Without PUBLISH a lock is taken and released as long as nobody waits
    # for it (a release publishes only then); the release that must wake a
    # waiter is refused with the same hint, and the key expires with its TTL.
    cannot_publish = make_app("nopublish")

    @cannot_publish.task(base=SingletonTask, bind=True, shared=False)
    def other(self: Any) -> str:
        return str(self.lock.key)

    key = other.apply().get()
    assert acl_server.client().exists(key) == 0
    store = LockStore(f"redis://nopublish:s3cret@127.0.0.1:{acl_server.port}/0")
    try:
        assert store.acquire("redislock:k", "holder", 1000).acquired
        assert not store.acquire("redislock:k", "waiter", 1000, waiting=True).acquired
        with pytest.raises(LockBackendError, match=r"refused to release.*must allow"):
            store.release("redislock:k", "holder")
    finally:
        store.close()
    wait_until(lambda: acl_server.client().exists("redislock:k") == 0, timeout=5)


def test_the_documented_user_passes_a_workers_start_up_check(acl_server: RedisServer) -> None:
    """``celery worker`` loads the scripts (``SCRIPT LOAD``) before ``ready``."""
    store = LockStore(url=f"redis://locker:s3cret@127.0.0.1:{acl_server.port}/0")
    try:
        assert store.load_scripts("redislock:{startup-check}") == 1
    finally:
        store.close()


def test_the_documented_rules_are_the_ones_tested() -> None:
    from tests.servers import ROOT

    text = (ROOT / "docs" / "_parts" / "topologies.md").read_text()
    setuser = next(line for line in text.splitlines() if line.startswith("ACL SETUSER locker"))
    assert tuple(setuser.split()[5:]) == LOCK_USER_RULES
    handoff = next(line for line in text.splitlines() if line.strip().startswith("`+lpop"))
    assert tuple(handoff.strip().strip("`.").split()) == HANDOFF_RULES
    assert f"add `{STANDALONE_RULE}`" in text.replace("\n  ", " ")


@pytest.mark.parametrize(
    ("user", "name"), [("locker", "redislock:{job}"), ("standalone", "redislock:job")]
)
def test_a_release_someone_waits_for_needs_no_list_or_hash_command(
    acl_server: RedisServer, user: str, name: str
) -> None:
    """The documented rules wake a waiter: the release touches no hand-off key nobody made.

    And a standalone lock reads its fence: under its hash tag, or, named
    without one, with the rule the docs add for that.
    """
    client = redis.Redis(port=acl_server.port, username=user, password="s3cret", socket_timeout=2)
    holder = RedisLock(client, name, ttl=10)
    assert holder.acquire()
    assert holder.fence > 0
    waited: list[tuple[bool, float]] = []

    def wait() -> None:
        acquired = RedisLock(client, name, ttl=10).acquire(timeout=8)
        waited.append((acquired, time.monotonic()))

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    admin = acl_server.client()
    wait_until(lambda: (admin.get(name) or b"").endswith(b"|w"), timeout=5)  # marked
    released_at = time.monotonic()
    assert holder.release() is ReleaseOutcome.RELEASED
    waiter.join(10)
    [(acquired, at)] = waited
    assert acquired and at - released_at < 3.0  # woken, not the 10 s TTL
    client.close()


def test_a_slot_released_by_owner_needs_no_list_or_hash_command(acl_server: RedisServer) -> None:
    """``lock_limit``: a take-back or a parent's release frees the slot under the base rules."""
    store = LockStore(f"redis://locker:s3cret@127.0.0.1:{acl_server.port}/0")
    key = "redislock:t:{slots}"
    try:
        assert store.acquire_slot(key, 2, "v1|a", 10_000, (), "v1|a").acquired
        taken = store.acquire_slot(key, 2, "v1|b", 10_000, (), "v1|b")
        assert taken.acquired and taken.key != key
        assert store.release_slot_of(key, 2, "v1|b") is ReleaseOutcome.RELEASED
        assert store.release_slot_of(key, 2, "v1|a", "prefix") is ReleaseOutcome.RELEASED
    finally:
        store.close()
    assert acl_server.client().keys("*slots*") == []
