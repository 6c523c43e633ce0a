"""The standalone lock for asyncio: :class:`AsyncRedisLock` (its handle and renewer task apart).

It is :class:`~celery_redislock.RedisLock` for ``redis.asyncio`` users
(FastAPI, aiohttp, async Django views): the same scripts, keys, values and
fences (a sync and an async lock of one name exclude each other), awaited
instead of blocking the event loop.

* Waiting is woken by the release notification (pub/sub), with the
  holder's remaining TTL as the fallback, never by polling.
* One renewer task per event loop keeps all of that loop's held locks
  alive, every TTL/3, in one round trip per store per tick
  (``aiorenewer.py``); each held lock is an :class:`AsyncLockHandle`
  (``aiolease.py``).
* Cancellation lands only at an ``await``. One that lands between sending
  the acquire and reading its reply closes that connection at once (see
  :mod:`celery_redislock.aiostore`) and takes back exactly the value it
  sent (compare-and-delete): at once, then in the background for about a
  minute; the next acquire of that name in the process takes it over.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import redis.asyncio

from celery_redislock.aiolease import AsyncLockHandle
from celery_redislock.aiorenewer import AsyncRenewer, async_renewer
from celery_redislock.aiostore import AsyncLockStore
from celery_redislock.exceptions import LockBackendError, LockContended, LockNotOwned
from celery_redislock.outcomes import AcquireResult, ReleaseOutcome
from celery_redislock.owners import Holds, task_owner
from celery_redislock.standalone import StandaloneLock, _note_unsettled, blocking_waits
from celery_redislock.takeback import DELAYS

__all__ = ["AsyncLockHandle", "AsyncRedisLock", "AsyncRenewer", "async_renewer"]

# The standalone lock's documented logger name.
logger = logging.getLogger("celery_redislock.lock")

F = TypeVar("F", bound=Callable[..., Coroutine[Any, Any, Any]])

#: Longest wait, in a cancelled acquire, for the first take-back attempt.
_FIRST_TAKE_BACK_WAIT = 2.0

_HOLDS: Holds[AsyncLockHandle] = Holds()


def _caller_owner() -> object:
    """The owner token of the task calling a lock method, or None outside a task.

    Resolved when ``acquire()``/``release()``/``extend()`` is *called*, not
    when its coroutine runs: ``asyncio.wait_for`` and ``asyncio.shield``
    (Python <= 3.11) run the coroutine in a task of their own, which must
    act for the caller. Outside a task (``asyncio.run(lock.acquire())``)
    it is resolved when the coroutine runs.
    """
    if asyncio._get_running_loop() is None or asyncio.current_task() is None:
        return None
    return task_owner()


# Background take-backs: referenced until done (the loop keeps only weak ones).
_BACKGROUND: set[asyncio.Task[Any]] = set()


async def _take_back(
    store: AsyncLockStore, key: str, value: str, delays: tuple[float, ...], first: Any
) -> None:
    """Compare-and-delete ``value`` after each delay until settled (about a minute)."""
    try:
        for delay in delays:
            if delay:
                await asyncio.sleep(delay)
            try:
                # fenced: the counter is settled, whoever read a fence.
                outcome = await store.release(key, value, fenced=True)
            except LockBackendError as exc:
                logger.debug("taking back lock %s: %s; trying again later", key, exc)
                outcome = ReleaseOutcome.ALREADY_GONE
            if first is not None and not first.done():
                first.set_result(None)
            # ALREADY_GONE: the late acquire may not have landed yet.
            if outcome is not ReleaseOutcome.ALREADY_GONE:
                return
    finally:
        if first is not None and not first.done():
            first.set_result(None)


def take_back_async(store: AsyncLockStore, key: str, value: str, *, now: bool) -> Any:
    """Take back ``value`` from ``key`` from a background task of the running loop.

    Returns a future done after the first attempt (at once when ``now``).
    The task is cancelled with the loop; the TTL frees the key after that.
    """
    loop = asyncio.get_running_loop()
    first = loop.create_future()
    delays = (0.0, *DELAYS) if now else DELAYS
    task = loop.create_task(_take_back(store, key, value, delays, first))
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return first


class AsyncRedisLock(StandaloneLock[AsyncLockHandle, AsyncLockStore, redis.asyncio.Redis]):
    """A token-owned, renewed Redis lock for asyncio code (``redis.asyncio`` clients).

    The asyncio twin of :class:`~celery_redislock.RedisLock`::

        lock = AsyncRedisLock(redis.asyncio.Redis(), "reports:daily", ttl=30)
        async with lock:
            await build_report()

        @AsyncRedisLock(client, "reports:daily")
        async def build_report(): ...

    Args:
        client: A ``redis.asyncio.Redis`` client (single server).
        name: The Redis key of the lock, used as is.
        ttl: Time to live in seconds; renewed every ``ttl/3`` while held when
            ``renew`` is true, by the event loop's renewer task.
        renew: Keep the lock alive while held.
        blocking: Default for :meth:`acquire` (and ``async with``/decorator).
        timeout: Default longest wait in seconds (``None``: as long as it takes).
        store: The :class:`~celery_redislock.aiostore.AsyncLockStore` to use;
            default: the one shared by every lock on ``client``'s pool.
        reentrant: Owned by the asyncio task that calls :meth:`acquire`
            (decided at the call, so ``asyncio.wait_for(lock.acquire(), t)``
            acquires for the caller), which may take it again; each acquire
            needs its release. Another task's release or extend raises
            ``LockNotOwned``.

    Raises:
        ConfigurationError: bad name, TTL or client.
    """

    _kind, _owner_name = "AsyncRedisLock", "the running task"
    _holds, _owner = _HOLDS, staticmethod(task_owner)
    _shared_store = staticmethod(AsyncLockStore.for_client)
    _take_back = staticmethod(take_back_async)

    def _start_renewal(self, handle: AsyncLockHandle, scoped: bool) -> None:
        handle.start_renewal()  # the loop's renewer task holds its handles strongly

    async def fence(self) -> int:
        """Fencing token of the current (outermost) acquisition, issued on first call.

        Raises:
            LockNotOwned: the lock is not held here.
            LockBackendError: Redis is unreachable.
        """
        handle = self._current()
        if handle is None:
            raise LockNotOwned(self.name, "it is not held")
        return await handle.fence()

    def acquire(
        self, blocking: bool | None = None, timeout: float | None = None
    ) -> Coroutine[Any, Any, bool]:
        """Take the lock (await the result).

        Reentrant: the owner is the task that *calls* ``acquire()``, resolved
        at the call, so a coroutine that ``asyncio.wait_for`` or
        ``asyncio.shield`` runs in a task of its own (Python <= 3.11) still
        acquires for its caller.

        ``blocking``, ``timeout`` and the result are
        :meth:`RedisLock.acquire <celery_redislock.RedisLock.acquire>`'s.

        Raises:
            LockBackendError: Redis is unreachable.
            LockNotOwned: reentrant, and the task's outer acquisition was lost.
            RuntimeError: this (non-reentrant) object already holds the lock.
        """
        return self._acquire(_caller_owner() if self.reentrant else None, blocking, timeout)

    async def _acquire(self, owner: object, blocking: bool | None, timeout: float | None) -> bool:
        if self.reentrant:
            if owner is None:
                owner = task_owner()
            hold = self._holds.get(self.backend, self.name, owner)
            if hold is not None:
                self._check_nested(hold)
                await hold.handle.extend()  # still ours? (marked lost and raises if not)
                hold.depth += 1
                return True
        blocking, timeout, value, ttl_ms, started, adopt = self._new_try(blocking, timeout)
        handle: AsyncLockHandle | None = None
        try:
            result = await self.backend.acquire(self.name, value, ttl_ms, adopt)
            for wait in blocking_waits(result, blocking, timeout):  # woken by the release
                result = await self.backend.acquire_waiting(self.name, value, ttl_ms, wait, adopt)
                if result.acquired:
                    break
            if not result.acquired:
                return self._contended(result)
            handle = AsyncLockHandle(
                self.backend, self.name, value, self.ttl, result.sent_at, sender=self, fence=None
            )
            self._granted(handle, owner, adopt, started, None)
        except BaseException as error:
            # Cancelled (or interrupted): take exactly that value back before
            # re-raising (a second cancellation cuts only the wait, not the
            # take-back).
            if self._failed(error, handle, owner, value):
                if handle is not None:
                    handle.released = True
                    handle._stop_renewal()
                _note_unsettled(self.backend, self.name, value)
                first = take_back_async(self.backend, self.name, value, now=True)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({first}, timeout=_FIRST_TAKE_BACK_WAIT)
            raise
        return True

    def _exit_step(self, owner: object) -> Callable[[], Awaitable[ReleaseOutcome | None]]:
        """Count one release (reentrant: of ``owner``), as a step that may run twice.

        Finding the step changes nothing. Running it twice counts the release
        once: it *sets* the depth this release leaves, and the last release
        is resumable (``AsyncLockHandle.release`` sends it again after an
        interruption, and does nothing once done); the hold is forgotten
        only once its release ran, so an interruption anywhere leaves it
        for the second run to finish (the sync lock's rule).

        Raises:
            LockNotOwned: reentrant, and ``owner`` does not hold it.
        """
        if not self.reentrant:
            return self._release_held
        if owner is None:
            owner = task_owner()
        hold = self._own_hold(owner)
        depth = hold.depth

        async def step() -> ReleaseOutcome | None:
            if depth > 1:
                hold.depth = depth - 1
                return None
            try:
                return await hold.handle.release()
            finally:
                self._holds.remove(self.backend, self.name, owner, hold.handle)

        return step

    async def _release_held(self) -> ReleaseOutcome | None:
        """Release this (non-reentrant) object's handle; safe to run again."""
        handle = self.handle
        if handle is None:
            return None
        outcome = await handle.release()
        if self.handle is handle:
            self.handle = None
        return outcome

    def release(self) -> Coroutine[Any, Any, ReleaseOutcome | None]:
        """Release the lock if held (await the result); never raises a Redis error.

        A release cut off by a cancellation is sent again before the
        cancellation propagates. A reentrant lock is released by its task,
        once per acquire; only the last release is sent (the nested ones
        return ``None``). As for :meth:`acquire`, the owner is the task
        that calls ``release()``.

        Raises:
            LockNotOwned: reentrant, and the running task does not hold it.
        """
        return self._release(_caller_owner() if self.reentrant else None)

    async def _release(self, owner: object) -> ReleaseOutcome | None:
        step: Callable[[], Awaitable[ReleaseOutcome | None]] | None = None
        try:
            step = self._exit_step(owner)
            return await step()
        except LockNotOwned:
            raise
        except BaseException:
            # Once more, then re-raise: deferred, not lost, counted once.
            if step is None:
                step = self._exit_step(owner)
            await step()
            raise

    def extend(self, ttl: float | None = None) -> Coroutine[Any, Any, None]:
        """Reset the TTL now (await the result).

        Raises:
            LockNotOwned: not held by this object (reentrant: by the task that
                calls ``extend()``), or no longer ours.
            LockBackendError: Redis is unreachable.
        """
        return self._extend(_caller_owner() if self.reentrant else None, ttl)

    async def _holder_ttl(self, contention: AcquireResult) -> float | None:
        """The contended holder's TTL: read now if the acquire did not (``None`` if unknown)."""
        if contention.known_ttl is not None or contention.holder is None:
            return contention.known_ttl
        try:
            return await self.backend.holder_ttl(self.name)
        except LockBackendError as exc:
            logger.info("the holder's TTL of lock %s is unknown: %s", self.name, exc)
            return None

    async def _extend(self, owner: object, ttl: float | None) -> None:
        await self._held(owner).extend(ttl)

    async def __aenter__(self) -> AsyncRedisLock:
        depth_before, handle_before = self.depth, self.handle
        try:
            if not await self.acquire():
                last = self._last_contention
                raise LockContended(self.name, last.holder_task_id, await self._holder_ttl(last))
            return self
        except BaseException:
            # Interrupted after acquiring, before the block is entered: its
            # __aexit__ will not run, so give this acquisition back here.
            if self.depth > depth_before or self.handle not in (None, handle_before):
                await self.__aexit__(None, None, None)
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        # _release() inline (awaiting it would add its first instruction to
        # the unprotected spot): see there.
        step: Callable[[], Awaitable[ReleaseOutcome | None]] | None = None
        try:
            step = self._exit_step(None)
            await step()
        except LockNotOwned:
            raise
        except BaseException:
            if step is None:
                step = self._exit_step(None)
            await step()
            raise

    def __call__(self, function: F) -> F:
        """Use the lock as a decorator of a coroutine function: each call holds it.

        Each call uses a fresh :class:`AsyncRedisLock`, so concurrent calls
        wait for each other.

        Raises:
            TypeError: ``function`` is not an ``async def`` function.
        """
        if not inspect.iscoroutinefunction(function):
            raise TypeError(
                f"@AsyncRedisLock({self.name!r}) decorates async def functions; "
                f"{getattr(function, '__qualname__', function)!r} is not one (use RedisLock)"
            )

        @functools.wraps(function)
        async def locked(*args: Any, **kwargs: Any) -> Any:
            async with self._copy(AsyncRedisLock):
                return await function(*args, **kwargs)

        return locked  # type: ignore[return-value]
