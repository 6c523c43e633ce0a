"""The standalone lock for asyncio: :class:`AsyncRedisLock`, its handle and renewer task.

It is :class:`~celery_redislock.RedisLock` for ``redis.asyncio`` users
(FastAPI, aiohttp, async Django views): the same scripts, keys, values and
fences (a sync and an async lock of one name exclude each other), awaited
instead of blocking the event loop.

* Waiting is woken by the release notification (pub/sub), with the
  holder's remaining TTL as the fallback, never by polling.
* One renewer task per event loop keeps all of that loop's held locks
  alive, every TTL/3, in one round trip per store per tick. It exists only
  while the loop holds a lock, and a loop shut down by ``asyncio.run``
  cancels it like any other task.
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
import os
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import redis.asyncio

from celery_redislock import signals
from celery_redislock._clock import clock
from celery_redislock.aiostore import AsyncLockStore
from celery_redislock.exceptions import (
    ConfigurationError,
    LockBackendError,
    LockContended,
    LockNotOwned,
)
from celery_redislock.lease import report_lost
from celery_redislock.lock import _note_unsettled, _settle, _unsettled
from celery_redislock.owners import Hold, Holds, task_owner
from celery_redislock.settings import validate_ttl
from celery_redislock.store import AcquireResult, ReleaseOutcome, RenewOutcome
from celery_redislock.takeback import DELAYS
from celery_redislock.tokens import LockOwner, LockValue

__all__ = ["AsyncLockHandle", "AsyncRedisLock", "AsyncRenewer", "async_renewer"]

# The documented logger names: the standalone lock's and the renewer's.
logger = logging.getLogger("celery_redislock.lock")
renewal_logger = logging.getLogger("celery_redislock.renewal")

F = TypeVar("F", bound=Callable[..., Coroutine[Any, Any, Any]])

_DRIFT_FACTOR = 0.01
_DRIFT_FLOOR = 0.002
#: Longest wait, in a cancelled acquire, for the first take-back attempt.
_FIRST_TAKE_BACK_WAIT = 2.0

_HOLDS: Holds[AsyncLockHandle] = Holds()


#: No contention seen yet (immutable, so one instance serves every lock).
_NO_CONTENTION = AcquireResult(False)


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


class AsyncLockHandle:
    """One acquisition of an :class:`AsyncRedisLock`, from grant to release.

    Attributes:
        key: Redis key of the lock.
        value: The exact value stored under ``key`` by this acquisition.
        ttl: Time to live in seconds; renewed every ``ttl / 3``.
        fenced: True once a fence was issued to this acquisition
            (:meth:`fence`): its renewals and release then settle the counter.
        lost_reason: ``"gone"``, ``"stolen"`` or ``"expired_locally"`` once lost.
    """

    task_id: str | None = None

    def __init__(
        self,
        store: AsyncLockStore,
        key: str,
        value: str,
        ttl: float,
        granted_at: float,
        *,
        sender: Any,
        fence: int | None,
    ) -> None:
        self.backend = store
        self.key = key
        self.task_name = key
        self.value = value
        self._fence = fence
        self.fenced = fence is not None
        self.sender = sender
        self.acquired_at = granted_at
        self._set_ttl(ttl)
        self.renew_at = granted_at + self.renew_period
        self.valid_until = self._validity_from(granted_at)
        self.lost_reason: str | None = None
        self.released = False
        self.renewals = 0
        self._renewer: AsyncRenewer | None = None
        self._release_done = False
        self._release_sent = False
        self._pid = os.getpid()
        self._on_lost: list[Callable[[Any], None]] = []

    def __repr__(self) -> str:
        state = "released" if self.released else ("lost" if self.lost else "held")
        return f"<AsyncLockHandle {self.key!r} {state}>"

    async def fence(self) -> int:
        """The fencing token of this acquisition, issued on first call (one round trip).

        Strictly larger than every earlier acquisition's of the same key; a
        holder that never asks costs the lock store nothing for it.

        Raises:
            LockNotOwned: the lock is no longer held (released, or lost).
            LockBackendError: Redis is unreachable.
        """
        fence = self._fence
        if fence is None:
            if self.released:
                raise LockNotOwned(self.key, "it was released")
            fence = await self.backend.fence(self.key, self.value)
            if fence is None:
                raise LockNotOwned(self.key, "it no longer holds this acquisition's value")
            self._fence, self.fenced = fence, True
        return fence

    def _set_ttl(self, ttl: float) -> None:
        self.ttl = ttl
        self.ttl_ms = max(int(ttl * 1000), 1)
        self.renew_period = ttl / 3

    def _validity_from(self, sent_at: float) -> float:
        return sent_at + self.ttl * (1 - _DRIFT_FACTOR) - _DRIFT_FLOOR

    @property
    def lost(self) -> bool:
        """True once the renewer found the lock gone or taken over."""
        return self.lost_reason is not None

    @property
    def owned(self) -> bool:
        """True while held: not released, not lost, within its validity (no round trip)."""
        return not self.released and not self.lost and clock() < self.valid_until

    @property
    def held_for(self) -> float:
        """Seconds since the lock was granted."""
        return clock() - self.acquired_at

    def on_lost(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(handle)`` from the loop's renewer task if the lock is lost.

        The callback must not block; exceptions it raises are logged.
        """
        self._on_lost.append(callback)

    def start_renewal(self) -> None:
        """Hand the lock to the running loop's renewer task."""
        if self._renewer is None and not self.released:
            self._renewer = async_renewer()
            self._renewer.register(self)

    def _stop_renewal(self) -> None:
        if self._renewer is not None:
            self._renewer.unregister(self)
            self._renewer = None

    def _renewed(self, sent_at: float) -> None:
        if self.released or self.lost:
            return
        self.renewals += 1
        self.valid_until = self._validity_from(sent_at)
        self.renew_at = sent_at + self.renew_period
        signals.lock_renewed.send(
            sender=self.sender,
            key=self.key,
            task_name=self.task_name,
            task_id=None,
            held=self.held_for,
        )

    def _mark_lost(self, reason: str) -> None:
        if self.released or self.lost:
            return
        self.lost_reason = reason
        self._stop_renewal()
        report_lost(self, reason, self._on_lost)

    async def extend(self, ttl: float | None = None) -> None:
        """Reset the lock's TTL now (to ``ttl`` seconds, default the lock's TTL).

        Raises:
            LockNotOwned: the lock is no longer ours (it is marked lost).
            LockBackendError: Redis is unreachable.
        """
        if self.released:
            raise LockNotOwned(self.key, "it was released")
        if ttl is not None:
            self._set_ttl(validate_ttl(ttl, "ttl"))
        sent_at = clock()
        outcome = await self.backend.extend(self.key, self.value, self.ttl_ms, self.fenced)
        if outcome is RenewOutcome.RENEWED:
            self.valid_until = self._validity_from(sent_at)
            self.renew_at = sent_at + self.renew_period
            return
        self._mark_lost("gone" if outcome is RenewOutcome.GONE else "stolen")
        raise LockNotOwned(self.key, f"it is {self.lost_reason}")

    async def release(self) -> ReleaseOutcome | None:
        """Release the lock; never raises a Redis error (see ``LockHandle.release``).

        Renewal stops before the release is sent. Awaiting it again after a
        cancellation cut it off sends it again.
        """
        if self._release_done:
            return None
        if self._pid != os.getpid():
            logger.warning(
                "not releasing lock %s from pid %d: it was acquired by pid %d",
                self.key,
                os.getpid(),
                self._pid,
            )
            return None
        self.released = True
        self._stop_renewal()
        resent, self._release_sent = self._release_sent, True
        try:
            outcome = await self.backend.release(self.key, self.value, self.fenced, resent)
        except LockBackendError as exc:
            self._release_done = True
            logger.error(
                "could not release lock %s; it expires within %.1fs: %s", self.key, self.ttl, exc
            )
            return None
        self._release_done = True
        if outcome is ReleaseOutcome.NOT_OURS:
            logger.warning(
                "lock %s was no longer ours at release (held %.3fs); "
                "another holder has it and was left alone",
                self.key,
                self.held_for,
            )
        elif outcome is ReleaseOutcome.ALREADY_GONE and not self.lost:
            logger.warning(
                "lock %s had already expired at release (held %.3fs)", self.key, self.held_for
            )
        signals.lock_released.send(
            sender=self.sender,
            key=self.key,
            task_name=self.task_name,
            task_id=None,
            held=self.held_for,
            outcome=outcome.name.lower(),
        )
        return outcome


class AsyncRenewer:
    """Keeps one event loop's held :class:`AsyncLockHandle` objects alive from one task.

    The task starts with the first registration and ends when nothing is
    held, so an idle loop has no task of ours to cancel or leak.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._handles: dict[int, AsyncLockHandle] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        #: Number of renewal round trips made (for tests and benchmarks).
        self.round_trips = 0

    @property
    def held(self) -> int:
        """Number of locks this loop keeps alive."""
        return len(self._handles)

    @property
    def alive(self) -> bool:
        """True while the renewer task runs."""
        return self._task is not None and not self._task.done()

    def register(self, handle: AsyncLockHandle) -> None:
        """Start keeping ``handle`` alive (starts the task if needed)."""
        self._forget_parents_locks()
        self._handles[id(handle)] = handle
        if not self.alive:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="redislock-async-renewer"
            )
        elif self._wake is not None:
            self._wake.set()

    def unregister(self, handle: AsyncLockHandle) -> None:
        """Stop renewing ``handle``; a reply in flight for it is ignored."""
        self._handles.pop(id(handle), None)
        if not self._handles and self._wake is not None:
            self._wake.set()  # nothing left: let the task end now, not at its next tick

    async def _run(self) -> None:
        wake = self._wake
        try:
            while self._handles and wake is not None:
                try:
                    sleep = await self._tick()
                except Exception:
                    renewal_logger.exception("async lock renewal tick failed; continuing")
                    sleep = 0.1
                if not self._handles:
                    return
                wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), max(sleep, 0.0))
        finally:
            # Cancelled (the loop is shutting down) or nothing held: a later
            # registration starts a new task. No await in between, so none
            # can register in the gap.
            self._task = self._wake = None

    def _forget_parents_locks(self) -> None:
        # A child forked while the loop ran goes on running it: it must
        # never renew its parent's locks.
        if self._pid != os.getpid():
            self._handles, self._pid = {}, os.getpid()

    async def _tick(self) -> float:
        self._forget_parents_locks()
        now = clock()
        due = [h for h in self._handles.values() if h.renew_at - h.renew_period / 2 <= now]
        groups: dict[AsyncLockStore, list[AsyncLockHandle]] = {}
        for handle in due:
            groups.setdefault(handle.backend, []).append(handle)
        for store, handles in groups.items():
            await self._renew_group(store, handles)
        pending = [h.renew_at for h in self._handles.values()]
        return min(pending) - clock() if pending else 0.0

    async def _renew_group(self, store: AsyncLockStore, handles: list[AsyncLockHandle]) -> None:
        sent_at = clock()
        try:
            self.round_trips += 1
            outcomes = await store.renew_many(
                [(h.key, h.value, h.ttl_ms, h.fenced) for h in handles]
            )
        except Exception as exc:
            now = clock()
            if isinstance(exc, LockBackendError):
                renewal_logger.warning("could not renew %d lock(s): %s", len(handles), exc)
            else:
                renewal_logger.exception("could not renew %d lock(s)", len(handles))
            for handle in handles:
                if now >= handle.valid_until:
                    handle._mark_lost("expired_locally")
                else:
                    handle.renew_at = now + min(handle.renew_period / 4, 1.0)
            return
        for handle, outcome in zip(handles, outcomes, strict=False):
            if id(handle) not in self._handles:
                continue  # released while the renewal was in flight
            if outcome is RenewOutcome.RENEWED:
                handle._renewed(sent_at)
            elif outcome is RenewOutcome.GONE:
                handle._mark_lost("gone")
            else:
                handle._mark_lost("stolen")


_RENEWERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncRenewer] = (
    weakref.WeakKeyDictionary()
)


def async_renewer() -> AsyncRenewer:
    """Return the running event loop's renewer."""
    loop = asyncio.get_running_loop()
    found = _RENEWERS.get(loop)
    if found is None:
        found = _RENEWERS[loop] = AsyncRenewer()
    return found


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


class AsyncRedisLock:
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

    def __init__(
        self,
        client: redis.asyncio.Redis,
        name: str,
        ttl: float = 30.0,
        renew: bool = True,
        *,
        blocking: bool = True,
        timeout: float | None = None,
        store: AsyncLockStore | None = None,
        reentrant: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"AsyncRedisLock name must be a non-empty str, got {name!r}")
        self.name = name
        self.ttl = validate_ttl(ttl, "AsyncRedisLock ttl")
        self.renew = renew
        self.blocking = blocking
        self.timeout = timeout
        self.reentrant = reentrant
        self.client = client
        self.backend = AsyncLockStore.for_client(client) if store is None else store
        self.handle: AsyncLockHandle | None = None
        self._last_contention = _NO_CONTENTION

    def __repr__(self) -> str:
        return f"<AsyncRedisLock {self.name!r} {'held' if self.owned else 'free'}>"

    def _hold(self) -> Hold[AsyncLockHandle] | None:
        return _HOLDS.get(self.backend, self.name, task_owner())

    def _current(self) -> AsyncLockHandle | None:
        if not self.reentrant:
            return self.handle
        hold = self._hold()
        return None if hold is None else hold.handle

    @property
    def owned(self) -> bool:
        """True while this object (reentrant: the running task) holds the lock."""
        handle = self._current()
        return handle is not None and handle.owned

    @property
    def lost(self) -> bool:
        """True when the renewer found the lock gone or taken over while held."""
        handle = self._current()
        return handle is not None and handle.lost

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

    @property
    def depth(self) -> int:
        """How many times it is held (reentrant: by the running task); 0 when not held."""
        if not self.reentrant:
            return 1 if self.handle is not None and not self.handle.released else 0
        hold = self._hold()
        return 0 if hold is None else hold.depth

    def acquire(
        self, blocking: bool | None = None, timeout: float | None = None
    ) -> Coroutine[Any, Any, bool]:
        """Take the lock (await the result).

        Reentrant: the owner is the task that *calls* ``acquire()``, resolved
        at the call, so a coroutine that ``asyncio.wait_for`` or
        ``asyncio.shield`` runs in a task of its own (Python <= 3.11) still
        acquires for its caller.

        Args:
            blocking: Wait for the holder to release (woken by its release
                notification). Defaults to the constructor's.
            timeout: Longest wait in seconds when blocking (default: the
                constructor's; ``None`` waits as long as it takes).

        Returns:
            True if acquired, False if not (non-blocking, or timed out).

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
            hold = _HOLDS.get(self.backend, self.name, owner)
            if hold is not None:
                if hold.handle.lost:
                    raise LockNotOwned(
                        self.name, f"the outer acquisition was lost ({hold.handle.lost_reason})"
                    )
                await hold.handle.extend()  # still ours? (marked lost and raises if not)
                hold.depth += 1
                return True
        elif self.handle is not None and not self.handle.released:
            raise RuntimeError(f"AsyncRedisLock {self.name!r} is already held by this object")
        blocking = self.blocking if blocking is None else blocking
        timeout = self.timeout if timeout is None else timeout
        value = LockValue.new_encoded(LockOwner.current(None, 0, None), self.name)
        ttl_ms = max(int(self.ttl * 1000), 1)
        started = clock()
        handle: AsyncLockHandle | None = None
        adopt = _unsettled(self.backend, self.name)
        try:
            if not blocking:
                result = await self.backend.acquire(self.name, value, ttl_ms, adopt)
            else:
                result = await self._acquire_blocking(value, ttl_ms, timeout, adopt)
            if not result.acquired:
                self._contended(result)
                return False
            handle = AsyncLockHandle(
                self.backend,
                self.name,
                value,
                self.ttl,
                result.sent_at,
                sender=self,
                fence=None,
            )
            if self.reentrant:
                _HOLDS.add(self.backend, self.name, owner, handle)
            else:
                self.handle = handle
            if self.renew:
                handle.start_renewal()
            if adopt:
                _settle(self.backend, self.name, adopt)
            signals.lock_acquired.send(
                sender=self,
                key=self.name,
                task_name=self.name,
                task_id=None,
                waited=clock() - started,
                fence=None,
            )
        except LockBackendError:
            # Redis answered too late: the script may still run. The next
            # acquire of this name takes the value over; else it is taken back.
            _note_unsettled(self.backend, self.name, value)
            take_back_async(self.backend, self.name, value, now=False)
            raise
        except BaseException:
            # Cancelled (or interrupted) with the outcome unknown: our value
            # may be in Redis and nobody would release it. Take exactly that
            # value back before re-raising (a second cancellation cuts only
            # the wait, not the take-back).
            self.handle = None
            if self.reentrant and handle is not None:
                _HOLDS.remove(self.backend, self.name, owner, handle)
            if handle is not None:
                handle.released = True
                handle._stop_renewal()
            _note_unsettled(self.backend, self.name, value)
            first = take_back_async(self.backend, self.name, value, now=True)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({first}, timeout=_FIRST_TAKE_BACK_WAIT)
            raise
        return True

    async def _acquire_blocking(
        self, value: str, ttl_ms: int, timeout: float | None, adopt: tuple[str, ...]
    ) -> AcquireResult:
        result = await self.backend.acquire(self.name, value, ttl_ms, adopt)
        if result.acquired or (timeout is not None and timeout <= 0):
            return result
        if timeout is not None:
            return await self.backend.acquire_waiting(self.name, value, ttl_ms, timeout, adopt)
        while not result.acquired:  # as long as it takes, in bounded slices
            result = await self.backend.acquire_waiting(self.name, value, ttl_ms, 60.0, adopt)
        return result

    def _contended(self, result: AcquireResult) -> None:
        signals.lock_contended.send(
            sender=self,
            key=self.name,
            task_name=self.name,
            task_id=None,
            holder_task_id=result.holder_task_id,
            ttl_remaining=result.known_ttl,
            policy="not_acquired",
        )
        self._last_contention = result

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
        hold = _HOLDS.get(self.backend, self.name, owner)
        if hold is None:
            raise LockNotOwned(
                self.name,
                "the running task does not hold it (released more times than acquired?)",
            )
        depth = hold.depth

        async def step() -> ReleaseOutcome | None:
            if depth > 1:
                hold.depth = depth - 1
                return None
            try:
                return await hold.handle.release()
            finally:
                _HOLDS.remove(self.backend, self.name, owner, hold.handle)

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
        if self.reentrant:
            hold = _HOLDS.get(self.backend, self.name, task_owner() if owner is None else owner)
            handle = None if hold is None else hold.handle
        else:
            handle = self.handle
        if handle is None:
            holder = "the running task" if self.reentrant else "this object"
            raise LockNotOwned(self.name, f"it is not held by {holder}")
        await handle.extend(ttl)

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
            lock = AsyncRedisLock(
                self.client,
                self.name,
                self.ttl,
                self.renew,
                blocking=self.blocking,
                timeout=self.timeout,
                store=self.backend,
                reentrant=self.reentrant,
            )
            async with lock:
                return await function(*args, **kwargs)

        return locked  # type: ignore[return-value]
