"""Redis Cluster: a real 3-master cluster on free ports (joined by commands, no redis-cli)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from redis.cluster import RedisCluster

from celery_redislock import RedisLock, SingletonTask, is_skipped
from celery_redislock.admin import LockInventory
from celery_redislock.keys import fence_key, slot_keys
from celery_redislock.settings import forget_app_settings
from celery_redislock.store import RENEW_CHUNK_SIZE, LockStore, ReleaseOutcome, RenewOutcome
from tests.servers import RedisClusterServers, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers()
    yield servers
    servers.close()


@pytest.fixture
def client(cluster: RedisClusterServers) -> Iterator[RedisCluster]:
    client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    client.flushall(target_nodes=RedisCluster.PRIMARIES)
    yield client
    client.close()


def evalsha_calls(cluster: RedisClusterServers) -> int:
    total = 0
    for node in cluster.nodes:
        stats = node.client().info("commandstats")
        total += int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
    return total


def test_task_locks_spread_over_every_master_and_contend(
    cluster: RedisClusterServers, client: RedisCluster
) -> None:
    app = Celery("cluster", set_as_current=False)
    app.conf.update(broker_url="memory://", redislock_url=cluster.url)
    nodes_used: set[int] = set()

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: Any, n: int) -> int:
        node = cluster.node_holding(self.lock.key)
        assert self.lock.fence > 0  # issued on demand, on the key's node
        assert node.client().exists(self.lock.key, fence_key(self.lock.key)) == 2
        nodes_used.add(node.port)
        return n

    assert [job.apply((n,)).get() for n in range(30)] == list(range(30))
    assert nodes_used == {node.port for node in cluster.nodes}
    keys = sum(int(node.client().dbsize()) for node in cluster.nodes)
    assert keys == 0  # each release took its fence counter along (issue 13)

    entered, leave = threading.Event(), threading.Event()

    @app.task(base=SingletonTask, bind=True, shared=False)
    def slow(self: Any) -> str:
        entered.set()
        leave.wait(20)
        return "ran"

    holder = threading.Thread(target=lambda: slow.apply(), daemon=True)
    holder.start()
    assert entered.wait(20)
    try:
        assert is_skipped(slow.apply().get())
        listed = LockInventory(app).locks()
        assert [record.task_name for record in listed] == [slow.name]
    finally:
        leave.set()
        holder.join(20)
    assert LockInventory(app).locks() == []
    forget_app_settings(app)


def test_renewal_groups_keys_by_slot_and_keeps_the_callers_order(
    cluster: RedisClusterServers, client: RedisCluster
) -> None:
    backend = LockStore(client=client)
    same_slot = [f"{{tenant}}:job:{i}" for i in range(600)]  # one slot: 3 chunks of <= 250
    spread = [f"job:{i}" for i in range(30)]  # 30 keys, whatever slots they hash to
    items = []
    for key in same_slot + spread:
        assert backend.acquire(key, "mine", 10_000).acquired
        items.append((key, "mine", 10_000))
    client.delete(same_slot[7])
    client.set(spread[3], "theirs")
    slots = {client.keyslot(key) for key in spread} | {client.keyslot(same_slot[0])}
    calls_before = evalsha_calls(cluster)
    outcomes = backend.renew_many(items)
    calls = evalsha_calls(cluster) - calls_before
    # one script call per slot, one per chunk for the 600-key slot
    assert RENEW_CHUNK_SIZE == 250
    assert calls == len(slots) + 2
    expected = [RenewOutcome.RENEWED] * len(items)
    expected[7] = RenewOutcome.GONE
    expected[600 + 3] = RenewOutcome.STOLEN
    assert outcomes == expected


def test_standalone_locks_on_a_cluster_client_are_renewed_and_released(
    client: RedisCluster,
) -> None:
    locks = [RedisLock(client, name, ttl=0.6) for name in ("plain-name", "{tagged}:name")]
    for lock in locks:
        assert lock.acquire(blocking=False)
        assert lock.handle is not None and lock.handle.fence is not None
    handles = [lock.handle for lock in locks]
    wait_until(lambda: all(h is not None and h.renewals >= 3 for h in handles), timeout=10)
    assert not any(lock.lost for lock in locks)
    for lock in locks:
        lock.release()
    assert client.exists("plain-name", "{tagged}:name") == 0


def test_a_waiter_is_woken_by_the_release_over_cluster_pubsub(client: RedisCluster) -> None:
    holder = RedisLock(client, "shared-job", ttl=30)
    assert holder.acquire(blocking=False)
    timer = threading.Timer(0.5, holder.release)
    timer.start()
    waiter = RedisLock(client, "shared-job", ttl=30)
    started = time.monotonic()
    try:
        assert waiter.acquire(blocking=True, timeout=10)
        waited = time.monotonic() - started
    finally:
        timer.join()
        waiter.release()
    assert 0.4 <= waited < 5.0, waited  # the release woke it, long before the 30 s TTL


def test_lock_limit_slots_share_one_hash_slot_and_work_on_a_cluster(
    cluster: RedisClusterServers, client: RedisCluster
) -> None:
    store = LockStore(cluster.url)
    key = "redislock:proj.export:{tenant-7}"
    slots = slot_keys(key, 3)
    assert len({client.keyslot(k) for k in [*slots, fence_key(key)]}) == 1
    values = [f"v1|t{i}|0|h|{i}|n|proj.export|0" for i in range(4)]
    taken = [store.acquire_slot(key, 3, value, 30000) for value in values]
    assert [t.key for t in taken[:3]] == slots and not taken[3].acquired
    fences = [store.fence(t.key or key, v) for t, v in zip(taken[:3], values, strict=False)]
    assert fences == sorted(fences) and len(set(fences)) == 3  # type: ignore[type-var]
    renewed = store.renew_many([(k, v, 60000) for k, v in zip(slots, values, strict=False)])
    assert renewed == [RenewOutcome.RENEWED] * 3
    assert store.release_slot_of(key, 3, "v1|t1|0|h|1|", "prefix") is ReleaseOutcome.RELEASED
    assert client.exists(slots[1]) == 0 and client.exists(slots[0], slots[2]) == 2
    store.close()


@pytest.mark.parametrize("name", ["a}b", "{}", "x{}y{z}", "a}:slot:2"])
def test_a_name_with_braces_but_no_hash_tag_fences_waits_and_releases_on_a_cluster(
    client: RedisCluster, name: str
) -> None:
    holder = RedisLock(client, name, ttl=30)
    assert holder.acquire(blocking=False)
    first = holder.fence  # its counter must share the name's slot
    assert first is not None
    waiter = RedisLock(client, name, ttl=30)
    acquired: list[bool] = []
    thread = threading.Thread(target=lambda: acquired.append(waiter.acquire(timeout=10)))
    thread.start()
    try:
        # Released once the waiter marked it waited for: the full release runs.
        wait_until(lambda: (client.get(name) or b"").endswith(b"|w"), timeout=10)
        assert holder.release() is ReleaseOutcome.RELEASED
    finally:
        thread.join(15)
    assert acquired == [True]  # woken by the release, long before the TTL
    assert waiter.fence is not None and waiter.fence > first
    assert waiter.release() is ReleaseOutcome.RELEASED
    assert client.exists(name) == 0
