"""AsyncRedisLock against a real redis-server: waits, renewal, loss, cancellation, reentrancy.

Coroutines are driven by ``asyncio.run`` from sync tests (no pytest plugin).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import redis
import redis.asyncio

from celery_redislock import (
    AsyncRedisLock,
    ConfigurationError,
    LockBackendError,
    LockContended,
    LockNotOwned,
    RedisLock,
    ReleaseOutcome,
    lock_acquired,
    lock_lost,
)
from celery_redislock.aiolock import async_renewer
from celery_redislock.aiostore import AsyncLockStore
from celery_redislock.keys import release_channel
from tests.conftest import LOCK_DB
from tests.helpers import held
from tests.servers import RedisServer, server_busy, wait_until

T = TypeVar("T")


def run(server: RedisServer, body: Callable[[redis.asyncio.Redis], Awaitable[T]]) -> T:
    """Run ``body(client)`` in a fresh event loop; close the client and the lock's connections."""

    async def main() -> T:
        client = redis.asyncio.Redis(port=server.port, db=LOCK_DB)
        try:
            return await body(client)
        finally:
            await AsyncLockStore.for_client(client).aclose()
            await client.aclose()

    return asyncio.run(main())


async def until(condition: Callable[[], Any], timeout: float = 10.0, what: str = "") -> None:
    """Await ``condition()`` being true, with a deadline (no fixed sleeps)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await asyncio.sleep(0.01)


def test_async_with_acquires_renews_nothing_short_and_releases(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        async with AsyncRedisLock(client, "a:cm", ttl=5) as lock:
            assert lock.owned and isinstance(await lock.fence(), int)
            assert lock_client.pttl("a:cm") > 4000
            # Same key and value format as the sync lock: they exclude each other.
            assert RedisLock(lock_client, "a:cm").acquire(blocking=False) is False
        assert lock_client.exists("a:cm") == 0 and not lock.owned
        await until(lambda: not async_renewer().alive, what="no task left on the loop")

    run(server, body)


def test_non_blocking_and_timed_out_acquires(server: RedisServer) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        holder = AsyncRedisLock(client, "a:nb")
        assert await holder.acquire()
        assert await AsyncRedisLock(client, "a:nb").acquire(blocking=False) is False
        with pytest.raises(LockContended) as info:
            async with AsyncRedisLock(client, "a:nb", timeout=0.2):
                pass
        assert info.value.ttl_remaining is not None
        with pytest.raises(RuntimeError, match="already held"):
            await holder.acquire()
        assert await holder.release() is ReleaseOutcome.RELEASED

    run(server, body)


def test_a_waiter_is_woken_by_the_release_not_by_polling(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    # A server of its own: the commands counted are this test's alone (an
    # earlier test's background take-backs run on the shared one for a minute).
    server = redis_server_factory()
    lock_client = server.client(LOCK_DB)

    async def body(client: redis.asyncio.Redis) -> float:
        holder = AsyncRedisLock(client, "a:wake", ttl=30)
        assert await holder.acquire()
        lock_client.config_resetstat()
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def release_later() -> None:
            await asyncio.sleep(0.3)
            await holder.release()

        releaser = asyncio.create_task(release_later())
        waiter = AsyncRedisLock(client, "a:wake", ttl=30)
        assert await waiter.acquire(timeout=20)
        waited = loop.time() - started
        await releaser
        await waiter.release()
        return waited

    waited = run(server, body)
    assert waited < 10  # the holder's TTL (30 s) was not what woke it
    stats = lock_client.info("commandstats")
    # Acquire, acquire once subscribed, acquire once woken, two releases: no
    # polling. On Valkey 9 a plain release is DELIFEQ, and the holder's
    # (marked) one is DELIFEQ, the script that says why, then the hand-over.
    evalsha, delifeq = (
        stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "delifeq")
    )
    assert (evalsha, delifeq) == ((4, 2) if delifeq else (5, 0)), stats
    assert stats["cmdstat_subscribe"]["calls"] == 1


def test_many_concurrent_coroutines_on_one_key_never_overlap(server: RedisServer) -> None:
    async def body(client: redis.asyncio.Redis) -> list[int]:
        inside = 0
        seen: list[int] = []
        lock = AsyncRedisLock(client, "a:many", ttl=5, timeout=30)

        @lock
        async def critical() -> None:
            nonlocal inside
            inside += 1
            seen.append(inside)
            await asyncio.sleep(0.002)  # let the others run while we hold it
            inside -= 1

        await asyncio.gather(*(critical() for _ in range(25)))
        return seen

    seen = run(server, body)
    assert len(seen) == 25 and max(seen) == 1


def test_one_renewer_task_per_loop_renews_all_locks_in_batches(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        locks = [AsyncRedisLock(client, f"a:renew:{i}", ttl=0.3) for i in range(6)]
        for lock in locks:
            assert await lock.acquire()
        renewer = async_renewer()
        assert renewer.alive and renewer.held == 6
        trips = renewer.round_trips
        await until(lambda: all(lock.handle and lock.handle.renewals >= 3 for lock in locks))
        renewals = sum(lock.handle.renewals for lock in locks if lock.handle)
        # Batched: one round trip renews all six (allow a split tick or two).
        assert renewer.round_trips - trips <= renewals / 3
        assert all(lock.owned for lock in locks)
        assert all(lock_client.pttl(f"a:renew:{i}") > 0 for i in range(6))
        for lock in locks:
            await lock.release()
        await until(lambda: not renewer.alive, what="the renewer task to end")

    run(server, body)


def test_a_lost_async_lock_is_reported_once(server: RedisServer, lock_client: redis.Redis) -> None:
    reports: list[dict[str, Any]] = []

    def on_lost(sender: Any, **kwargs: Any) -> None:
        if kwargs["key"] == "a:lost":
            reports.append(kwargs)

    async def body(client: redis.asyncio.Redis) -> None:
        lock = AsyncRedisLock(client, "a:lost", ttl=0.3)
        assert await lock.acquire()
        lock_client.delete("a:lost")
        await until(lambda: lock.lost, what="the renewer to find it gone")
        # Renewal ticks go on for another lock; the loss is not reported again.
        async with AsyncRedisLock(client, "a:other", ttl=0.3) as other:
            trips = async_renewer().round_trips
            await until(lambda: async_renewer().round_trips >= trips + 3)
            assert other.owned
        with pytest.raises(LockNotOwned):
            await lock.extend()
        assert await lock.release() is ReleaseOutcome.ALREADY_GONE

    lock_lost.connect(on_lost)
    try:
        run(server, body)
    finally:
        lock_lost.disconnect(on_lost)
    assert [report["reason"] for report in reports] == ["gone"]


def sets(client: redis.Redis) -> int:
    """SET commands the server has run so far (those of scripts too)."""
    return int(client.info("commandstats").get("cmdstat_set", {}).get("calls", 0))


def test_cancelled_between_sending_the_acquire_and_its_reply(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    """The connection with the unread reply is closed, and the value taken back."""

    async def body(client: redis.asyncio.Redis) -> None:
        store = AsyncLockStore.for_client(client)
        async with AsyncRedisLock(client, "a:warm"):  # connections open before the freeze
            pass
        sets_before = sets(lock_client)
        busy = server_busy(server, 1.5)
        await asyncio.to_thread(busy.__enter__)
        try:
            idle_before = len(store.commands.idle_connections())
            acquiring = asyncio.create_task(AsyncRedisLock(client, "a:cancel").acquire())
            # It took a warm connection and wrote in the same step (no await
            # suspends before its read): sent; the reply waits behind DEBUG SLEEP.
            await until(
                lambda: len(store.commands.idle_connections()) < idle_before,
                what="the acquire on its connection",
            )
            assert not acquiring.done()
            acquiring.cancel()
            with pytest.raises(asyncio.CancelledError):
                await acquiring
        finally:
            await asyncio.to_thread(busy.__exit__, None, None, None)
        # The script did run once Redis woke (it wrote the key; the release
        # that takes it back may already have deleted it and its counter)...
        await until(lambda: sets(lock_client) > sets_before, what="the late acquire")
        # ...and its value was taken back: the key is free.
        await until(lambda: not lock_client.exists("a:cancel"), timeout=15, what="take-back")
        # No idle connection holds an unread reply.
        for connection in store.commands.idle_connections():
            assert not (connection.is_connected and await connection.can_read())
        # The next acquire reads its own reply.
        async with AsyncRedisLock(client, "a:cancel", timeout=5) as lock:
            assert lock.owned and lock_client.get("a:cancel") is not None

    run(server, body)


def test_cancelled_while_waiting_leaves_the_holder_alone(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        holder = AsyncRedisLock(client, "a:waitcancel", ttl=30)
        assert await holder.acquire()
        value = lock_client.get("a:waitcancel")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(AsyncRedisLock(client, "a:waitcancel").acquire(), 0.3)
        # The waiter marked the holder's value (its release then wakes waiters).
        assert held(lock_client, "a:waitcancel") == value and holder.owned
        channel = release_channel("a:waitcancel")
        await until(lambda: lock_client.pubsub_numsub(channel)[0][1] == 0, what="unsubscribed")
        await holder.release()

    run(server, body)


def test_reentrant_async_lock_is_owned_by_the_task(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    fences: list[Any] = []

    def on_acquired(sender: Any, **kwargs: Any) -> None:
        if kwargs["key"] == "a:re":
            fences.append(kwargs["fence"])

    async def body(client: redis.asyncio.Redis) -> None:
        lock = AsyncRedisLock(client, "a:re", ttl=5, reentrant=True)
        async with lock:
            fence = await lock.fence()
            async with lock, AsyncRedisLock(client, "a:re", reentrant=True) as inner:
                assert inner.depth == 3 and await inner.fence() == fence

            async def other_task() -> tuple[bool, bool]:
                with pytest.raises(LockNotOwned):
                    await lock.release()
                with pytest.raises(LockNotOwned):
                    await lock.extend()
                return await lock.acquire(blocking=False), lock.depth == 0

            assert await asyncio.create_task(other_task()) == (False, True)
            assert lock.depth == 1 and lock_client.exists("a:re") == 1
        assert lock_client.exists("a:re") == 0
        with pytest.raises(LockNotOwned, match="more times than acquired"):
            await lock.release()

    lock_acquired.connect(on_acquired)
    try:
        run(server, body)
    finally:
        lock_acquired.disconnect(on_acquired)
    assert len(fences) == 1


def test_a_loop_closed_while_holding_a_lock_cancels_the_renewer_cleanly(
    server: RedisServer, lock_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        lock = AsyncRedisLock(client, "a:abandoned", ttl=0.5)
        assert await lock.acquire()
        assert async_renewer().alive

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        run(server, body)
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
    # Nobody renews it any more: the TTL frees it.
    wait_until(lambda: not lock_client.exists("a:abandoned"), timeout=10)


def test_bad_use_is_refused_early(server: RedisServer) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        lock = AsyncRedisLock(client, "a:bad")
        with pytest.raises(TypeError, match="async def"):
            lock(lambda: None)
        with pytest.raises(ConfigurationError, match="non-empty str"):
            AsyncRedisLock(client, "")
        with pytest.raises(ConfigurationError, match=r"redis\.asyncio\.Redis"):
            AsyncRedisLock(redis.Redis(port=server.port), "a:sync-client")  # type: ignore[arg-type]

    run(server, body)


def test_sync_and_async_locks_of_one_name_exclude_each_other(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    sync_lock = RedisLock(lock_client, "a:mixed", ttl=5)
    assert sync_lock.acquire()
    released = threading.Timer(0.3, sync_lock.release)

    async def body(client: redis.asyncio.Redis) -> bool:
        released.start()
        lock = AsyncRedisLock(client, "a:mixed", ttl=5)
        got = await lock.acquire(timeout=10)  # woken by the sync lock's release
        await lock.release()
        return got and not sync_lock.owned

    assert run(server, body)
    released.join()


def test_a_cancelled_release_is_sent_again_before_the_cancellation_propagates(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    class SlowFirstRelease(AsyncLockStore):
        entered: asyncio.Event
        calls = 0

        async def do_release(self, key: str, value: str) -> int:
            SlowFirstRelease.calls += 1
            if SlowFirstRelease.calls == 1:
                self.entered.set()
                await asyncio.Event().wait()  # cancelled here, before anything is sent
            return await super().do_release(key, value)

    async def body(client: redis.asyncio.Redis) -> None:
        store = SlowFirstRelease(client)
        store.entered = asyncio.Event()
        lock = AsyncRedisLock(client, "a:release-cancel", ttl=30, store=store)
        assert await lock.acquire()
        releasing = asyncio.create_task(lock.release())
        await store.entered.wait()
        releasing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await releasing
        assert SlowFirstRelease.calls == 2
        assert lock_client.exists("a:release-cancel") == 0
        await until(lambda: not async_renewer().alive, what="the renewer task to end")
        await store.aclose()

    run(server, body)


def test_a_child_forked_inside_the_loop_never_renews_or_releases_the_parents_lock(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    """The child must not run the inherited loop (its epoll is the parent's), so it
    drives the release coroutine by hand: refused before any await."""
    import os

    async def body(client: redis.asyncio.Redis) -> None:
        lock = AsyncRedisLock(client, "a:fork", ttl=0.6)
        assert await lock.acquire()
        value = lock_client.get("a:fork")
        renewer = async_renewer()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                release = lock.release()
                try:
                    release.send(None)
                except StopIteration as done:
                    refused = done.value is None
                renewer._forget_parents_locks()
                code = 0 if refused and renewer.held == 0 else 2
            finally:
                os._exit(code)
        _, status = await asyncio.to_thread(os.waitpid, pid, 0)
        assert os.WEXITSTATUS(status) == 0
        trips = renewer.round_trips
        await until(lambda: renewer.round_trips >= trips + 2, what="the parent to renew")
        assert lock_client.get("a:fork") == value and lock.owned
        assert await lock.release() is ReleaseOutcome.RELEASED

    run(server, body)


def test_an_acquire_that_timed_out_is_taken_over_by_the_next_acquire(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    async def body(_: redis.asyncio.Redis) -> None:
        client = redis.asyncio.Redis(port=server.port, db=LOCK_DB, socket_timeout=0.2)
        try:
            async with AsyncRedisLock(client, "a:warm-timeout"):
                pass
            busy = server_busy(server, 1.0)
            await asyncio.to_thread(busy.__enter__)
            try:
                with pytest.raises(LockBackendError, match="unavailable"):
                    await AsyncRedisLock(client, "a:timeout").acquire(blocking=False)
            finally:
                await asyncio.to_thread(busy.__exit__, None, None, None)
            # Its script ran late (or was taken back meanwhile): either way the
            # next acquire in this process gets the lock at once.
            lock = AsyncRedisLock(client, "a:timeout", ttl=30)
            assert await lock.acquire(blocking=False)
            assert await lock.release() is ReleaseOutcome.RELEASED
            await until(lambda: not lock_client.exists("a:timeout"))
        finally:
            await AsyncLockStore.for_client(client).aclose()
            await client.aclose()

    run(server, body)


def test_an_async_lock_redis_stops_answering_for_is_lost_locally_once(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    reasons: list[str] = []

    def on_lost(sender: Any, **kwargs: Any) -> None:
        if kwargs["key"] == "a:frozen":
            reasons.append(kwargs["reason"])

    async def body(client: redis.asyncio.Redis) -> None:
        lock = AsyncRedisLock(client, "a:frozen", ttl=0.9)
        assert await lock.acquire()
        server.pause()  # SIGSTOP: renewals time out
        try:
            await until(lambda: lock.lost, timeout=15, what="the lease to run out locally")
            assert not lock.owned and lock.handle and lock.handle.lost_reason == "expired_locally"
        finally:
            server.resume()
        assert await lock.release() in (ReleaseOutcome.ALREADY_GONE, ReleaseOutcome.RELEASED)
        await until(lambda: not async_renewer().alive)

    lock_lost.connect(on_lost)
    try:
        run(server, body)
    finally:
        lock_lost.disconnect(on_lost)
    assert reasons == ["expired_locally"]


def test_a_reentrant_lock_taken_through_wait_for_or_timeout_is_owned_by_the_caller(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    """Python <= 3.11 runs wait_for's coroutine in a task of its own: the owner is still
    the task that called acquire(), and tasks it starts are still other owners."""

    async def body(client: redis.asyncio.Redis) -> None:
        lock = AsyncRedisLock(client, "a:waitfor", ttl=5, reentrant=True)
        assert await asyncio.wait_for(lock.acquire(), timeout=10)
        assert lock.depth == 1 and lock.owned
        # Nested, through wait_for and asyncio.timeout: taken again at once.
        assert await asyncio.wait_for(lock.acquire(timeout=0), timeout=10)
        async with asyncio.timeout(10):
            assert await lock.acquire(timeout=0)
        assert lock.depth == 3
        async with asyncio.timeout(10):
            async with AsyncRedisLock(client, "a:waitfor", reentrant=True) as inner:
                assert inner.depth == 4

        async def other_task() -> bool:
            return await lock.acquire(blocking=False)

        assert await asyncio.create_task(other_task()) is False
        assert await asyncio.gather(other_task()) == [False]
        assert await asyncio.wait_for(lock.release(), timeout=10) is None
        assert await lock.release() is None
        assert await asyncio.wait_for(lock.release(), timeout=10) is ReleaseOutcome.RELEASED
        assert lock.depth == 0 and lock_client.exists("a:waitfor") == 0
        with pytest.raises(LockNotOwned, match="more times than acquired"):
            await asyncio.wait_for(lock.release(), timeout=10)

    run(server, body)


def test_each_ended_loop_closes_its_connections_and_can_be_collected(server: RedisServer) -> None:
    """One long-lived client used from many asyncio.run calls (a script, a CLI, tests):
    the lock's per-loop connections must not pile up, nor keep the loops alive."""
    import gc
    import os
    import weakref

    client = redis.asyncio.Redis(port=server.port, db=LOCK_DB)
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def main() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        lock = AsyncRedisLock(client, "a:loops", ttl=0.3)
        async with lock:
            await until(lambda: lock.handle is not None and lock.handle.renewals >= 1)
        await client.aclose()  # the client's own pool (not the lock's connections)

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    asyncio.run(main())
    gc.collect()
    before = open_fds()
    for _ in range(20):
        asyncio.run(main())
    gc.collect()
    assert [ref for ref in loops if ref() is not None] == []
    assert open_fds() - before <= 2, (before, open_fds())


class _Interrupt(Exception):
    """Stands for an exception a signal handler raises (KeyboardInterrupt would end the loop)."""


def _lock_path_files() -> set[str]:
    """The modules an asyncio lock's enter and exit run in (the interrupt tests trace them)."""
    import celery_redislock.aiolease
    import celery_redislock.aiolock
    import celery_redislock.leasing
    import celery_redislock.owners
    import celery_redislock.standalone

    modules = (
        celery_redislock.aiolock,
        celery_redislock.owners,
        celery_redislock.standalone,
        celery_redislock.aiolease,
        celery_redislock.leasing,
    )
    return {str(module.__file__) for module in modules}


def test_an_exception_on_any_line_of_a_reentrant_async_exit_releases_once(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    import sys

    files = _lock_path_files()
    # Not on the lines of __aexit__ before its try: no signal is delivered on a
    # store or a NOP, only on the call's first instruction (documented).
    source, first = inspect.getsourcelines(AsyncRedisLock.__aexit__)
    try_line = first + next(i for i, line in enumerate(source) if line.strip() == "try:")

    def interrupting_at(n: int) -> Any:
        seen = [0]

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line":
                if frame.f_code.co_name == "__aexit__" and frame.f_lineno <= try_line:
                    return local
                seen[0] += 1
                if seen[0] == n:
                    raise _Interrupt(f"line {frame.f_lineno} of {frame.f_code.co_name}")
            return local

        task = asyncio.current_task()  # not in the loop's other tasks (the renewer)

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            if frame.f_code.co_filename in files and asyncio.current_task() is task:
                return local
            return None

        return tracer

    async def body(client: redis.asyncio.Redis) -> int:
        lock = AsyncRedisLock(client, "a:exit-any", ttl=5, reentrant=True)
        n = 0
        while True:
            n += 1
            interrupted = False
            try:
                async with lock:
                    async with lock:
                        handle = lock._current()
                        sys.settrace(interrupting_at(n))
                    sys.settrace(None)  # the nested exit only: the outer one is checked below
                    assert lock.depth == 1 and lock_client.exists("a:exit-any") == 1
                    sys.settrace(interrupting_at(n))
            except _Interrupt:
                interrupted = True
            finally:
                sys.settrace(None)
            where = f"interrupted at line event {n}" if interrupted else "not interrupted"
            assert handle is not None and handle.released, where
            assert lock.depth == 0 and lock_client.exists("a:exit-any") == 0, where
            with pytest.raises(LockNotOwned):
                await lock.release()  # counted exactly once
            if not interrupted:
                return n

    assert run(server, body) > 3


def test_an_exception_on_any_line_of_a_nested_async_enter_counts_it_once(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    import sys

    files = _lock_path_files()

    def interrupting_at(n: int) -> Any:
        seen = [0]

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_code.co_name != "__aexit__":  # enter only
                seen[0] += 1
                if seen[0] == n:
                    raise _Interrupt(f"line {frame.f_lineno} of {frame.f_code.co_name}")
            return local

        task = asyncio.current_task()  # not in the loop's other tasks (the renewer)

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            if frame.f_code.co_filename in files and asyncio.current_task() is task:
                return local
            return None

        return tracer

    async def body(client: redis.asyncio.Redis) -> int:
        lock = AsyncRedisLock(client, "a:enter-any", ttl=5, reentrant=True)
        n = 0
        async with lock:
            value = lock_client.get("a:enter-any")
            while True:
                n += 1
                interrupted = False
                try:
                    sys.settrace(interrupting_at(n))
                    async with lock:
                        sys.settrace(None)
                        assert lock.depth == 2
                except _Interrupt:
                    interrupted = True
                finally:
                    sys.settrace(None)
                where = f"interrupted at line event {n}" if interrupted else "not interrupted"
                assert lock.depth == 1, where
                assert lock_client.get("a:enter-any") == value, where
                if not interrupted:
                    break
        assert lock.depth == 0 and lock_client.exists("a:enter-any") == 0
        return n

    assert run(server, body) > 5


def test_a_loop_closed_without_shutting_down_has_its_connections_closed_at_the_next_use(
    server: RedisServer,
) -> None:
    import gc
    import os
    import weakref

    client = redis.asyncio.Redis(port=server.port, db=LOCK_DB)
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def main() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        async with AsyncRedisLock(client, "a:closed-loops", ttl=5):
            pass
        await client.aclose()

    def once() -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(main())
        finally:
            loop.close()  # no shutdown_asyncgens(): the lock cannot tell

    once()
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(10):
        once()
    gc.collect()
    # Only the last loop is still waiting for a next use to close its connections.
    assert [ref for ref in loops[:-1] if ref() is not None] == []
    assert len(os.listdir("/proc/self/fd")) - before <= 2


def test_a_cancellation_landing_as_a_command_is_written_is_never_swallowed(
    server: RedisServer,
) -> None:
    """A client with a socket timeout (as the docs advise): every cancel of a waiter cancels it.

    redis-py writes under ``asyncio.wait_for`` when a socket timeout is set,
    which before Python 3.12 returns instead of raising a cancellation that
    lands as the write completes: the waiter went on waiting for the holder.
    """

    async def body(_: redis.asyncio.Redis) -> list[str]:
        client = redis.asyncio.Redis(port=server.port, db=LOCK_DB, socket_timeout=2)
        holder = AsyncRedisLock(client, "a:swallowed", ttl=30)
        assert await holder.acquire()
        outcomes = []
        try:
            for steps in [0, 1, 2, 3] * 5:
                waiter = asyncio.ensure_future(AsyncRedisLock(client, "a:swallowed").acquire())
                for _ in range(steps + 1):
                    await asyncio.sleep(0)
                waiter.cancel()
                done, _ = await asyncio.wait({waiter}, timeout=1.0)
                if not done:
                    waiter.cancel()
                    await asyncio.wait({waiter}, timeout=5.0)
                outcomes.append(
                    "cancelled" if done and waiter.cancelled() else f"not cancelled ({steps})"
                )
        finally:
            await holder.release()
            await AsyncLockStore.for_client(client).aclose()
            await client.aclose()
        return outcomes

    assert run(server, body) == ["cancelled"] * 20


def test_the_renewer_is_cancelled_even_as_it_is_woken(server: RedisServer) -> None:
    """A cancel in the same loop step as a wake-up (a new lock, the loop shutting down).

    ``asyncio.wait_for`` before Python 3.12 returned the wake-up and dropped
    the cancel: the renewer lived on past ``asyncio.run``'s shutdown.
    """

    async def body(client: redis.asyncio.Redis) -> bool:
        lock = AsyncRedisLock(client, "a:woken", ttl=30)
        assert await lock.acquire()
        renewer = async_renewer()
        task, wake = renewer._task, renewer._wake
        assert task is not None and wake is not None
        # Asleep until its next tick (10 s): awaiting its wake-up.
        await until(lambda: task._fut_waiter is not None, what="the renewer to sleep")
        wake.set()
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)
        cancelled = task.cancelled()
        await lock.release()
        return cancelled

    assert run(server, body)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is Python 3.11+")
def test_a_timeout_expiring_anywhere_in_a_blocked_acquire_ends_it(server: RedisServer) -> None:
    """``asyncio.timeout`` of 0 to 3 ms around a blocked acquire, three times over.

    Among the places it lands is the subscription's connect, whose handshake
    redis-py writes under ``asyncio.wait_for``: 4-6 of 90 waiters went on
    waiting for the holder.
    """

    async def body(_: redis.asyncio.Redis) -> list[str]:
        client = redis.asyncio.Redis(port=server.port, db=LOCK_DB, socket_timeout=2)
        holder = AsyncRedisLock(client, "a:expiring", ttl=30)
        assert await holder.acquire()
        outcomes = []

        async def bounded(seconds: float) -> bool:
            async with asyncio.timeout(seconds):
                return await AsyncRedisLock(client, "a:expiring").acquire()

        try:
            for microseconds in list(range(0, 3000, 100)) * 3:
                waiter = asyncio.ensure_future(bounded(microseconds / 1e6))
                done, _ = await asyncio.wait({waiter}, timeout=1.0)
                if not done:
                    waiter.cancel()
                    await asyncio.wait({waiter}, timeout=5.0)
                error = waiter.exception() if done and not waiter.cancelled() else None
                timed_out = isinstance(error, TimeoutError)
                outcomes.append("timed out" if timed_out else f"{microseconds} us: {error!r}")
        finally:
            await holder.release()
            await AsyncLockStore.for_client(client).aclose()
            await client.aclose()
        return outcomes

    assert run(server, body) == ["timed out"] * 90


def test_a_reentrant_lock_has_a_repr_outside_a_running_loop(server: RedisServer) -> None:
    # Logged or shown in a debugger from sync code: its owner is a task,
    # and there is none to ask for (review helper-40 F3: it raised).
    client = redis.asyncio.Redis(port=server.port, db=LOCK_DB)
    lock = AsyncRedisLock(client, "a:repr", ttl=5, reentrant=True)
    assert repr(lock) == "<AsyncRedisLock 'a:repr' reentrant>"
    assert repr(AsyncRedisLock(client, "a:repr", ttl=5)) == "<AsyncRedisLock 'a:repr' free>"
