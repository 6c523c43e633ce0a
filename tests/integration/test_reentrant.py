"""RedisLock(reentrant=True): owned by a thread, nested acquisitions counted in the process."""

from __future__ import annotations

import inspect
import os
import sys
import threading
from typing import Any

import pytest
import redis

from celery_redislock import LockNotOwned, RedisLock, ReleaseOutcome, lock_acquired, lock_lost
from celery_redislock.renewer import renewer
from celery_redislock.scripts import RELEASE_SCRIPT
from celery_redislock.store import LockStore, release_call
from celery_redislock.tokens import LockOwner, LockValue
from tests.servers import wait_until


def test_nesting_depth_three_in_one_thread_shares_one_value_and_one_fence(
    lock_client: redis.Redis,
) -> None:
    acquired: list[Any] = []

    def on_acquired(sender: Any, **kwargs: Any) -> None:
        if kwargs["key"] == "re:nest":
            acquired.append(kwargs["fence"])

    lock_acquired.connect(on_acquired)
    try:
        outer = RedisLock(lock_client, "re:nest", ttl=5, reentrant=True)
        held_before = renewer().held
        with outer:
            value, fence = lock_client.get("re:nest"), outer.fence
            with outer:  # the same object again
                assert outer.depth == 2
                # Another object of the same name, in the same thread.
                inner = RedisLock(lock_client, "re:nest", ttl=5, reentrant=True)
                assert inner.acquire(blocking=False)
                assert inner.depth == 3 and inner.fence == fence and inner.owned
                assert lock_client.get("re:nest") == value
                assert renewer().held == held_before + 1  # one renewal for all levels
                assert inner.release() is None  # nested: nothing sent
            assert lock_client.get("re:nest") == value and outer.depth == 1
        assert lock_client.exists("re:nest") == 0
        assert outer.depth == 0 and not outer.owned
        # One acquisition, one signal (its fence is issued on demand: None there).
        assert acquired == [None]
        with pytest.raises(LockNotOwned, match="released more times than acquired"):
            outer.release()
    finally:
        lock_acquired.disconnect(on_acquired)


def test_a_nested_acquire_extends_the_lock(lock_client: redis.Redis) -> None:
    lock = RedisLock(lock_client, "re:extend", ttl=30, renew=False, reentrant=True)
    assert lock.acquire()
    lock_client.pexpire("re:extend", 1000)
    assert lock.acquire()
    assert lock_client.pttl("re:extend") > 20000
    lock.release()
    assert lock.release() is ReleaseOutcome.RELEASED


def test_two_threads_contend_and_never_release_or_extend_each_others_lock(
    lock_client: redis.Redis,
) -> None:
    lock = RedisLock(lock_client, "re:threads", ttl=5, reentrant=True)
    inside = 0
    overlaps: list[int] = []
    errors: list[BaseException] = []
    guard = threading.Lock()

    def body(rounds: int) -> None:
        nonlocal inside
        try:
            for _ in range(rounds):
                with lock, lock:  # depth 2 per round
                    with guard:
                        inside += 1
                        overlaps.append(inside)
                    with guard:
                        inside -= 1
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(15,)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert len(overlaps) == 45 and max(overlaps) == 1

    # While this thread holds it, another thread can neither take, release
    # nor extend it.
    assert lock.acquire() and lock.acquire()
    seen: dict[str, Any] = {}

    def other() -> None:
        seen["acquired"] = lock.acquire(blocking=False)
        for name in ("release", "extend"):
            try:
                getattr(lock, name)()
            except LockNotOwned as exc:
                seen[name] = exc

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(10)
    assert seen["acquired"] is False
    assert isinstance(seen["release"], LockNotOwned) and isinstance(seen["extend"], LockNotOwned)
    assert lock.depth == 2 and lock_client.exists("re:threads") == 1
    lock.release()
    lock.release()
    assert lock_client.exists("re:threads") == 0


def test_a_lost_reentrant_lock_is_reported_once(lock_client: redis.Redis) -> None:
    reports: list[dict[str, Any]] = []

    def on_lost(sender: Any, **kwargs: Any) -> None:
        if kwargs["key"] == "re:lost":
            reports.append(kwargs)

    lock_lost.connect(on_lost)
    try:
        lock = RedisLock(lock_client, "re:lost", ttl=0.3, reentrant=True)
        assert lock.acquire() and lock.acquire() and lock.acquire()
        lock_client.set("re:lost", "someone else", px=30000)
        wait_until(lambda: lock.lost, timeout=10, message="the renewer to find it stolen")
        trips = renewer().round_trips
        with pytest.raises(LockNotOwned, match="lost"):
            lock.acquire()  # a nested acquire never runs on a lost lock
        assert lock.release() is None and lock.release() is None
        assert lock.release() is ReleaseOutcome.NOT_OURS  # the new holder is left alone
        assert lock_client.get("re:lost") == b"someone else"
        # Renewal ticks go on for other locks; the loss is not reported again.
        with RedisLock(lock_client, "re:other", ttl=0.3):
            wait_until(lambda: renewer().round_trips >= trips + 2, timeout=10)
        assert [report["reason"] for report in reports] == ["stolen"]
    finally:
        lock_lost.disconnect(on_lost)


def test_a_stale_owners_release_is_refused_by_the_script(lock_client: redis.Redis) -> None:
    stale = RedisLock(lock_client, "re:stale", ttl=30, renew=False, reentrant=True)
    assert stale.acquire() and stale.acquire()
    stale_value = lock_client.get("re:stale")
    assert stale_value is not None
    # The stale holder's key expired and another owner took the lock.
    new_value = LockValue.new(LockOwner.current(None, 0, None), "re:stale").encode()
    lock_client.set("re:stale", new_value, px=30000)
    # Lua level: the release script refuses the stale value and leaves the key.
    keys, args = release_call("re:stale", stale_value.decode(), "exact", "", 0, 1000)
    reply = lock_client.eval(RELEASE_SCRIPT, len(keys), *keys, *args)
    assert reply == -1
    assert lock_client.get("re:stale") == new_value.encode()
    # And through the lock: nested release sends nothing, the last is refused.
    assert stale.release() is None
    assert stale.release() is ReleaseOutcome.NOT_OURS
    assert lock_client.get("re:stale") == new_value.encode()
    with pytest.raises(LockNotOwned):
        stale.extend()


def test_a_failing_body_releases_every_level(lock_client: redis.Redis) -> None:
    lock = RedisLock(lock_client, "re:exit", ttl=5, reentrant=True)
    with pytest.raises(KeyError), lock, lock:
        raise KeyError("body failed")
    assert lock.depth == 0 and lock_client.exists("re:exit") == 0


def test_an_interrupted_last_release_is_sent_again_and_counted_once(
    lock_client: redis.Redis,
) -> None:
    class InterruptedOnce(LockStore):
        interrupted = False

        def do_release(self, *args: Any) -> int:
            reply = super().do_release(*args)
            if not InterruptedOnce.interrupted:
                InterruptedOnce.interrupted = True
                raise KeyboardInterrupt  # after Redis released it, before we saw the reply
            return reply

    store = InterruptedOnce(client=lock_client)
    lock = RedisLock(lock_client, "re:interrupted", ttl=5, store=store, reentrant=True)
    other = RedisLock(lock_client, "re:interrupted", ttl=5, store=store, reentrant=True)
    with pytest.raises(KeyboardInterrupt), lock, lock:
        assert other.acquire()
        other.release()
    assert InterruptedOnce.interrupted
    assert lock.depth == 0 and lock_client.exists("re:interrupted") == 0
    with pytest.raises(LockNotOwned):
        lock.release()  # exactly three acquires, three releases counted


def test_a_forked_child_does_not_inherit_the_threads_hold(lock_client: redis.Redis) -> None:
    lock = RedisLock(lock_client, "re:fork", ttl=5, reentrant=True)
    with lock:
        value = lock_client.get("re:fork")
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                # The child's main thread is not the owner: the parent is.
                free = lock.acquire(blocking=False)
                code = 0 if not free and lock.depth == 0 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert lock.depth == 1 and lock_client.get("re:fork") == value
    assert lock_client.exists("re:fork") == 0


def test_inside_asyncio_tasks_the_owner_is_the_task_not_the_loops_thread(
    lock_client: redis.Redis,
) -> None:
    """Two coroutines share the loop's thread; a sync reentrant lock held across an
    await by one must not let the other in."""
    import asyncio

    lock = RedisLock(lock_client, "re:tasks", ttl=5, reentrant=True)

    async def main() -> tuple[bool, bool]:
        assert lock.acquire() and lock.acquire()  # reentrant within this task

        async def other() -> bool:
            return lock.acquire(blocking=False)

        other_got = await asyncio.create_task(other())
        lock.release()
        lock.release()
        return other_got, lock_client.exists("re:tasks") == 0

    assert asyncio.run(main()) == (False, True)


def _interrupt_at_line(n: int) -> Any:
    """A trace function raising KeyboardInterrupt at the ``n``-th line run in lock.py/owners.py.

    Not on the lines of ``__exit__`` before its ``try`` (``step = None``, ``try:``):
    no signal is delivered there (no eval-breaker check in a store or a NOP),
    only on the call's first instruction, the window docs/_parts/standalone-lock.md
    documents.
    """
    import celery_redislock.lock
    import celery_redislock.owners
    import celery_redislock.standalone

    files = {
        celery_redislock.lock.__file__,
        celery_redislock.owners.__file__,
        celery_redislock.standalone.__file__,
    }
    source, first = inspect.getsourcelines(RedisLock.__exit__)
    try_line = first + next(i for i, line in enumerate(source) if line.strip() == "try:")
    # Nor on _acquire's last line, ``return True`` after its try: a constant
    # and a return, no eval-breaker check (only a trace function raises there).
    source, first = inspect.getsourcelines(RedisLock._acquire)
    granted_return = first + max(
        i for i, line in enumerate(source) if line.strip() == "return True"
    )
    seen = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            if frame.f_code.co_name == "__exit__" and frame.f_lineno <= try_line:
                return local
            if frame.f_code.co_name == "_acquire" and frame.f_lineno == granted_return:
                return local
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt(f"line {frame.f_lineno} of {frame.f_code.co_name}")
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename in files else None

    return tracer


def test_an_interrupt_on_any_line_of_the_last_exit_still_releases_once(
    lock_client: redis.Redis,
) -> None:
    lock = RedisLock(lock_client, "re:exit-any", ttl=5, reentrant=True)
    n = 0
    while True:
        n += 1
        tracer = _interrupt_at_line(n)
        interrupted = False
        try:
            with lock:
                handle = lock._current()
                sys.settrace(tracer)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            sys.settrace(None)
        assert handle is not None
        where = f"interrupted at line event {n}" if interrupted else "not interrupted"
        assert lock.depth == 0, where
        assert lock_client.exists("re:exit-any") == 0, where
        assert handle.released and not handle._renewing, where
        with pytest.raises(LockNotOwned):
            lock.release()  # counted exactly once
        if not interrupted:
            break
    assert n > 3


def test_an_interrupt_on_any_line_of_a_nested_enter_or_exit_counts_it_once(
    lock_client: redis.Redis,
) -> None:
    lock = RedisLock(lock_client, "re:nested-any", ttl=5, reentrant=True)
    n = 0
    with lock:
        value = lock_client.get("re:nested-any")
        while True:
            n += 1
            tracer = _interrupt_at_line(n)
            interrupted = False
            try:
                sys.settrace(tracer)
                with lock:
                    pass
            except KeyboardInterrupt:
                interrupted = True
            finally:
                sys.settrace(None)
            where = f"interrupted at line event {n}" if interrupted else "not interrupted"
            assert lock.depth == 1, where
            assert lock_client.get("re:nested-any") == value, where
            if not interrupted:
                break
    assert lock.depth == 0 and lock_client.exists("re:nested-any") == 0
    assert n > 5


@pytest.mark.parametrize("reentrant", [False, True])
def test_an_interrupt_on_any_line_of_an_explicit_acquire_leaves_no_lock_behind(
    lock_client: redis.Redis, reentrant: bool
) -> None:
    # acquire() either returns True (the caller holds it and will release),
    # or raises with nothing left: no value in Redis, nothing renewed.
    name = f"re:acquire-any:{reentrant}"
    n = 0
    while True:
        n += 1
        # A fresh name each time: an interrupted try leaves a value to take
        # over, whose settling lengthens the next try's path, so one name
        # never let the sweep reach the grant's last lines (review helper-40 F5).
        key = f"{name}:{n}"
        lock = RedisLock(lock_client, key, ttl=5, reentrant=reentrant)
        tracer = _interrupt_at_line(n)
        acquired, where = False, "not interrupted"
        try:
            sys.settrace(tracer)
            acquired = lock.acquire()
        except KeyboardInterrupt as interrupt:
            where = f"interrupted at line event {n} ({interrupt})"
        finally:
            sys.settrace(None)
        if acquired:
            assert lock.owned, where
            lock.release()
        assert lock_client.exists(key) == 0, where
        assert lock.depth == 0, where
        registered = [*renewer()._handles.values(), *renewer()._scoped.values()]
        assert not any(h.key == key for h in registered), where
        if where == "not interrupted":
            break
    assert n > 5
