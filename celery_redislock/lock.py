"""The standalone :class:`RedisLock`, for code outside Celery tasks (same scripts, same renewer)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from celery_redislock.exceptions import LockBackendError, LockContended, LockNotOwned
from celery_redislock.lease import LockHandle, release_completely
from celery_redislock.outcomes import ReleaseOutcome
from celery_redislock.owners import Holds, thread_owner
from celery_redislock.standalone import _UNSETTLED as _UNSETTLED  # imported from here
from celery_redislock.standalone import StandaloneLock, _note_unsettled, blocking_waits
from celery_redislock.store import LockStore
from celery_redislock.takeback import take_back_value

__all__ = ["RedisLock"]

logger = logging.getLogger("celery_redislock.lock")

F = TypeVar("F", bound=Callable[..., Any])

# The reentrant locks' holds of this process, per thread (see owners.py).
_HOLDS: Holds[LockHandle] = Holds()


class RedisLock(StandaloneLock[LockHandle, LockStore, redis.Redis]):
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

    _holds, _owner = _HOLDS, staticmethod(thread_owner)
    _shared_store = staticmethod(LockStore.for_client)
    _take_back = staticmethod(take_back_value)

    def _start_renewal(self, handle: LockHandle, scoped: bool) -> None:
        handle.start_renewal(scoped)

    @property
    def fence(self) -> int | None:
        """Fencing token of the current (outermost) acquisition (``None`` when not held)."""
        handle = self._current()
        return None if handle is None else handle.fence

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

    def _acquire(self, blocking: bool | None, timeout: float | None, scoped: bool) -> bool:
        owner: object = None
        if self.reentrant:
            owner = thread_owner()
            hold = self._holds.get(self.backend, self.name, owner)
            if hold is not None:
                self._check_nested(hold)
                hold.handle.extend()  # still ours? (raises LockNotOwned, marked lost, if not)
                hold.depth += 1
                return True
        blocking, timeout, value, ttl_ms, started, adopt = self._new_try(blocking, timeout)
        handle: LockHandle | None = None
        try:
            result = self.backend.acquire(self.name, value, ttl_ms, adopt)
            for wait in blocking_waits(result, blocking, timeout):  # woken by the release
                result = self.backend.acquire_waiting(self.name, value, ttl_ms, wait, adopt)
                if result.acquired:
                    break
            if not result.acquired:
                return self._contended(result)
            # Registered with the renewer only once kept where the release finds it.
            handle = LockHandle(
                self.backend, self.name, value, self.ttl, result.sent_at, task_name=self.name,
                task_id=None, sender=self, renew=False, fence=result.fence,
            )  # fmt: skip
            self._granted(handle, owner, adopt, started, result.fence, scoped)
        except BaseException as error:
            if self._failed(error, handle, owner, value):
                if handle is not None:
                    release_completely(handle.release)
                else:
                    # In case the acquire runs after this release:
                    _note_unsettled(self.backend, self.name, value)
                    with contextlib.suppress(LockBackendError):
                        release_completely(lambda: self.backend.release(self.name, value))
                    take_back_value(self.backend, self.name, value, now=False)
            raise
        return True

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
        hold = self._own_hold(owner)
        depth = hold.depth

        def step() -> ReleaseOutcome | None:
            if depth > 1:
                hold.depth = depth - 1
                return None
            try:
                return hold.handle.release()
            finally:
                self._holds.remove(self.backend, self.name, owner, hold.handle)

        return step

    def extend(self, ttl: float | None = None) -> None:
        """Reset the TTL now. See :meth:`LockHandle.extend`.

        Raises:
            LockNotOwned: the lock is not held by this object (reentrant: by
                the calling thread).
        """
        self._held().extend(ttl)

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
            with self._copy(RedisLock):
                return function(*args, **kwargs)

        return locked  # type: ignore[return-value]
