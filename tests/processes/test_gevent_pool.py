"""`celery worker -P gevent`: greenlets and the native renewer thread never share a socket."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_redislock import is_skipped
from tests.processes.test_crash import Cluster, revoke_twice_during_the_slow_cleanup
from tests.servers import wait_until

pytest.importorskip("gevent")

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


@pytest.fixture
def cluster(redis_server_factory: Any) -> Iterator[Cluster]:
    c = Cluster(redis_server_factory())
    yield c
    c.close()


def test_gevent_pool_releases_and_renews_every_lock(cluster: Cluster) -> None:
    worker = cluster.worker(ttl=30, pool="gevent", concurrency=50)
    random.seed(7)
    results = [
        cluster.send("green_hold", f"g{n % 60}", random.uniform(0.0, 0.5)) for n in range(600)
    ]
    outcomes = [result.get(timeout=60) for result in results]
    ran = [o for o in outcomes if not is_skipped(o)]
    log = worker.log()
    problems = [
        line
        for line in log.splitlines()
        if any(
            marker in line
            for marker in (
                "could not release",
                "could not renew",
                "was lost",
                "Cannot switch",
                "renewal tick failed",
                "renewer tick failed",
            )
        )
    ]
    summary = f"{len(ran)} ran, {sum(ran)} renewals, {len(problems)} problems"
    print(f"\n[measured] gevent -c 50: {summary}")
    assert problems == [], problems[:5]
    assert len(ran) >= 60 and sum(ran) > 0
    assert [k for k in cluster.locks.scan_iter("redislock:*") if not k.endswith(":fence")] == []


def test_terminate_stores_revoked_only_once_the_greenlets_own_cleanup_released(
    cluster: Cluster,
) -> None:
    """gevent kills the greenlet and goes on: its ``finally`` would run after REVOKED."""
    worker = cluster.worker(ttl=30, pool="gevent", concurrency=10)
    first = cluster.send("quick_cleanup", "green")
    key = cluster.started(first.id)["key"]
    cluster.producer.control.revoke(first.id, terminate=True)
    wait_until(lambda: first.state == "REVOKED", timeout=15, interval=0.005)
    held = cluster.locks.exists(key)
    done = cluster.record.lrange("events:green", 0, -1)
    assert held == 0 and done == ["cleanup-done"], (held, done, worker.log()[-3000:])


def test_a_revoke_of_many_kills_them_all_at_once_and_each_revoked_is_stored_once_released(
    cluster: Cluster,
) -> None:
    """Each waits for its own release; none waits for another's (8 x 0.3 s if they queued)."""
    cluster.worker(ttl=30, pool="gevent", concurrency=20)
    names = [f"green{n}" for n in range(8)]
    results = [cluster.send("quick_cleanup", name) for name in names]
    keys = {r.id: cluster.started(r.id)["key"] for r in results}
    sent = time.monotonic()
    cluster.producer.control.revoke([r.id for r in results], terminate=True)
    held_at_revoked = {}
    for result in results:
        wait_until(lambda r=result: r.state == "REVOKED", timeout=15, interval=0.005)
        held_at_revoked[result.id] = cluster.locks.exists(keys[result.id])
    elapsed = time.monotonic() - sent
    assert sorted(held_at_revoked.values()) == [0] * 8
    assert all(cluster.record.lrange(f"events:{n}", 0, -1) == ["cleanup-done"] for n in names)
    assert elapsed < 1.5, elapsed  # killed one by one, the last would come after 2.4 s


def test_a_second_revoke_neither_cuts_the_cleanup_short_nor_stores_revoked_before_the_release(
    cluster: Cluster,
) -> None:
    """Revoked twice while its 1.5 s ``finally`` runs: one kill, REVOKED once the greenlet ended.

    REVOKED waits for the killed greenlet itself, however long its cleanup
    takes (as prefork's waits for the child's exit); a second revoke while
    it waits kills nothing again (Celery would have forgotten the request).
    """
    worker = cluster.worker(ttl=30, pool="gevent", concurrency=10)
    revoke_twice_during_the_slow_cleanup(cluster, worker, "Terminating")


def test_a_greenlet_that_survives_the_kill_ends_its_task_and_is_announced_revoked_once(
    cluster: Cluster,
) -> None:
    """As Celery does, REVOKED is announced; its SUCCESS, stored first, stays."""
    cluster.worker(ttl=30, pool="gevent", concurrency=10)
    survivor = cluster.send("survives_kill", "stubborn")
    key = cluster.started(survivor.id)["key"]
    cluster.producer.control.revoke(survivor.id, terminate=True)
    assert survivor.get(timeout=15) == "stubborn"
    wait_until(lambda: cluster.record.get(f"revoked:{survivor.id}") == "1", timeout=15)
    assert cluster.send("hold", "after", 0).get(timeout=15)  # a second one would be in by then
    assert cluster.record.get(f"revoked:{survivor.id}") == "1"
    assert survivor.state == "SUCCESS" and cluster.locks.exists(key) == 0
    assert cluster.record.lrange("events:stubborn", 0, -1) == ["killed"]


def test_a_sigkill_revoke_kills_again_a_greenlet_that_survived_the_first_kill(
    cluster: Cluster,
) -> None:
    """A repeat is ignored while REVOKED waits, unless it asks for SIGKILL (as for prefork)."""
    cluster.worker(ttl=30, pool="gevent", concurrency=10)
    survivor = cluster.send("survives_kill", "stubborn", 30)
    key = cluster.started(survivor.id)["key"]
    cluster.producer.control.revoke(survivor.id, terminate=True)
    wait_until(lambda: cluster.record.lrange("events:stubborn", 0, -1) == ["killed"])
    cluster.producer.control.revoke(survivor.id, terminate=True, signal="SIGKILL")
    wait_until(lambda: survivor.state == "REVOKED", timeout=15, interval=0.005)
    assert cluster.locks.exists(key) == 0
    assert cluster.send("hold", "after", 0).get(timeout=15)  # a second one would be in by then
    assert cluster.record.get(f"revoked:{survivor.id}") == "1"
