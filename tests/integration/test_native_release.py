"""A plain release is ``DELIFEQ`` where the server has it (Valkey >= 9), the scripts elsewhere.

Each test runs on both servers, whatever ``REDISLOCK_TEST_SERVER`` says:
Redis 7 (no ``DELIFEQ``: one refusal, then the scripts) and the embedded
Valkey 9 (no script on a plain release). The outcomes are the same on both.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.sentinel

from celery_redislock import AsyncRedisLock, RedisLock, evalsha, lock_lost, scripts
from celery_redislock.store import LockStore, ReleaseOutcome
from celery_redislock.tokens import WAITING
from examples.server import embedded_binary
from tests.servers import FaultProxy, RedisClusterServers, RedisServer, wait_until

KEY = "redislock:t:{native}"
MINE = "v1|me|0|h|1|n|job|0"
OTHER = "v1|other|0|h|1|n|job|0"

SERVERS = {"redis-7": shutil.which("redis-server"), "valkey-9": embedded_binary()}


@pytest.fixture(scope="module", params=sorted(SERVERS))
def native_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    binary = SERVERS[request.param]
    if binary is None:
        pytest.skip(f"no {request.param} server here")
    # Redis 7 knows no DELIFEQ to deny: there the user may run everything.
    denied = ["-delifeq"] if request.param.startswith("valkey") else []
    server = RedisServer(
        "--user", "nodelifeq", "on", ">s3cret", "~*", "&*", "+@all", *denied, binary=binary
    )
    yield server
    server.close()


@pytest.fixture
def client(native_server: RedisServer) -> Iterator[redis.Redis]:
    client = native_server.client()
    client.flushall()
    client.config_resetstat()
    yield client
    client.close()


def has_delifeq(client: redis.Redis) -> bool:
    """Asked after the measured commands: the probe adds a call (or a refusal) of its own."""
    try:
        client.execute_command("DELIFEQ", "redislock:t:probe", "x")
    except redis.ResponseError:
        return False
    return True


def calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def errors(client: redis.Redis) -> int:
    """Error replies the server sent (a refused command among them)."""
    return sum(int(row["count"]) for row in client.info("errorstats").values())


def test_plain_releases_send_delifeq_where_the_server_has_it(
    native_server: RedisServer, client: redis.Redis
) -> None:
    store = LockStore(native_server.url)
    try:
        outcomes, refused = [], 0
        for cycle in range(5):
            lock = RedisLock(client, KEY, ttl=30, store=store)
            assert lock.acquire(blocking=False)
            outcomes.append(lock.release())
            if cycle == 0:
                refused = errors(client)  # Redis 7: DELIFEQ refused (and the handshakes)
        assert outcomes == [ReleaseOutcome.RELEASED] * 5
        assert client.exists(KEY) == 0
        assert errors(client) == refused  # a refusal is remembered: never sent again
        seen = calls(client, "delifeq"), calls(client, "evalsha")
        assert seen == ((5, 0) if has_delifeq(client) else (0, 5))
    finally:
        store.close()


def test_plain_asyncio_releases_send_delifeq_where_the_server_has_it(
    native_server: RedisServer, client: redis.Redis
) -> None:
    async def cycles() -> tuple[list[Any], int]:
        async_client = redis.asyncio.Redis(port=native_server.port)
        try:
            outcomes, refused = [], 0
            for cycle in range(5):
                lock = AsyncRedisLock(async_client, KEY, ttl=30)
                assert await lock.acquire(blocking=False)
                outcomes.append(await lock.release())
                if cycle == 0:
                    refused = errors(client)
            return outcomes, refused
        finally:
            await async_client.aclose()

    outcomes, refused = asyncio.run(cycles())
    assert outcomes == [ReleaseOutcome.RELEASED] * 5
    assert errors(client) == refused
    seen = calls(client, "delifeq"), calls(client, "evalsha")
    assert seen == ((5, 0) if has_delifeq(client) else (0, 5))


@pytest.mark.parametrize("found", ["gone", "another holder's"])
def test_a_release_delifeq_did_not_delete_reports_what_the_key_held(
    native_server: RedisServer, client: redis.Redis, found: str
) -> None:
    store = LockStore(native_server.url)
    try:
        client.set(KEY, MINE, px=30_000)
        if found == "gone":
            client.delete(KEY)
            assert store.release(KEY, MINE) is ReleaseOutcome.ALREADY_GONE
        else:
            client.set(KEY, OTHER, px=30_000)
            assert store.release(KEY, MINE) is ReleaseOutcome.NOT_OURS
            assert client.get(KEY) == OTHER.encode()  # left alone
    finally:
        store.close()


def test_a_release_someone_waits_for_wakes_them(
    native_server: RedisServer, client: redis.Redis
) -> None:
    """The waiter marks the holder's value: DELIFEQ leaves it, the script hands over and wakes."""
    holder = RedisLock(client, KEY, ttl=30)
    assert holder.acquire(blocking=False)
    taken = threading.Event()

    def wait_for_it() -> None:
        waiter = RedisLock(native_server.client(), KEY, ttl=30, timeout=20)
        if waiter.acquire():
            taken.set()
            waiter.release()

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    try:
        wait_until(lambda: client.get(KEY).endswith(b"|w"), timeout=10, message="the mark")
        assert holder.release() is ReleaseOutcome.RELEASED
        assert taken.wait(10)  # woken by the release, not by the holder's 30 s TTL
    finally:
        thread.join(20)


def test_a_user_the_acl_denies_delifeq_releases_with_the_scripts(
    native_server: RedisServer, client: redis.Redis
) -> None:
    store = LockStore(f"redis://nodelifeq:s3cret@127.0.0.1:{native_server.port}/0")
    try:
        for _ in range(3):
            client.set(KEY, MINE, px=30_000)
            assert store.release(KEY, MINE) is ReleaseOutcome.RELEASED
        assert client.exists(KEY) == 0
        assert calls(client, "evalsha") == 3
        assert calls(client, "delifeq") == 0
    finally:
        store.close()


def test_a_delifeq_whose_reply_was_lost_is_retried_as_released(
    native_server: RedisServer, client: redis.Redis
) -> None:
    """The first attempt deleted the key; its reply never came: the retry says released."""
    proxy = FaultProxy(native_server.port)
    store = LockStore(f"{proxy.url}/0", renew_timeout=1.0)
    try:
        assert store.release(KEY + "warm", MINE) is ReleaseOutcome.ALREADY_GONE
        client.set(KEY, MINE, px=30_000)
        proxy.lose_replies = 1
        assert store.release(KEY, MINE) is ReleaseOutcome.RELEASED
        assert client.exists(KEY) == 0
    finally:
        store.close()
        proxy.close()


def test_a_lock_found_another_holders_during_a_slot_migration_is_reported_not_ours(
    native_server: RedisServer,
) -> None:
    """The release classifies a refused DELIFEQ with the one-key script (helper-36 F1).

    While the slot migrates, a script naming the lock's companion keys as well
    is refused (TRYAGAIN, its keys split between the nodes) until it ends.
    """
    cluster = RedisClusterServers(masters=2, binary=native_server.binary)
    store = LockStore(cluster.url)
    try:
        cluster.node_holding(KEY).client().set(KEY, OTHER, px=30_000)
        assert store.release(KEY + "warm", MINE) is ReleaseOutcome.ALREADY_GONE
        target, finish = cluster.start_migration(KEY)
        try:
            assert store.release(KEY, MINE) is ReleaseOutcome.NOT_OURS
        finally:
            finish()
        assert target.client().get(KEY) == OTHER.encode()
    finally:
        store.close()
        cluster.close()


def test_a_release_on_a_demoted_master_reports_the_loss_found_on_the_new_one(
    native_server: RedisServer,
) -> None:
    """READONLY refuses the release: nothing ran, so its retry is no retry (helper-36 F2).

    A Sentinel failover left the old master up as the new one's replica; on
    the new master the key is gone. The release reconnects and finds it gone:
    a loss (ALREADY_GONE), not a release sent again after a lost reply.
    """
    new = RedisServer(binary=native_server.binary)
    master = {"address": ("127.0.0.1", native_server.port)}
    sentinel = redis.sentinel.Sentinel([("127.0.0.1", 1)])
    sentinel.discover_master = lambda name: master["address"]  # type: ignore[method-assign]
    client = sentinel.master_for("locks")
    store = LockStore(client=client)
    try:
        old = native_server.client()
        old.flushall()
        lock = RedisLock(client, KEY, ttl=30, store=store, renew=False)
        assert lock.acquire(blocking=False)
        assert store.release(KEY + "warm", MINE) is ReleaseOutcome.ALREADY_GONE
        # The failover: the new master has no key (lost), the old one follows it.
        old.execute_command("REPLICAOF", "127.0.0.1", new.port)
        master["address"] = ("127.0.0.1", new.port)
        wait_until(
            lambda: (
                old.info("replication").get("master_link_status") == "up" and old.exists(KEY) == 0
            ),
            timeout=20,
            message="the old master to follow the new one",
        )
        handle = lock.handle
        assert handle is not None
        assert lock.release() is ReleaseOutcome.ALREADY_GONE
        assert handle.lost_reason == "gone"  # reported as a loss
    finally:
        native_server.client().execute_command("REPLICAOF", "NO", "ONE")
        store.close()
        client.close()
        new.close()


@pytest.mark.parametrize("loss", ["gone", "stolen"])
def test_a_loss_between_the_scripts_answer_and_the_hand_over_is_reported(
    native_server: RedisServer,
    client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    loss: str,
) -> None:
    """Ours and marked (2), then lost before the full release: a loss, not a retry (helper-37 A).

    Through the scripts (a user without DELIFEQ): the lean script's answer
    was read, so the full release that follows is a first attempt.
    """
    reports: list[str] = []

    def on_lost(sender: Any = None, **named: Any) -> None:
        reports.append(named["reason"])

    lock_lost.connect(on_lost, weak=False)
    real = evalsha.send_and_read

    def lose_after_the_lean_answer(connection: Any, packed: bytes, count: int) -> list[Any]:
        replies = real(connection, packed, count)
        if scripts.RELEASE.sha.encode() in packed and replies == [2]:
            if loss == "gone":
                client.delete(KEY)
            else:
                client.set(KEY, OTHER, px=30_000)
        return replies

    monkeypatch.setattr(evalsha, "send_and_read", lose_after_the_lean_answer)
    url = f"redis://nodelifeq:s3cret@127.0.0.1:{native_server.port}/0"
    store = LockStore(url)
    try:
        assert store.release(KEY + "warm", MINE) is ReleaseOutcome.ALREADY_GONE  # DELIFEQ refused
        lock = RedisLock(client, KEY, ttl=30, store=store, renew=False)
        assert lock.acquire(blocking=False)
        client.append(KEY, WAITING)  # a waiter marked it
        expected = ReleaseOutcome.ALREADY_GONE if loss == "gone" else ReleaseOutcome.NOT_OURS
        assert lock.release() is expected
        assert reports == [loss]
    finally:
        lock_lost.disconnect(on_lost)
        store.close()
