"""Redis Cluster under resharding and outages (release review, helper-8): each failed before.

A 2-master cluster per test (it is killed, frozen or resharded), joined by commands.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from redis.cluster import RedisCluster

from celery_redislock import LockBackendError, RedisLock
from celery_redislock.store import LockStore, RenewOutcome
from tests.servers import RedisClusterServers, RedisServer, cluster_node, free_port, wait_until

pytestmark = pytest.mark.slow

KEY = "redislock:t:{moves}"
HOLDER = "v1|holder|0|elsewhere|1|ab|job|0"
QUICK = {"socket_timeout": 0.3, "socket_connect_timeout": 0.3}


@pytest.fixture
def cluster() -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers(masters=2)
    yield servers
    servers.close()


def _move_slot(cluster: RedisClusterServers, key: str) -> RedisServer:
    """Reshard ``key``'s slot, keys included, to the other master; return that master."""
    target, finish = cluster.start_migration(key)
    finish()
    return target


def _script_calls(node: RedisServer) -> int:
    stats = node.client().info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_held_lock_is_renewed_on_the_master_its_slot_moved_to(
    cluster: RedisClusterServers,
) -> None:
    """A resharding moves the key; its renewals follow the redirection, the lock is never lost."""
    client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    lock = RedisLock(client, KEY, ttl=1.5)
    try:
        assert lock.acquire()
        target = _move_slot(cluster, KEY)
        renewed_before = _script_calls(target)
        # Two renewals (every TTL/3 = 0.5 s) reach the new master, within 2 TTLs.
        wait_until(
            lambda: _script_calls(target) >= renewed_before + 2,
            timeout=3.0,
            interval=0.05,
            message="renewals on the master the slot moved to",
        )
        assert not lock.handle.lost
        assert target.client().pttl(KEY) > 0
        assert lock.release() is not None
    finally:
        client.close()


def test_an_unreachable_cluster_is_a_lock_store_error_and_never_escapes_a_release(
    cluster: RedisClusterServers,
) -> None:
    store = LockStore(cluster.url, QUICK)
    cluster.node_holding(KEY).client().set(KEY, HOLDER, px=60_000)
    contended = store.acquire(KEY, "v1|me|0|h|1|n|job|0", 30_000)
    assert not contended.acquired
    client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port, **QUICK)
    lock = RedisLock(client, "redislock:t:{other}", ttl=30)
    try:
        assert lock.acquire()
        for node in cluster.nodes:
            node.kill()
        assert contended.ttl_remaining is None  # unknown, not an exception
        assert lock.release() is None  # logged; the TTL frees the key
    finally:
        client.close()


def test_a_cluster_url_no_node_of_which_answers_is_a_lock_store_error() -> None:
    # redis-py's cluster client raises RedisClusterException (not a
    # RedisError) when no startup node answers (helper-44).
    store = LockStore(f"redis+cluster://127.0.0.1:{free_port()}", QUICK)
    with pytest.raises(LockBackendError, match="unavailable"):
        store.acquire(KEY, "v1|me|0|h|1|n|job|0", 30_000)
    with pytest.raises(LockBackendError, match="unavailable"):
        store.release(KEY, "v1|me|0|h|1|n|job|0")
    with pytest.raises(LockBackendError, match="unavailable"):
        store.inspect(KEY)


def test_a_release_against_a_frozen_cluster_gives_up_within_its_short_timeout(
    cluster: RedisClusterServers,
) -> None:
    """Releases have their own short timeout: a frozen cluster must not hold a task 5 s per node."""
    store = LockStore(cluster.url)  # the client's timeouts: 5 s; the releases': 0.5 s, one retry
    lock = RedisLock(store.client, KEY, ttl=30, store=store)
    assert lock.acquire()
    for node in cluster.nodes:
        node.pause()
    try:
        started = time.monotonic()
        assert lock.release() is None
        took = time.monotonic() - started
    finally:
        for node in cluster.nodes:
            node.resume()
    assert took < 2.5, f"the release took {took:.1f}s"


def test_renewals_follow_a_failover_to_the_promoted_replica() -> None:
    """The key's master dies, its replica takes over with the key: renewals reach the replica.

    A dead node never answers MOVED: the renewals must read the slot map
    again after failing on it, or the lock expires while its holder lives.
    """
    cluster = RedisClusterServers(masters=3)
    replica: RedisServer | None = None
    try:
        replica = cluster_node()
        promoted = replica
        promoted.client().execute_command("CLUSTER", "MEET", "127.0.0.1", cluster.nodes[0].port)
        master = cluster.node_holding(KEY)
        myid = master.client().cluster("myid")
        master_id = myid.decode() if isinstance(myid, bytes) else str(myid)

        def knows_master() -> bool:
            nodes = promoted.client().execute_command("CLUSTER", "NODES")
            text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
            return master_id in text

        wait_until(knows_master, timeout=20, interval=0.1, message="the replica to meet the master")
        promoted.client().execute_command("CLUSTER", "REPLICATE", master_id)
        wait_until(
            lambda: promoted.client().info("replication").get("master_link_status") == "up",
            timeout=20,
            interval=0.1,
            message="the replica's sync",
        )
        client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        store = LockStore(client=client)
        value = "v1|holder|0|here|1|ab|job|0"
        assert store.acquire(KEY, value, 3_000).acquired
        assert store.renew_many([(KEY, value, 3_000)]) == [RenewOutcome.RENEWED]
        wait_until(
            lambda: promoted.client().info("keyspace").get("db0", {}).get("keys", 0) >= 1,
            timeout=20,
            interval=0.05,
            message="the key on the replica",
        )
        master.kill()
        promoted.client().execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        wait_until(
            lambda: promoted.client().info("replication").get("role") == "master",
            timeout=10,
            interval=0.05,
            message="the replica's promotion",
        )
        renewed: list[list[RenewOutcome]] = []

        def renews() -> bool:
            try:
                renewed.append(store.renew_many([(KEY, value, 60_000)]))
            except LockBackendError:
                return False
            return True

        # Within the lock's TTL (3 s): it must not expire on the promoted replica.
        wait_until(renews, timeout=2.5, interval=0.1, message="a renewal on the promoted replica")
        assert renewed[-1] == [RenewOutcome.RENEWED]
        assert promoted.client().pttl(KEY) > 50_000
        client.close()
    finally:
        if replica is not None:
            replica.close()
        cluster.close()
