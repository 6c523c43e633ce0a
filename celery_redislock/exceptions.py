"""Every error the package raises, under one root: :class:`RedisLockError`."""

from __future__ import annotations

from typing import Any

__all__ = [
    "AlreadyQueued",
    "ConfigurationError",
    "LockBackendError",
    "LockContended",
    "LockKeyError",
    "LockLost",
    "LockNotOwned",
    "LockStoreRefused",
    "RedisLockError",
]


class RedisLockError(Exception):
    """Base class for everything celery-redislock raises."""


class ConfigurationError(RedisLockError, ValueError):
    """A setting or task attribute has a value the package cannot use."""


class LockKeyError(RedisLockError, TypeError):
    """The task's arguments cannot be turned into a lock key."""


class LockBackendError(RedisLockError):
    """Redis could not be reached or refused a lock command.

    The underlying redis-py exception is chained as ``__cause__``.

    Attributes:
        refused: The server refused the command (an ACL, a disabled
            command), rather than failed to answer.
    """

    refused = False


class LockStoreRefused(LockBackendError):
    """The lock store refuses the package's commands (an ACL, a disabled command).

    Not an outage that time mends: a worker that meets it at start does not
    start (as with a bad setting).
    """

    refused = True


class LockContended(RedisLockError):
    """The lock is held by someone else.

    Raised by the ``raise`` policy (the task ends in FAILURE with it) and by
    :meth:`RedisLock.acquire` when a blocking acquire times out.

    Attributes:
        key: The Redis key of the lock.
        holder_task_id: Task id of the current holder, or ``None`` when the
            holder is not a Celery task (or the value could not be parsed).
        ttl_remaining: Seconds until the holder's lock expires unless renewed.
    """

    def __init__(
        self, key: str, holder_task_id: str | None = None, ttl_remaining: float | None = None
    ) -> None:
        # The plain key: the exception may be a task's result, serialized
        # (kombu's yaml refuses str subclasses, such as a key's family).
        self.key = key = str.__str__(key) if isinstance(key, str) else key
        self.holder_task_id = holder_task_id
        self.ttl_remaining = ttl_remaining
        super().__init__(key, holder_task_id, ttl_remaining)

    def __reduce__(self) -> tuple[Any, ...]:
        # Celery pickles exceptions into the result backend and across the
        # prefork pipe; keep every field through that round trip.
        return (type(self), (self.key, self.holder_task_id, self.ttl_remaining))

    def __str__(self) -> str:
        holder = self.holder_task_id or "an unknown holder"
        ttl = "unknown" if self.ttl_remaining is None else f"{self.ttl_remaining:.3f}s"
        return f"lock {self.key!r} is held by {holder} (expires in {ttl} unless renewed)"


class AlreadyQueued(LockContended):
    """A duplicate was not published: the same call is already queued or running.

    Raised by ``apply_async``/``delay`` of a task with ``lock_enqueue`` and
    ``lock_enqueue_raise`` (otherwise the holder's ``AsyncResult`` is
    returned). ``holder_task_id`` is the id of the task that holds the key.
    """

    def __str__(self) -> str:
        holder = self.holder_task_id or "an unknown holder"
        return f"not published: {holder} already holds {self.key!r}"


class LockNotOwned(RedisLockError):
    """An operation needed the lock but this holder no longer owns it."""

    def __init__(self, key: str = "", detail: str = "") -> None:
        self.key = key
        self.detail = detail
        super().__init__(key, detail)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.detail))

    def __str__(self) -> str:
        suffix = f": {self.detail}" if self.detail else ""
        return f"lock {self.key!r} is not owned by this holder{suffix}"


class LockLost(LockNotOwned):
    """The lock was found gone or taken over while it was held.

    Raised inside a running task when ``lock_on_lost="abort"``. In a thread
    other than the main one it arrives as an asynchronous exception, which
    Python raises as the bare class: no key then (the log and the
    ``lock_lost`` signal name it).
    """

    def __str__(self) -> str:
        if not self.key:
            return "the lock was lost while held; execution aborted"
        return super().__str__()
