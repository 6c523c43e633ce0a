"""The standalone RedisLock: context manager, decorator, blocking acquire."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
import redis.asyncio

from celery_redislock import (
    ConfigurationError,
    LockContended,
    LockNotOwned,
    RedisLock,
    ReleaseOutcome,
)
from tests.conftest import LOCK_DB
from tests.servers import RedisServer, server_busy, wait_until


def test_context_manager_acquires_and_releases(lock_client: redis.Redis) -> None:
    with RedisLock(lock_client, "cm", ttl=5) as lock:
        assert lock.owned
        assert lock_client.pttl("cm") > 4000
    assert lock_client.exists("cm") == 0
    assert not lock.owned


def test_non_blocking_acquire_on_a_held_lock(lock_client: redis.Redis) -> None:
    holder = RedisLock(lock_client, "nb")
    assert holder.acquire()
    other = RedisLock(lock_client, "nb")
    assert other.acquire(blocking=False) is False
    assert other.release() is None
    assert holder.release() is ReleaseOutcome.RELEASED


def test_with_times_out_with_lock_contended(lock_client: redis.Redis) -> None:
    holder = RedisLock(lock_client, "to")
    holder.acquire()
    with pytest.raises(LockContended) as info, RedisLock(lock_client, "to", timeout=0.2):
        pass
    assert info.value.key == "to" and info.value.ttl_remaining is not None
    holder.release()


def test_blocking_acquire_takes_the_lock_when_released(lock_client: redis.Redis) -> None:
    holder = RedisLock(lock_client, "handoff", ttl=30)
    holder.acquire()
    threading.Timer(0.2, holder.release).start()
    waiter = RedisLock(lock_client, "handoff", ttl=30)
    assert waiter.acquire(timeout=10)
    assert waiter.owned
    waiter.release()


def test_decorator_serialises_concurrent_calls(lock_client: redis.Redis) -> None:
    active = 0
    peak = 0
    guard = threading.Lock()

    @RedisLock(lock_client, "decorated", ttl=5, timeout=30)
    def critical(n: int) -> int:
        nonlocal active, peak
        with guard:
            active += 1
            peak = max(peak, active)
        threading.Event().wait(0.005)
        with guard:
            active -= 1
        return n

    with ThreadPoolExecutor(8) as pool:
        assert sorted(pool.map(critical, range(40))) == list(range(40))
    assert peak == 1
    assert lock_client.exists("decorated") == 0


def test_extend_and_extend_after_loss(lock_client: redis.Redis) -> None:
    lock = RedisLock(lock_client, "ext", ttl=2, renew=False)
    lock.acquire()
    lock.extend(60)
    assert lock_client.pttl("ext") > 50000
    lock_client.delete("ext")
    with pytest.raises(LockNotOwned, match="gone"):
        lock.extend()
    assert lock.lost
    with pytest.raises(LockNotOwned):
        RedisLock(lock_client, "never").extend()


def test_acquiring_twice_on_one_object_is_an_error(lock_client: redis.Redis) -> None:
    lock = RedisLock(lock_client, "twice")
    lock.acquire()
    with pytest.raises(RuntimeError, match="already held"):
        lock.acquire()
    lock.release()


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), "5", None])
def test_bad_ttl_is_rejected(lock_client: redis.Redis, ttl: object) -> None:
    with pytest.raises(ConfigurationError, match="ttl"):
        RedisLock(lock_client, "bad", ttl=ttl)  # type: ignore[arg-type]


def test_bad_name_is_rejected(lock_client: redis.Redis) -> None:
    with pytest.raises(ConfigurationError, match="name"):
        RedisLock(lock_client, "")


@pytest.mark.parametrize(
    "client",
    [
        pytest.param(lambda: redis.asyncio.Redis(port=1), id="asyncio-client"),
        pytest.param(lambda: "redis://localhost:6379/0", id="url"),
        pytest.param(lambda: None, id="none"),
    ],
)
def test_a_client_that_is_not_a_sync_redis_client_is_refused_when_made(client: Any) -> None:
    """Review helper-54 F3: an asyncio client's acquire() returned False, as if contended."""
    with pytest.raises(ConfigurationError, match=r"redis\.Redis or RedisCluster client"):
        RedisLock(client(), "k")


@pytest.mark.parametrize("option", ["blocking", "renew", "reentrant"])
def test_a_flag_that_is_not_a_bool_is_refused_when_made(
    lock_client: redis.Redis, option: str
) -> None:
    """``"no"`` read as true (review helper-54 F3)."""
    with pytest.raises(ConfigurationError, match=f"{option} must be True or False"):
        RedisLock(lock_client, "k", **{option: "no"})
    lock = RedisLock(lock_client, "k")
    with pytest.raises(ConfigurationError, match="blocking must be True or False"):
        lock.acquire(blocking="no")  # type: ignore[arg-type]
    assert not lock_client.exists("k")


def test_short_lived_clients_leave_no_file_descriptors_or_objects_behind(
    redis_server_factory: Any,
) -> None:
    server = redis_server_factory()  # its own port: only this test's clients use it

    def sockets_to_server() -> int:
        # Sockets of this process connected to this test's server: the
        # process's whole descriptor count also moves with what earlier tests
        # left running in this pytest worker (make test saw 14 -> 37 so).
        own = set()
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("socket:["):
                    own.add(target[8:-1])
        with open("/proc/self/net/tcp") as table:
            rows = [line.split() for line in table.readlines()[1:]]
        return sum(
            1 for row in rows if int(row[2].split(":")[1], 16) == server.port and row[9] in own
        )

    def live(kind: type) -> int:
        # type(), not isinstance(): isinstance reads __class__, which lazy
        # proxies in memory (Django's unconfigured settings) answer by raising.
        return sum(1 for obj in gc.get_objects() if issubclass(type(obj), kind))

    def one_client(n: int, close: bool) -> None:
        client = server.client(LOCK_DB)
        with RedisLock(client, f"short-lived:{n}", ttl=5):
            pass
        if close:
            client.close()

    one_client(-1, True)  # warm-up: the renewer thread and module state exist from here
    gc.collect()
    sockets, clients, pools = sockets_to_server(), live(redis.Redis), live(redis.ConnectionPool)
    for n in range(1000):
        one_client(n, close=n % 2 == 0)  # half are closed, half just dropped
    gc.collect()
    print(
        f"\n[measured] 1,000 short-lived clients: sockets to the server "
        f"{sockets} -> {sockets_to_server()}"
    )

    def collected() -> bool:
        # gc.collect() returns at once, collecting nothing, while another
        # thread's collection runs (threads earlier tests left in this pytest
        # worker allocate too): CI counted 25, then 4 a moment later. Collect
        # until the dropped clients are gone; a leak never gets there.
        gc.collect()
        return sockets_to_server() <= sockets + 2

    wait_until(collected, timeout=10, interval=0.1)
    assert live(redis.Redis) <= clients and live(redis.ConnectionPool) <= pools
    witness = server.client(LOCK_DB)
    witness.ping()  # the count sees a connection left open
    assert sockets_to_server() == sockets + 1
    witness.close()


def test_an_acquire_that_timed_out_is_taken_over_by_the_next_acquire(server: RedisServer) -> None:
    """Redis busy, not down: the acquire gives up, its script runs afterwards."""

    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from celery_redislock import LockBackendError

    client = server.client(LOCK_DB, socket_timeout=0.3, retry=Retry(NoBackoff(), 0))
    lock = RedisLock(client, "busy-store", ttl=30)
    assert lock.acquire(blocking=False)
    lock.release()
    with server_busy(server, 1), pytest.raises(LockBackendError):
        lock.acquire(blocking=False)
    # The next acquire takes the late value over, or finds it already taken
    # back in the background: either way it does not wait out the TTL.
    after = RedisLock(client, "busy-store", ttl=30)
    assert after.acquire(blocking=False)
    after.release()  # a plain acquire is renewed until released: never leave it to later tests


def test_an_acquire_that_timed_out_is_taken_back_when_no_acquire_follows(
    server: RedisServer,
) -> None:

    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from celery_redislock import LockBackendError
    from celery_redislock.lock import _UNSETTLED
    from tests.servers import wait_until

    client = server.client(LOCK_DB, socket_timeout=0.3, retry=Retry(NoBackoff(), 0))
    lock = RedisLock(client, "busy-store-2", ttl=30)
    assert lock.acquire(blocking=False)
    lock.release()
    admin = server.client(LOCK_DB)
    with server_busy(server, 1), pytest.raises(LockBackendError):
        lock.acquire(blocking=False)
    wait_until(lambda: admin.exists("busy-store-2") == 0, timeout=15, message="late value")
    # Acquires that settle leave no per-name entries behind (bounded memory).
    for n in range(200):
        with RedisLock(client, f"many-{n}", ttl=5):
            pass
    names = {name for per_name in _UNSETTLED.values() for name in per_name}
    assert not {name for name in names if name.startswith("many-")}


def test_a_with_lock_whose_exit_never_ran_stops_renewing_and_is_taken_back(
    lock_client: redis.Redis,
) -> None:
    """An exception on __exit__'s first instruction skips its release: the
    dropped lock object must not stay renewed for ever."""
    from celery_redislock.renewer import renewer
    from tests.servers import wait_until

    lock = RedisLock(lock_client, "abandoned", ttl=0.6)
    lock.__enter__()  # what `with` does; its __exit__ is then never called
    del lock
    gc.collect()
    wait_until(lambda: lock_client.exists("abandoned") == 0, timeout=10, message="renewed")
    held = [*renewer()._handles.values(), *renewer()._scoped.values()]
    assert "abandoned" not in [handle.key for handle in held]


def test_a_lock_nobody_keeps_a_reference_to_is_still_renewed(lock_client: redis.Redis) -> None:
    """`if RedisLock(client, name).acquire(): work()` keeps the lock while work() runs."""
    assert RedisLock(lock_client, "unreferenced", ttl=0.3).acquire(blocking=False)
    gc.collect()
    value = lock_client.get("unreferenced")
    from celery_redislock.renewer import renewer

    trips = renewer().round_trips
    from tests.servers import wait_until

    wait_until(lambda: renewer().round_trips >= trips + 4, timeout=10)  # > one TTL of renewals
    assert lock_client.get("unreferenced") == value
    assert not RedisLock(lock_client, "unreferenced", ttl=0.3).acquire(blocking=False)


def test_the_decorator_refuses_coroutine_and_generator_functions(
    lock_client: redis.Redis,
) -> None:
    """Such a call only creates the coroutine: the lock would not cover its body."""

    async def coroutine() -> None: ...

    def generator() -> Any:
        yield 1

    async def async_generator() -> Any:
        yield 1

    for function in (coroutine, generator, async_generator):
        with pytest.raises(TypeError, match=function.__qualname__):
            RedisLock(lock_client, "decorated")(function)


def test_a_forked_child_leaving_the_with_block_never_touches_the_parents_lock(
    lock_client: redis.Redis, server: RedisServer
) -> None:
    """The child inherits the scoped handle and its finalizer; it never owned the lock."""
    from celery_redislock.renewer import renewer
    from tests.servers import wait_until

    with RedisLock(lock_client, "forked", ttl=1.0):
        value = lock_client.get("forked")
        pid = os.fork()
        if pid > 0:
            _, status = os.waitpid(pid, 0)
            assert os.WEXITSTATUS(status) == 0
            assert lock_client.get("forked") == value
    if pid == 0:  # the child left the with block: its release was refused
        code = 1
        try:
            gc.collect()  # drops the inherited handle: its finalizer runs
            with RedisLock(server.client(LOCK_DB), "child-own", ttl=0.3):
                trips = renewer().round_trips  # the child's renewer runs its ticks
                wait_until(lambda: renewer().round_trips >= trips + 3, timeout=10)
            code = 0
        finally:
            os._exit(code)


def test_an_abandoned_lock_is_taken_back_when_the_store_returns_within_its_ttl(
    redis_server_factory: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``with`` lock dropped while its store is down is freed when the store answers again.

    The take-back's first schedule ends early here (0.3 s instead of about a
    minute); it goes on trying until the lock's own TTL has passed, so the
    key is free long before that TTL (20 s).
    """
    from celery_redislock import takeback
    from tests.servers import wait_until

    monkeypatch.setattr(takeback, "DELAYS", (0.1, 0.2))
    server = redis_server_factory()
    client = server.client()
    lock = RedisLock(client, "abandoned-long", ttl=20)
    lock.__enter__()  # what `with` does; its __exit__ is then never called
    server.pause()
    try:
        with caplog.at_level("WARNING", logger="celery_redislock"):
            del lock
            # The renewer's tick may hold it a moment (a renewal in flight): collect again.
            wait_until(
                lambda: gc.collect() >= 0 and "was dropped while held" in caplog.text,
                timeout=10,
                interval=0.1,
            )
        time.sleep(4)  # the outage: longer than the first schedule (and its timeouts)
    finally:
        server.resume()
    resumed = time.monotonic()
    wait_until(lambda: client.exists("abandoned-long") == 0, timeout=10, message="taken back")
    assert time.monotonic() - resumed < 5
