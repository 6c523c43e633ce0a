"""Redis Sentinel: a real master, replica and sentinel on free ports, and a failover.

The replica replicates through a FaultProxy, so a test can hold back
replication at a chosen moment: that is how a lock acquired on the master
but never replicated is produced, the documented risk of asynchronous
replication.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery import Celery

from celery_redislock import LockBackendError, SingletonTask, Wait, lock_lost
from celery_redislock.fencing import FencedStore, StaleFence
from celery_redislock.settings import forget_app_settings
from tests.servers import FaultProxy, RedisServer, SentinelServer, wait_until

pytestmark = [pytest.mark.fault, pytest.mark.slow]

SERVICE = "locks"


@dataclass
class Topology:
    master: RedisServer
    link: FaultProxy  # master -> replica replication traffic
    replica: RedisServer
    sentinel: SentinelServer

    @property
    def url(self) -> str:
        return f"sentinel://127.0.0.1:{self.sentinel.port}/{SERVICE}/0"

    def master_port(self) -> int:
        _host, port = self.sentinel.client().sentinel_get_master_addr_by_name(SERVICE)
        return int(port)


@pytest.fixture
def topology() -> Iterator[Topology]:
    master = RedisServer()
    link = FaultProxy(master.port)
    replica = RedisServer("--replicaof", "127.0.0.1", str(link.port))
    sentinel: SentinelServer | None = None
    try:
        wait_until(
            lambda: replica.client().info("replication")["master_link_status"] == "up",
            timeout=20,
            message="the replica to sync",
        )
        sentinel = SentinelServer(SERVICE, master.port, down_after_ms=1000)

        def replica_known() -> bool:
            replicas = sentinel.client().sentinel_slaves(SERVICE)  # type: ignore[union-attr]
            return any(
                int(r["port"]) == replica.port and "disconnected" not in r["flags"]
                for r in replicas
            )

        wait_until(replica_known, timeout=30, message="the sentinel to see the replica")
        yield Topology(master, link, replica, sentinel)
    finally:
        if sentinel is not None:
            sentinel.close()
        link.close()
        replica.close()
        master.close()


@pytest.fixture
def losses() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    lock_lost.connect(receiver, weak=False)
    yield seen
    lock_lost.disconnect(receiver)


def make_app(topology: Topology, **conf: Any) -> Celery:
    app = Celery("sentinel", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        redislock_url=topology.url,
        redislock_redis_options={"socket_timeout": 1.0, "socket_connect_timeout": 1.0},
        redislock_backend_error_max_retries=0,
        **conf,
    )
    return app


def test_locking_follows_a_failover_and_an_unreplicated_lock_is_reported_lost(
    topology: Topology, losses: list[dict[str, Any]]
) -> None:
    app = make_app(topology, redislock_ttl=12.0)
    store = FencedStore(topology.replica.client(5))  # survives the failover
    started: dict[str, threading.Event] = {}
    finish = threading.Event()
    fences: dict[str, list[int]] = {}

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: Any, name: str) -> str:
        fences.setdefault(name, []).append(self.lock.fence)
        started[name].set()
        finish.wait(60)
        return "lost" if self.lock.lost else "held"

    def run(name: str) -> threading.Thread:
        started[name] = threading.Event()
        thread = threading.Thread(target=lambda: job.apply((name,)), daemon=True)
        thread.start()
        assert started[name].wait(20)
        return thread

    timeline: list[str] = []
    t0 = time.monotonic()

    def mark(event: str) -> None:
        timeline.append(f"{time.monotonic() - t0:6.2f}s  {event}")

    try:
        replicated = run("replicated")
        replicated_key = job.lock_key_for(("replicated",), {})
        wait_until(lambda: topology.replica.client().exists(replicated_key), timeout=10)
        mark(f"lock A taken on the master (:{topology.master.port}) and replicated")
        topology.link.blackhole()
        unreplicated = run("unreplicated")
        unreplicated_key = job.lock_key_for(("unreplicated",), {})
        mark("replication held back; lock B taken on the master only")
        topology.master.kill()
        topology.link.close()  # what it held back is gone with the master
        mark("master SIGKILLed")
        wait_until(
            lambda: topology.master_port() == topology.replica.port,
            timeout=30,
            interval=0.05,
            message="the sentinel to promote the replica",
        )
        mark(f"sentinel promoted the replica (:{topology.replica.port})")
        assert topology.replica.client().exists(unreplicated_key) == 0

        lost = wait_until(
            lambda: [e for e in losses if e["key"] == unreplicated_key],
            timeout=15,
            message="the unreplicated lock to be reported lost",
        )
        mark(f"lock B reported lost ({lost[0]['reason']}) by its renewer")
        assert lost[0]["reason"] == "gone"

        # A new run of B on the new master gets a larger fence; B's old
        # holder can no longer write behind it.
        successor_run = run("unreplicated")
        stale_fence, new_fence = fences["unreplicated"]
        assert new_fence > stale_fence
        mark("lock B taken again on the new master, with a larger fence")
        store.write_or_raise("resource-b", "from the new holder", new_fence)
        with pytest.raises(StaleFence):
            store.write_or_raise("resource-b", "from the old holder", stale_fence)

        # Lock A was replicated: its renewer carries on against the new master.
        renewed_after = time.monotonic()
        wait_until(
            lambda: (
                topology.replica.client().pttl(replicated_key) > 9000
                and time.monotonic() - renewed_after > 2.5
            ),
            timeout=15,
            message="lock A to be renewed on the new master",
        )
        mark("lock A renewed on the new master; not lost")
        assert [e for e in losses if e["key"] == replicated_key] == []
    finally:
        finish.set()
    for thread in (replicated, unreplicated, successor_run):
        thread.join(20)
    assert topology.replica.client().exists(replicated_key) == 0, "A was not released"
    mark("both released on the new master")
    print("\n[measured] sentinel failover timeline:\n  " + "\n  ".join(timeline))
    forget_app_settings(app)


def test_min_replicas_refuses_a_lock_no_replica_acknowledged(topology: Topology) -> None:
    app = make_app(topology, redislock_min_replicas=1, redislock_min_replicas_timeout=0.3)

    @app.task(base=SingletonTask, shared=False)
    def job(n: int) -> int:
        return n

    assert job.apply((1,)).get() == 1  # the replica acknowledged
    topology.link.blackhole()
    started = time.monotonic()
    result = job.apply((2,))
    waited = time.monotonic() - started
    assert result.failed() and isinstance(result.result, LockBackendError)
    assert "0 of 1 replica" in str(result.result)
    assert 0.3 <= waited < 3.0
    key = job.lock_key_for((2,), {})
    assert topology.master.client().exists(key) == 0, "the unacknowledged lock was left behind"
    forget_app_settings(app)


def test_a_waiter_through_sentinel_listens_on_the_master_and_is_woken_by_the_release(
    topology: Topology,
) -> None:
    """The wait policy's subscription resolves the master as every other connection does.

    (It used to be opened at redis-py's default address, localhost:6379: refused
    there, or, with a Redis on that port, never woken.)
    """
    app = make_app(topology, redislock_ttl=20.0)
    entered, leave = threading.Event(), threading.Event()
    ran: list[str] = []

    @app.task(base=SingletonTask, shared=False, lock_args=(), lock_on_contention=Wait(15))
    def job(label: str) -> str:
        ran.append(label)
        if label == "holder":
            entered.set()
            leave.wait(30)
        return label

    holder = threading.Thread(target=lambda: job.apply(("holder",)), daemon=True)
    holder.start()
    assert entered.wait(20)
    waiter_done: list[float] = []
    waiter = threading.Thread(
        target=lambda: (job.apply(("waiter",)), waiter_done.append(time.monotonic())), daemon=True
    )
    waiter.start()
    channel = f"{job.lock_key_for(('x',), {})}:released"
    master = topology.master.client()
    wait_until(lambda: master.pubsub_numsub(channel)[0][1] == 1, timeout=10)
    released_at = time.monotonic()
    leave.set()
    waiter.join(20)
    holder.join(20)
    assert ran == ["holder", "waiter"]
    assert waiter_done[0] - released_at < 3.0  # woken by the release, not the 20 s TTL
    forget_app_settings(app)
