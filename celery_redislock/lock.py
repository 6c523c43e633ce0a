"""A held lock (:class:`LockHandle`) and the standalone :class:`RedisLock`."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from celery_redislock import signals
from celery_redislock._clock import clock
from celery_redislock.backend import AcquireResult, LockBackend, ReleaseOutcome, RenewOutcome
from celery_redislock.exceptions import (
    ConfigurationError,
    LockBackendError,
    LockContended,
    LockNotOwned,
)
from celery_redislock.interrupt import withdraw_abort
from celery_redislock.renewal import native_lock, renewer
from celery_redislock.takeback import take_back_value
from celery_redislock.tokens import LockOwner, LockValue

__all__ = ["LockHandle", "RedisLock", "release_completely", "validate_ttl"]

logger = logging.getLogger("celery_redislock.lock")

F = TypeVar("F", bound=Callable[..., Any])

# Redis expiry and our clock can drift apart a little; treat the lock as
# valid locally for slightly less than Redis does (Redlock's drift rule).
_DRIFT_FACTOR = 0.01
_DRIFT_FLOOR = 0.002


def validate_ttl(ttl: Any, where: str) -> float:
    """Return ``ttl`` as seconds, or raise :class:`ConfigurationError`."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise ConfigurationError(f"{where} must be a number of seconds, got {ttl!r}")
    if not ttl > 0 or ttl != ttl or ttl == float("inf"):
        raise ConfigurationError(
            f"{where} must be a positive, finite number of seconds, got {ttl!r}"
        )
    if ttl < 0.01:
        raise ConfigurationError(f"{where} must be at least 0.01 seconds, got {ttl!r}")
    return float(ttl)


def _dropped_while_held(pid: int, backend: LockBackend, key: str, value: str) -> None:
    """Finalizer of a scoped handle dropped before its release ran.

    Only in the process that acquired it: a forked child inherits the handle
    (and this finalizer) but never owned the lock.
    """
    if os.getpid() == pid:
        renewer().abandon(backend, key, value)


class LockHandle:
    """One acquisition of a lock, from grant to release.

    It is what a running task sees as ``self.lock``. The token (the whole
    stored value) lives on this object, never in thread-local storage, so the
    renewer thread and the task's thread act on the same acquisition.

    Attributes:
        key: Redis key of the lock.
        value: The exact value stored under ``key`` by this acquisition.
        ttl: Time to live in seconds; renewed every ``ttl / 3``.
        task_name: Name of the task (or the lock name outside Celery).
        task_id: Task id, or ``None`` outside a task.
        fence: Fencing token of this acquisition: strictly larger than every
            earlier acquisition's of the same key (see ``fencing.py``).
        lost_reason: Why the lock was lost (``"gone"``, ``"stolen"``,
            ``"expired_locally"``), or ``None`` while it is held.
    """

    def __init__(
        self,
        backend: LockBackend,
        key: str,
        value: str,
        ttl: float,
        granted_at: float,
        *,
        task_name: str,
        task_id: str | None,
        sender: Any,
        renew: bool = True,
        fence: int | None = None,
    ) -> None:
        self.backend = backend
        self.fence = fence
        self.key = key
        self.value = value
        self.ttl = ttl
        self.ttl_ms = max(int(ttl * 1000), 1)
        self.task_name = task_name
        self.task_id = task_id
        self.sender = sender
        self.acquired_at = granted_at
        self.renew_period = ttl / 3
        self.renew_at = granted_at + self.renew_period
        self.valid_until = self._validity_from(granted_at)
        self.lost_reason: str | None = None
        #: True once the holder started to release (renewal and aborts stop).
        self.released = False
        #: True once the execution holding it has ended: no abort may reach it.
        self.finished = False
        #: Taken by whoever sends an abort and by :meth:`finish`, so an abort
        #: is either sent before the execution ends, or never.
        self.abort_guard = native_lock()
        #: Thread an asynchronous abort was sent to (lock_on_lost="abort").
        self.abort_sent_to: int | None = None
        self.renewals = 0
        self._release_done = False
        self._release_sent = False
        self._pid = os.getpid()
        self._renewing = False
        self._dropped: weakref.finalize[Any, Any] | None = None
        self._on_lost: list[Callable[[LockHandle], None]] = []
        if renew:
            self.start_renewal()

    def start_renewal(self, scoped: bool = False) -> None:
        """Hand the lock to the process's renewer.

        Callers that must never leave a renewed lock behind construct the
        handle with ``renew=False``, store it where their cleanup will find
        it, and only then call this: an exception landing in between leaves
        nothing registered.

        Args:
            scoped: The renewer holds the handle weakly: once nothing else
                references it (its release was skipped), renewal stops and
                the value is taken back. For locks held by a ``with`` block.
        """
        if not self._renewing and not self.released:
            self._renewing = True
            if scoped:
                dropped = weakref.finalize(
                    self, _dropped_while_held, os.getpid(), self.backend, self.key, self.value
                )
                dropped.atexit = False  # at exit the TTL frees it; no thread to take it back
                self._dropped = dropped
            renewer().register(self, scoped=scoped)

    def __repr__(self) -> str:
        state = "released" if self.released else ("lost" if self.lost else "held")
        return f"<LockHandle {self.key!r} {state}>"

    def _validity_from(self, sent_at: float) -> float:
        return sent_at + self.ttl * (1 - _DRIFT_FACTOR) - _DRIFT_FLOOR

    @property
    def lost(self) -> bool:
        """True once the renewer found the lock gone or taken over."""
        return self.lost_reason is not None

    @property
    def owned(self) -> bool:
        """True while held: not released, not lost, and within its validity.

        This is a local check with no round trip; it turns False as soon as
        the last confirmed grant or renewal is older than the TTL.
        """
        return not self.released and not self.lost and clock() < self.valid_until

    @property
    def held_for(self) -> float:
        """Seconds since the lock was granted."""
        return clock() - self.acquired_at

    def on_lost(self, callback: Callable[[LockHandle], None]) -> None:
        """Call ``callback(handle)`` from the renewer thread if the lock is lost.

        The callback must not block; exceptions it raises are logged.
        """
        self._on_lost.append(callback)

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
            task_id=self.task_id,
            held=self.held_for,
        )

    def _mark_lost(self, reason: str) -> None:
        if self.released or self.lost:
            return
        self.lost_reason = reason
        renewer().unregister(self)
        self._renewing = False
        if self._dropped is not None:
            self._dropped.detach()  # the value is gone: nothing to take back
        logger.error(
            "lock %s of %s[%s] was lost (%s) after %.3fs; another execution may now run",
            self.key,
            self.task_name,
            self.task_id,
            reason,
            self.held_for,
        )
        signals.lock_lost.send(
            sender=self.sender,
            key=self.key,
            task_name=self.task_name,
            task_id=self.task_id,
            reason=reason,
            held=self.held_for,
        )
        for callback in self._on_lost:
            try:
                callback(self)
            except Exception:
                logger.exception("lock-lost callback %r raised", callback)

    def extend(self, ttl: float | None = None) -> None:
        """Reset the lock's TTL now (to ``ttl`` seconds, default the lock's TTL).

        Raises:
            LockNotOwned: the lock is no longer ours (it is marked lost).
            LockBackendError: Redis is unreachable.
        """
        if self.released:
            raise LockNotOwned(self.key, "it was released")
        if ttl is not None:
            self.ttl = validate_ttl(ttl, "ttl")
            self.ttl_ms = max(int(self.ttl * 1000), 1)
            self.renew_period = self.ttl / 3
        sent_at = clock()
        outcome = self.backend.extend(self.key, self.value, self.ttl_ms)
        if outcome is RenewOutcome.RENEWED:
            self.valid_until = self._validity_from(sent_at)
            self.renew_at = sent_at + self.renew_period
            return
        self._mark_lost("gone" if outcome is RenewOutcome.GONE else "stolen")
        raise LockNotOwned(self.key, f"it is {self.lost_reason}")

    def finish(self) -> None:
        """Mark the execution that holds this lock as ended; withdraw an undelivered abort.

        After this returns, no :class:`LockLost` can be raised for this lock:
        the renewer sends an abort only under :attr:`abort_guard` and only
        before ``finished`` is set. Call it from the thread that holds the lock.
        """
        with self.abort_guard:
            self.finished = True
            withdraw_abort(self)

    def release(self, keep: str | None = None, keep_for: float = 0.0) -> ReleaseOutcome | None:
        """Release the lock; never raises a Redis error.

        The handle leaves the renewer *before* the release is sent, so a
        renewal can never outlive it. Calling it again after it completed is
        harmless; calling it again after an exception interrupted it (a soft
        time limit, an abort, ``KeyboardInterrupt``) sends the release again.

        Args:
            keep: Instead of deleting the key, leave this value in it for
                ``keep_for`` seconds: an idempotency window (a kept value,
                see ``tokens.py``) or a queued retry's value (the lock is
                handed over to that retry).
            keep_for: Seconds to keep ``keep``.

        Returns:
            What Redis found, or ``None`` if nothing was sent (already
            released, another process, or Redis unreachable: the TTL then
            frees the lock).
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
        self.finish()
        self.released = True
        if self._renewing:
            renewer().unregister(self)
            self._renewing = False
        if self._dropped is not None:
            self._dropped.detach()  # this release takes care of the value
        # A release sent again after an exception cut off the first one's
        # reply: "already gone" then means the first one worked.
        resent, self._release_sent = self._release_sent, True
        try:
            if keep is None:
                outcome = self.backend.release(self.key, self.value)
            else:
                outcome = self.backend.release(
                    self.key, self.value, keep, max(int(keep_for * 1000), 1)
                )
        except LockBackendError as exc:
            self._release_done = True
            logger.error(
                "could not release lock %s of %s[%s]; it expires within %.1fs: %s",
                self.key,
                self.task_name,
                self.task_id,
                self.ttl,
                exc,
            )
            return None
        self._release_done = True
        if resent and outcome is ReleaseOutcome.ALREADY_GONE:
            outcome = ReleaseOutcome.RELEASED
        if outcome is ReleaseOutcome.NOT_OURS:
            logger.warning(
                "lock %s of %s[%s] was no longer ours at release (held %.3fs); "
                "another holder has it and was left alone",
                self.key,
                self.task_name,
                self.task_id,
                self.held_for,
            )
        elif outcome is ReleaseOutcome.ALREADY_GONE and not self.lost:
            logger.warning(
                "lock %s of %s[%s] had already expired at release (held %.3fs)",
                self.key,
                self.task_name,
                self.task_id,
                self.held_for,
            )
        signals.lock_released.send(
            sender=self.sender,
            key=self.key,
            task_name=self.task_name,
            task_id=self.task_id,
            held=self.held_for,
            outcome="kept"
            if keep is not None and outcome is ReleaseOutcome.RELEASED
            else outcome.name.lower(),
        )
        return outcome


def release_completely(release: Callable[[], Any]) -> None:
    """Run a resumable release to its end even if one exception interrupts it.

    A soft time limit, an abort or a SIGTERM-born ``SystemExit`` can land in
    the middle of a release (each fires once). The release is then sent
    again, and the interruption re-raised once it is done: it is deferred,
    never swallowed.
    """
    try:
        release()
    except BaseException:
        release()
        raise


# Values this process's standalone locks sent in acquires that timed out,
# per lock store and name: their scripts may have run after all. Bounded;
# weak per store, so a dropped client takes its entries along.
_UNSETTLED: weakref.WeakKeyDictionary[LockBackend, dict[str, collections.deque[str]]] = (
    weakref.WeakKeyDictionary()
)
_MAX_UNSETTLED = 8


def _unsettled(backend: LockBackend, name: str) -> tuple[str, ...]:
    """Values of ``name``'s acquires that timed out in this process (to take over)."""
    per_name = _UNSETTLED.get(backend)
    return tuple(per_name.get(name, ())) if per_name is not None else ()


def _note_unsettled(backend: LockBackend, name: str, value: str) -> None:
    per_name = _UNSETTLED.get(backend)
    if per_name is None:
        per_name = _UNSETTLED.setdefault(backend, {})
    values = per_name.get(name)
    if values is None:
        values = per_name.setdefault(name, collections.deque(maxlen=_MAX_UNSETTLED))
    values.append(value)


def _settle(backend: LockBackend, name: str, adopted: tuple[str, ...]) -> None:
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

    Args:
        client: A ``redis.Redis`` client.
        name: The Redis key of the lock, used as is.
        ttl: Time to live in seconds; the lock is renewed every ``ttl/3``
            while held when ``renew`` is true.
        renew: Keep the lock alive from the process's renewer thread.
        blocking: Default for :meth:`acquire` (and ``with``/decorator use).
        timeout: Default longest wait in seconds for a blocking acquire
            (``None``: wait as long as it takes).
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
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"RedisLock name must be a non-empty str, got {name!r}")
        self.name = name
        self.ttl = validate_ttl(ttl, "RedisLock ttl")
        self.renew = renew
        self.blocking = blocking
        self.timeout = timeout
        self.client = client
        self.backend = LockBackend.for_client(client)
        self.handle: LockHandle | None = None
        self._last_contention = AcquireResult(False)

    def __repr__(self) -> str:
        return f"<RedisLock {self.name!r} {'held' if self.owned else 'free'}>"

    @property
    def owned(self) -> bool:
        """True while this object holds the lock (local check, no round trip)."""
        return self.handle is not None and self.handle.owned

    @property
    def lost(self) -> bool:
        """True when the renewer found the lock gone or taken over while held."""
        return self.handle is not None and self.handle.lost

    @property
    def fence(self) -> int | None:
        """Fencing token of the current acquisition (``None`` when not held)."""
        return None if self.handle is None else self.handle.fence

    def acquire(self, blocking: bool | None = None, timeout: float | None = None) -> bool:
        """Take the lock.

        Args:
            blocking: Wait for the holder to release (woken by its release
                notification, not by polling). Defaults to the constructor's.
            timeout: Longest wait in seconds when blocking (default: the
                constructor's; ``None`` waits as long as it takes).

        Returns:
            True if acquired, False if not (non-blocking, or timed out).

        Raises:
            LockBackendError: Redis is unreachable.
            RuntimeError: this object already holds the lock.
        """
        return self._acquire(blocking, timeout, scoped=False)

    def _acquire(self, blocking: bool | None, timeout: float | None, scoped: bool) -> bool:
        if self.handle is not None and not self.handle.released:
            raise RuntimeError(f"RedisLock {self.name!r} is already held by this object")
        blocking = self.blocking if blocking is None else blocking
        timeout = self.timeout if timeout is None else timeout
        value = LockValue.new(LockOwner.current(None, 0, None), self.name).encode()
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
            handle = self.handle = LockHandle(
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
            ttl_remaining=result.ttl_remaining,
            policy="not_acquired",
        )
        self._last_contention = result

    def release(self) -> ReleaseOutcome | None:
        """Release the lock if held; never raises a Redis error. See :meth:`LockHandle.release`.

        If an exception interrupts it, the release is completed first and the
        exception re-raised.
        """
        handle = self.handle
        if handle is None:
            return None
        try:
            outcome = handle.release()
        except BaseException:
            handle.release()  # once more, then re-raise: deferred, not lost
            raise
        if self.handle is handle:
            self.handle = None
        return outcome

    def extend(self, ttl: float | None = None) -> None:
        """Reset the TTL now. See :meth:`LockHandle.extend`.

        Raises:
            LockNotOwned: the lock is not held by this object.
        """
        if self.handle is None:
            raise LockNotOwned(self.name, "it is not held by this object")
        self.handle.extend(ttl)

    def __enter__(self) -> RedisLock:
        # Scoped: if __exit__ never runs its release (an exception landing on
        # its first instruction), dropping this object stops the renewal and
        # takes the value back, instead of renewing it for ever.
        if not self._acquire(None, None, scoped=True):
            last = self._last_contention
            raise LockContended(self.name, last.holder_task_id, last.ttl_remaining)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.release()
        except BaseException:
            self.release()
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
            )
            with lock:
                return function(*args, **kwargs)

        return locked  # type: ignore[return-value]
