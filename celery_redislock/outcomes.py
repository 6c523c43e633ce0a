"""What a lock operation found: the result and outcome types both stores return (no I/O)."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery_redislock._clock import clock
from celery_redislock.exceptions import LockBackendError
from celery_redislock.protocol import decode_text
from celery_redislock.tokens import LockValue, without_mark

__all__ = [
    "RELEASE_NAMES",
    "RELEASE_OUTCOMES",
    "AcquireResult",
    "ParkResult",
    "ReleaseOutcome",
    "RenewOutcome",
    "held_by",
    "release_wait",
]

# The stores' logger (the module was backend.py).
logger = logging.getLogger("celery_redislock.backend")


class ReleaseOutcome(enum.Enum):
    """What a release found."""

    RELEASED = 1
    ALREADY_GONE = 0
    NOT_OURS = -1


#: ``ReleaseOutcome(reply)`` and each outcome's signal name, looked up
#: without the enum's call (0.8 µs of every release).
RELEASE_OUTCOMES = {outcome.value: outcome for outcome in ReleaseOutcome}
RELEASE_NAMES = {outcome: outcome.name.lower() for outcome in ReleaseOutcome}


class RenewOutcome(enum.Enum):
    """What a renewal found for one key."""

    RENEWED = 1
    GONE = 0
    STOLEN = -1


class AcquireResult:
    """The reply of one acquire.

    Attributes:
        acquired: True when the lock is now ours.
        holder: The current holder's raw value when contended.
        sent_at: :func:`clock` reading just before the acquire was sent.
        fence: Unused: fences are issued on demand (:meth:`LockStore.fence`).
        key: The key taken, when acquired with :meth:`LockStore.acquire_slot`:
            the slot key (``None`` from :meth:`LockStore.acquire`: the key
            itself).
    """

    __slots__ = ("_ttl", "_ttl_of", "acquired", "fence", "holder", "key", "sent_at")

    def __init__(
        self,
        acquired: bool,
        holder: str | None = None,
        ttl_remaining: float | None = None,
        sent_at: float = 0.0,
        fence: int | None = None,
        key: str | None = None,
        *,
        ttl_of: Callable[[], float | None] | None = None,
    ) -> None:
        self.acquired = acquired
        self.holder = holder
        self._ttl = ttl_remaining
        self._ttl_of = ttl_of
        self.sent_at = sent_at
        self.fence = fence
        self.key = key

    def __repr__(self) -> str:
        return (
            f"AcquireResult(acquired={self.acquired}, holder={self.holder!r}, "
            f"ttl_remaining={self._ttl!r}, key={self.key!r})"
        )

    @property
    def ttl_remaining(self) -> float | None:
        """Seconds left on the holder's lock when contended (``None``: no expiry, or gone).

        A contended ``SET NX GET`` says who holds the key, not for how long:
        the first read asks the server (one round trip, a ``PTTL``), so a
        caller that never needs it (the skip policy) never pays for it. A
        store gone by then leaves it unknown (``None``): the contention is
        what the acquire found, and the caller's policy still applies.
        """
        read, self._ttl_of = self._ttl_of, None
        if read is not None:
            try:
                self._ttl = read()
            except LockBackendError as exc:
                logger.info("the holder's TTL is unknown: %s", exc)
        return self._ttl

    @property
    def known_ttl(self) -> float | None:
        """:attr:`ttl_remaining` if it was read (or came with the reply), else ``None``."""
        return self._ttl

    @property
    def holder_value(self) -> LockValue | None:
        """The holder's decoded value, when it is in this package's format."""
        return None if self.holder is None else LockValue.decode(self.holder)

    @property
    def holder_task_id(self) -> str | None:
        """Task id of the holder, when the holder is a Celery task."""
        decoded = self.holder_value
        if decoded is None or not decoded.owner.task_id:
            return None
        return decoded.owner.task_id


@dataclass(frozen=True)
class ParkResult:
    """The reply of :meth:`LockStore.park`.

    Attributes:
        result: Granted, or the holder (as :meth:`LockStore.acquire`).
        parked: Not granted, and queued behind the holder.
        already_ran: This hand-off value's execution was already granted
            the lock once: this is a second copy of it.
    """

    result: AcquireResult
    parked: bool = False
    already_ran: bool = False


def release_wait(result: AcquireResult, deadline: float) -> float | None:
    """How long a waiting acquire that got ``result`` waits for a release (``None``: done).

    Capped at the holder's remaining TTL, so a lost message or a holder that
    died costs at most that long.
    """
    remaining = deadline - clock()
    if result.acquired or remaining <= 0:
        return None
    if result.ttl_remaining is not None:
        return min(remaining, result.ttl_remaining + 0.005)
    return remaining


def held_by(
    reply: Any, sent_at: float, encoding: str, ttl_of: Callable[[], float | None] | None = None
) -> AcquireResult:
    """A contended acquire's (or park's) reply ``[0, holder, pttl, ...]`` as its result.

    A ``None`` PTTL is a contended ``SET NX GET``'s: it says who holds the
    key, not for how long; ``ttl_of`` reads it on demand (none: unknown).
    """
    holder = None if reply[1] is None else without_mark(decode_text(reply[1], encoding))
    if reply[2] is None:
        return AcquireResult(False, holder, sent_at=sent_at, ttl_of=ttl_of)
    pttl = int(reply[2])
    return AcquireResult(False, holder, pttl / 1000.0 if pttl >= 0 else None, sent_at=sent_at)
