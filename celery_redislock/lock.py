"""The standalone :class:`RedisLock`, for code outside Celery tasks (same scripts, same renewer)."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import logging
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from celery_redislock import signals
from celery_redislock._clock import clock
from celery_redislock.exceptions import (
    ConfigurationError,
    LockBackendError,
    LockContended,
    LockNotOwned,
)
from celery_redislock.lease import LockHandle, release_completely
from celery_redislock.owners import Hold, Holds, thread_owner
from celery_redislock.settings import validate_ttl
from celery_redislock.store import AcquireResult, LockStore, ReleaseOutcome
from celery_redislock.takeback import take_back_value
from celery_redislock.tokens import LockOwner, LockValue

__all__ = ["RedisLock"]

logger = logging.getLogger("celery_redislock.lock")

F = TypeVar("F", bound=Callable[..., Any])

# Values this process's standalone locks sent in acquires that timed out,
# per lock store and name: their scripts may have run after all. Bounded;
# weak per store, so a dropped client takes its entries along.
# (The async store keeps its values here too: the same rule, another store type.)
_UNSETTLED: weakref.WeakKeyDictionary[Any, dict[str, collections.deque[str]]] = (
    weakref.WeakKeyDictionary()
)
_MAX_UNSETTLED = 8

# The reentrant locks' holds of this process, per thread (see owners.py).
_HOLDS: Holds[LockHandle] = Holds()


#: No contention seen yet (immutable, so one instance serves every lock).
_NO_CONTENTION = AcquireResult(False)


def _unsettled(backend: Any, name: str) -> tuple[str, ...]:
    """Values of ``name``'s acquires that timed out in this process (to take over)."""
    per_name = _UNSETTLED.get(backend)
    return tuple(per_name.get(name, ())) if per_name is not None else ()


def _note_unsettled(backend: Any, name: str, value: str) -> None:
    per_name = _UNSETTLED.get(backend)
    if per_name is None:
        per_name = _UNSETTLED.setdefault(backend, {})
    values = per_name.get(name)
    if values is None:
        values = per_name.setdefault(name, collections.deque(maxlen=_MAX_UNSETTLED))
    values.append(value)


def _settle(backend: Any, name: str, adopted: tuple[str, ...]) -> None:
    """Forget the ``adopted`` values: an acquire took them over (or found them gone)."""
    per_name = _UNSETTLED.get(backend)
    values = None if per_name is None else per_name.get(name)
    if per_name is None or values is None:
        return
    for value in adopted:  # not clear(): another thread may have added one since
        with contextlib.suppress(ValueError):
            values.remove(value)
    if not values:
        per_name.pop(name, None)


class RedisLock:
    """A token-owned, renewed Redis lock for code outside Celery tasks.

    It uses the same scripts and the same renewer as the task lock::

        lock = RedisLock(redis.Redis(), "reports:daily", ttl=30)
        with lock:
            build_report()

        @RedisLock(client, "reports:daily")
        def build_report(): ...

    With ``reentrant=True`` the lock is owned by the thread that took it:
    the same thread may take it again (through this object or any other
    ``RedisLock`` of the same name and client) without waiting; each
    acquire needs its release, and only the last one frees the key. Redis
    holds one ordinary value per outermost acquisition (one fence, one
    renewal); the depth is counted in the process (see ``owners.py``).

    Args:
        client: A ``redis.Redis`` client.
        name: The Redis key of the lock, used as is.
        ttl: Time to live in seconds; the lock is renewed every ``ttl/3``
            while held when ``renew`` is true.
        renew: Keep the lock alive from the process's renewer thread.
        blocking: Default for :meth:`acquire` (and ``with``/decorator use).
        timeout: Default longest wait in seconds for a blocking acquire
            (``None``: wait as long as it takes).
        store: The :class:`~celery_redislock.store.LockStore` to use, e.g. a
            subclass overriding its ``do_*`` methods; default: the store
            shared by every lock on ``client``'s connection pool (what lets
            one renewal round trip serve them all). Keep one instance per
            client and share it between locks for the same reason.
        reentrant: Owned by the calling thread, which may take it again
            (nested acquisitions share the outermost one's value and fence).
            Another thread's release or extend raises ``LockNotOwned``.
    """

    def __init__(
        self,
        client: redis.Redis,
        name: str,
        ttl: float = 30.0,
        renew: bool = True,
        *,
        blocking: bool = True,
        timeout: float | None = None,
        store: LockStore | None = None,
        reentrant: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"RedisLock name must be a non-empty str, got {name!r}")
        self.name = name
        self.ttl = validate_ttl(ttl, "RedisLock ttl")
        self.renew = renew
        self.blocking = blocking
        self.timeout = timeout
        self.client = client
        self.backend = LockStore.for_client(client) if store is None else store
        self.reentrant = reentrant
        self.handle: LockHandle | None = None
        self._last_contention = _NO_CONTENTION

    def __repr__(self) -> str:
        return f"<RedisLock {self.name!r} {'held' if self.owned else 'free'}>"

    def _hold(self) -> Hold[LockHandle] | None:
        return _HOLDS.get(self.backend, self.name, thread_owner())

    def _current(self) -> LockHandle | None:
        if not self.reentrant:
            return self.handle
        hold = self._hold()
        return None if hold is None else hold.handle

    @property
    def owned(self) -> bool:
        """True while this object (reentrant: the calling thread) holds the lock.

        A local check, no round trip.
        """
        handle = self._current()
        return handle is not None and handle.owned

    @property
    def lost(self) -> bool:
        """True when the renewer found the lock gone or taken over while held."""
        handle = self._current()
        return handle is not None and handle.lost

    @property
    def fence(self) -> int | None:
        """Fencing token of the current (outermost) acquisition (``None`` when not held)."""
        handle = self._current()
        return None if handle is None else handle.fence

    @property
    def depth(self) -> int:
        """Reentrant: how many times the calling thread holds it (0 when not held)."""
        if not self.reentrant:
            return 1 if self.handle is not None and not self.handle.released else 0
        hold = self._hold()
        return 0 if hold is None else hold.depth

    def acquire(self, blocking: bool | None = None, timeout: float | None = None) -> bool:
        """Take the lock.

        A reentrant lock already held by the calling thread is taken again at
        once: one round trip confirms it is still ours and extends it.

        Args:
            blocking: Wait for the holder to release (woken by its release
                notification, not by polling). Defaults to the constructor's.
            timeout: Longest wait in seconds when blocking (default: the
                constructor's; ``None`` waits as long as it takes).

        Returns:
            True if acquired, False if not (non-blocking, or timed out).

        Raises:
            LockBackendError: Redis is unreachable.
            LockNotOwned: reentrant, and the calling thread's outer
                acquisition was lost (the nested code must not run as if
                it held the lock).
            RuntimeError: this (non-reentrant) object already holds the lock.
        """
        return self._acquire(blocking, timeout, scoped=False)

    def _acquire_nested(self, hold: Hold[LockHandle]) -> bool:
        if hold.handle.lost:
            raise LockNotOwned(
                self.name, f"the outer acquisition was lost ({hold.handle.lost_reason})"
            )
        hold.handle.extend()  # still ours? (raises LockNotOwned, marked lost, if not)
        hold.depth += 1
        return True

    def _acquire(self, blocking: bool | None, timeout: float | None, scoped: bool) -> bool:
        owner: object = None
        if self.reentrant:
            owner = thread_owner()
            hold = _HOLDS.get(self.backend, self.name, owner)
            if hold is not None:
                return self._acquire_nested(hold)
            # The renewer holds it strongly: the hold, not this object, keeps
            # it (another RedisLock of the same name may release it).
            scoped = False
        elif self.handle is not None and not self.handle.released:
            raise RuntimeError(f"RedisLock {self.name!r} is already held by this object")
        blocking = self.blocking if blocking is None else blocking
        timeout = self.timeout if timeout is None else timeout
        value = LockValue.new_encoded(LockOwner.current(None, 0, None), self.name)
        ttl_ms = max(int(self.ttl * 1000), 1)
        started = clock()
        handle: LockHandle | None = None
        adopt = _unsettled(self.backend, self.name)
        try:
            if not blocking:
                result = self.backend.acquire(self.name, value, ttl_ms, adopt)
            else:
                result = self._acquire_blocking(value, ttl_ms, timeout, adopt)
            if not result.acquired:
                self._contended(result)
                return False
            handle = LockHandle(
                self.backend,
                self.name,
                value,
                self.ttl,
                result.sent_at,
                task_name=self.name,
                task_id=None,
                sender=self,
                renew=False,
                fence=result.fence,
            )
            if self.reentrant:
                _HOLDS.add(self.backend, self.name, owner, handle)
            else:
                self.handle = handle
            if self.renew:
                handle.start_renewal(scoped)
            if adopt:
                _settle(self.backend, self.name, adopt)
            signals.lock_acquired.send(
                sender=self,
                key=self.name,
                task_name=self.name,
                task_id=None,
                waited=clock() - started,
                fence=result.fence,
            )
        except LockBackendError:
            # A timeout is not a refusal: the script may still run once Redis
            # answers. The next acquire of this name in this process takes
            # that value over instead of waiting out its TTL.
            _note_unsettled(self.backend, self.name, value)
            # And if none comes, it is taken back in the background.
            take_back_value(self.backend, self.name, value, now=False)
            raise
        except BaseException:
            # Interrupted with the outcome unknown (between sending the
            # acquire and reading its reply, or before returning): our value
            # may be in Redis, and the caller will not release what acquire()
            # did not report. Take it back out, then re-raise.
            self.handle = None
            if self.reentrant and handle is not None:
                _HOLDS.remove(self.backend, self.name, owner, handle)
            if handle is not None:
                release_completely(handle.release)
            else:
                # In case the script runs after this release:
                _note_unsettled(self.backend, self.name, value)
                with contextlib.suppress(LockBackendError):
                    release_completely(lambda: self.backend.release(self.name, value))
                take_back_value(self.backend, self.name, value, now=False)
            raise
        return True

    def _acquire_blocking(
        self, value: str, ttl_ms: int, timeout: float | None, adopt: tuple[str, ...]
    ) -> AcquireResult:
        result = self.backend.acquire(self.name, value, ttl_ms, adopt)
        if result.acquired or (timeout is not None and timeout <= 0):
            return result
        if timeout is not None:
            return self.backend.acquire_waiting(self.name, value, ttl_ms, timeout, adopt)
        while not result.acquired:  # wait as long as it takes, in bounded slices
            result = self.backend.acquire_waiting(self.name, value, ttl_ms, 60.0, adopt)
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

    def release(self) -> ReleaseOutcome | None:
        """Release the lock if held; never raises a Redis error. See :meth:`LockHandle.release`.

        If an exception interrupts it, the release is completed first and the
        exception re-raised. A reentrant lock is released by its owner
        thread, once per acquire; only the last release is sent to Redis
        (the nested ones return ``None``).

        Raises:
            LockNotOwned: reentrant, and the calling thread does not hold it
                (another thread's lock, or released more times than acquired).
        """
        # Only the first instruction, before the try, is unprotected (the
        # same shape in __exit__, inline there for the same reason).
        step: Callable[[], ReleaseOutcome | None] | None = None
        try:
            step = self._leave() if self.reentrant else self._release_held
            return step()
        except LockNotOwned:
            raise
        except BaseException:
            # Once more, then re-raise: deferred, not lost. _leave() changes
            # nothing; its step run twice counts the release once and sends
            # the last one again; the plain handle's release is resumable.
            if step is None:
                step = self._leave() if self.reentrant else self._release_held
            step()
            raise

    def _release_held(self) -> ReleaseOutcome | None:
        """Release this (non-reentrant) object's handle; safe to run again."""
        handle = self.handle
        if handle is None:
            return None
        outcome = handle.release()
        if self.handle is handle:
            self.handle = None
        return outcome

    def _leave(self) -> Callable[[], ReleaseOutcome | None]:
        """Count one release of the calling thread, as a step that may run twice.

        Returns the step; the caller runs it, and runs it again if an
        exception interrupts it. Running it twice counts the release once:
        it *sets* the depth this release leaves (never decrements it again),
        and the last release is resumable (``LockHandle.release`` sends it
        again after an interruption, and does nothing once done). The hold
        is forgotten only after its release was sent, so an interruption
        anywhere leaves the hold in place for the second run to finish.

        Raises:
            LockNotOwned: the calling thread does not hold it.
        """
        owner = thread_owner()
        hold = _HOLDS.get(self.backend, self.name, owner)
        if hold is None:
            raise LockNotOwned(
                self.name,
                "the calling thread does not hold it (released more times than acquired?)",
            )
        depth = hold.depth

        def step() -> ReleaseOutcome | None:
            if depth > 1:
                hold.depth = depth - 1
                return None
            try:
                return hold.handle.release()
            finally:
                _HOLDS.remove(self.backend, self.name, owner, hold.handle)

        return step

    def extend(self, ttl: float | None = None) -> None:
        """Reset the TTL now. See :meth:`LockHandle.extend`.

        Raises:
            LockNotOwned: the lock is not held by this object (reentrant: by
                the calling thread).
        """
        handle = self._current()
        if handle is None:
            holder = "the calling thread" if self.reentrant else "this object"
            raise LockNotOwned(self.name, f"it is not held by {holder}")
        handle.extend(ttl)

    def __enter__(self) -> RedisLock:
        # Scoped: if __exit__ never runs its release (an exception landing on
        # its first instruction), dropping this object stops the renewal and
        # takes the value back, instead of renewing it for ever.
        depth_before, handle_before = self.depth, self.handle
        try:
            if not self._acquire(None, None, scoped=True):
                last = self._last_contention
                raise LockContended(self.name, last.holder_task_id, last.ttl_remaining)
            return self
        except BaseException:
            # Interrupted after acquiring, before the block is entered: its
            # __exit__ will not run, so give this acquisition back here.
            if self.depth > depth_before or self.handle not in (None, handle_before):
                self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc_info: object) -> None:
        # release() inline (a call would add its first instruction to the
        # unprotected spot): see release() for the retry.
        step: Callable[[], ReleaseOutcome | None] | None = None
        try:
            step = self._leave() if self.reentrant else self._release_held
            step()
        except LockNotOwned:
            raise
        except BaseException:
            if step is None:
                step = self._leave() if self.reentrant else self._release_held
            step()
            raise

    def __call__(self, function: F) -> F:
        """Use the lock as a decorator: each call runs while holding it.

        The decorated function uses a fresh :class:`RedisLock` per call, so
        concurrent calls from several threads each wait for the lock.

        Raises:
            TypeError: ``function`` is a coroutine or generator function: a
                call only creates the coroutine or generator, so the lock
                would be released before its body runs.
        """
        if (
            inspect.iscoroutinefunction(function)
            or inspect.isgeneratorfunction(function)
            or inspect.isasyncgenfunction(function)
        ):
            raise TypeError(
                f"@RedisLock({self.name!r}) cannot decorate {function.__qualname__}: a call "
                "only creates its coroutine or generator, so the lock would be released "
                "before the body runs; take the lock inside it with `with RedisLock(...)`"
            )

        @functools.wraps(function)
        def locked(*args: Any, **kwargs: Any) -> Any:
            lock = RedisLock(
                self.client,
                self.name,
                self.ttl,
                self.renew,
                blocking=self.blocking,
                timeout=self.timeout,
                store=self.backend,
                reentrant=self.reentrant,
            )
            with lock:
                return function(*args, **kwargs)

        return locked  # type: ignore[return-value]
