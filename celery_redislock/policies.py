"""What a task does when its lock is held by someone else.

A policy is a small object with one method, :meth:`ContentionPolicy.handle`,
which gets a :class:`Contention` describing the situation and either

* returns :data:`LOCK_ACQUIRED` (the lock is ours now: run the body),
* returns a value (the task's result; the body does not run), or
* raises (``celery.exceptions.Retry`` via :meth:`Contention.retry`, or
  :class:`LockContended`).

Policies compose: ``Wait(timeout=5, then=Retry(then=Skip()))``. The strings
``"skip"``, ``"retry"``, ``"raise"`` and ``"wait"`` are shorthands for the
default-configured objects.
"""

from __future__ import annotations

import math
import numbers
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from difflib import get_close_matches
from typing import Any, NoReturn

from celery.utils.time import get_exponential_backoff_interval

from celery_redislock.exceptions import ConfigurationError, LockContended
from celery_redislock.key_family import plain_key

__all__ = [
    "BACKEND_BACKOFF_MAX",
    "LOCK_ACQUIRED",
    "SKIPPED_MARKER",
    "Contention",
    "ContentionPolicy",
    "HandOff",
    "Raise",
    "Retry",
    "RetryInsteadOfSkip",
    "RetryWhileOwnDeliveryHolds",
    "Skip",
    "Wait",
    "backend_error_countdown",
    "is_skipped",
    "resolve_policy",
    "skipped_result",
    "uses_handoff",
]


class _Acquired:
    def __repr__(self) -> str:
        return "LOCK_ACQUIRED"


#: Returned by a policy that managed to take the lock after all.
LOCK_ACQUIRED: Any = _Acquired()

#: Key that marks a skip result; its value is always ``"skipped"``.
SKIPPED_MARKER = "__redislock__"


def skipped_result(key: str, task_name: str, holder_task_id: str | None) -> dict[str, Any]:
    """Return the JSON-serialisable result of a skipped execution.

    It is a dict ``{"__redislock__": "skipped", "key": ..., "task": ...,
    "holder": <holder task id or None>}``; test for it with
    :func:`is_skipped`.
    """
    # The plain key (a result is serialized: kombu's yaml refuses a key's family).
    return {
        SKIPPED_MARKER: "skipped",
        "key": plain_key(key),
        "task": task_name,
        "holder": holder_task_id,
    }


def is_skipped(value: Any) -> bool:
    """Return True if ``value`` is the result of a skipped execution."""
    return isinstance(value, dict) and value.get(SKIPPED_MARKER) == "skipped"


@dataclass
class Contention:
    """What a policy knows about one failed acquisition, and what it may do.

    Attributes:
        key: Redis key of the lock.
        task_name: Name of the contending task.
        task_id: Id of the contending task.
        holder_task_id: Id of the task holding the lock (``None`` if unknown).
        ttl_remaining: Seconds left on the holder's lock (``None`` if unknown).
        redelivered: The broker redelivered this message.
        lock_retries: How many times this execution was already retried
            because of contention (counted apart from ``max_retries``).
        wait_for_lock: ``wait_for_lock(timeout)`` waits up to ``timeout``
            seconds for the lock and returns True once it is ours.
        retry_later: ``retry_later(countdown, exc)`` re-sends the task to run
            again in ``countdown`` seconds and raises Celery's ``Retry``.
        park: ``park(countdown, exc)`` queues this execution behind the
            holder, to be handed the lock by its release, and re-sends a
            copy due in ``countdown`` seconds as a safety net; raises
            Celery's ``Retry`` (or returns :data:`LOCK_ACQUIRED` if the lock
            was free by then). ``None`` where parking is impossible (eager).
        parked_for: Seconds since this execution first parked (0 if never).
        withdraw: ``withdraw()`` takes a parked call out of the queue for
            good (no copy of it runs); ``None`` where it never parked.
    """

    key: str
    task_name: str
    task_id: str | None
    holder_task_id: str | None
    ttl_remaining: float | None
    redelivered: bool
    lock_retries: int
    wait_for_lock: Callable[[float], bool] = field(repr=False)
    retry_later: Callable[[float, Exception], NoReturn] = field(repr=False)
    park: Callable[[float, Exception], Any] | None = field(default=None, repr=False)
    parked_for: float = 0.0
    withdraw: Callable[[], None] | None = field(default=None, repr=False)

    def error(self) -> LockContended:
        """Return the :class:`LockContended` error describing this contention."""
        return LockContended(self.key, self.holder_task_id, self.ttl_remaining)


def _non_negative(value: Any, where: str, whole: bool = False) -> Any:
    """``value``, a finite number >= 0 (``whole``: an int); else a ``ConfigurationError``."""
    kind = numbers.Integral if whole else numbers.Real
    if not isinstance(value, kind) or isinstance(value, bool) or not math.isfinite(value):
        what = "an int" if whole else "a finite number of seconds"
        raise ConfigurationError(f"{where} must be {what} >= 0, got {value!r}")
    if value < 0:
        raise ConfigurationError(f"{where} must be >= 0, got {value!r}")
    # A Fraction of a second works, as a float: the waits take floats.
    return value if whole or isinstance(value, (int, float)) else float(value)


class ContentionPolicy(ABC):
    """Base class of contention policies."""

    #: Short name, used in logs and in the ``lock_contended`` signal.
    name: str = "custom"
    #: Whether it reads :attr:`Contention.ttl_remaining`: finding the holder's
    #: remaining TTL costs a round trip more, which a policy that never reads
    #: it (:class:`Skip`) is spared. Custom policies get it.
    needs_ttl: bool = True

    @abstractmethod
    def handle(self, contention: Contention) -> Any:
        """Decide what happens; see the module docstring for the contract."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash(type(self))


class Skip(ContentionPolicy):
    """Do not run the body; return :func:`skipped_result` (state SUCCESS)."""

    name = "skip"
    needs_ttl = False

    def handle(self, contention: Contention) -> Any:
        """Return the skip marker naming the key and the holder."""
        return skipped_result(contention.key, contention.task_name, contention.holder_task_id)


class Raise(ContentionPolicy):
    """Fail the task with :class:`LockContended` (state FAILURE)."""

    name = "raise"

    def handle(self, contention: Contention) -> Any:
        """Raise :class:`LockContended`."""
        raise contention.error()


class Retry(ContentionPolicy):
    """Re-send the task to run later, with a retry budget of its own.

    Lock retries do not count against the task's ``max_retries``; they are
    counted in a message header instead.

    Args:
        countdown: Seconds until the retry; ``None`` uses the holder's
            remaining TTL (when the lock is free at the latest, even if the
            holder died), or 1 s if that is unknown.
        max_retries: Lock retries allowed before ``then`` decides (``None``:
            no limit, as Celery's own ``max_retries``).
        jitter: Up to this many random seconds are added to the countdown, so
            many duplicates do not all come back at the same instant.
        then: Policy used once the budget is spent (default: :class:`Raise`,
            so the execution ends visibly in FAILURE, never silently).
    """

    name = "retry"

    def __init__(
        self,
        countdown: float | None = None,
        max_retries: int | None = 10,
        jitter: float = 1.0,
        then: ContentionPolicy | str | None = None,
    ) -> None:
        if countdown is not None:
            _non_negative(countdown, "Retry countdown")
        if max_retries is not None:  # None: no limit, as Celery's own max_retries
            _non_negative(max_retries, "Retry max_retries", whole=True)
        self.countdown = countdown
        self.max_retries = max_retries
        self.jitter = _non_negative(jitter, "Retry jitter")
        self.then = resolve_policy(then) if then is not None else Raise()

    def countdown_for(self, contention: Contention) -> float:
        """Return the countdown (seconds) for this contention."""
        base = self.countdown
        if base is None:
            base = contention.ttl_remaining if contention.ttl_remaining is not None else 1.0
        return base + (random.uniform(0, self.jitter) if self.jitter else 0.0)

    def handle(self, contention: Contention) -> Any:
        """Re-send the task after :meth:`countdown_for`; once the budget is spent, ``then``."""
        if self.max_retries is not None and contention.lock_retries >= self.max_retries:
            return self.then.handle(contention)
        return contention.retry_later(self.countdown_for(contention), contention.error())


class Wait(ContentionPolicy):
    """Block in the worker until the lock is released, up to ``timeout``.

    The waiter is woken by the holder's release notification (pub/sub), not
    by polling, and at the latest when the holder's TTL runs out.

    Args:
        timeout: Longest wait in seconds.
        then: Policy used if the lock is still held after ``timeout``
            (default: :class:`Retry`).
    """

    name = "wait"

    def __init__(self, timeout: float = 10.0, then: ContentionPolicy | str | None = None) -> None:
        # No None: a wait without end holds a worker slot for ever (HandOff
        # waits without one).
        self.timeout = _non_negative(timeout, "Wait timeout")
        self.then = resolve_policy(then) if then is not None else Retry()

    def handle(self, contention: Contention) -> Any:
        """Wait for the holder's release up to ``timeout``; then ``then`` decides."""
        if contention.wait_for_lock(self.timeout):
            return LOCK_ACQUIRED
        return self.then.handle(contention)


class HandOff(ContentionPolicy):
    """Run later, handed the lock by the holder's release: no worker slot, no polling.

    The execution parks in the key's queue in Redis and frees its worker
    slot at once. The holder's release hands the lock to the first parked
    execution and publishes its message, so it starts right after the
    release (milliseconds, not the holder's TTL), and parked executions run
    one at a time in the order they parked. As a safety net each parked
    execution also re-sends a copy of itself due when the holder's lock
    would expire: if nobody wakes it (the holder's whole worker died), that
    copy runs it then; whichever copy is granted first runs, the other is
    dropped. In eager mode (no broker) it behaves as :class:`Retry`.

    Args:
        max_wait: Longest time in seconds from the first park to the run;
            then ``then`` decides. ``None``: no limit (it waits as long as
            holders keep the key, re-checking once per holder TTL).
        jitter: Up to this many random seconds are added to the safety-net
            copy's countdown.
        then: Policy used once ``max_wait`` has passed (default
            :class:`Raise`: a visible FAILURE).
    """

    name = "handoff"

    def __init__(
        self,
        max_wait: float | None = 3600.0,
        jitter: float = 1.0,
        then: ContentionPolicy | str | None = None,
    ) -> None:
        if max_wait is not None:
            _non_negative(max_wait, "HandOff max_wait")
        self.max_wait = max_wait
        self.jitter = _non_negative(jitter, "HandOff jitter")
        self.then = resolve_policy(then) if then is not None else Raise()

    def handle(self, contention: Contention) -> Any:
        """Park behind the holder; after ``max_wait``, ``then`` decides."""
        if self.max_wait is not None and contention.parked_for > self.max_wait:
            # Given up: no copy of the call may run after its outcome is set.
            if contention.withdraw is not None:
                contention.withdraw()
            return self.then.handle(contention)
        if contention.park is None:
            # Eager mode (no broker to park on): as Retry, which eager apply()
            # re-runs at once, so with a budget, then ``then``.
            return Retry(jitter=self.jitter, then=self.then).handle(contention)
        countdown = Retry(jitter=self.jitter).countdown_for(contention)
        return contention.park(countdown, contention.error())


def uses_handoff(policy: ContentionPolicy) -> bool:
    """True if ``policy`` (or one it composes with ``then``) is a :class:`HandOff`."""
    seen: ContentionPolicy | None = policy
    while seen is not None:
        if isinstance(seen, HandOff):
            return True
        seen = getattr(seen, "then", None)
    return False


class RetryInsteadOfSkip(ContentionPolicy):
    """Apply ``policy``, but re-send instead of skipping (at any depth of composition).

    For a redelivered message: it may be the only surviving copy of its
    task (its first delivery died holding the lock), so skipping it would
    drop the task. ``Wait(then=Skip())`` skips after its wait; this turns that
    skip into a retry too.
    """

    def __init__(self, policy: ContentionPolicy) -> None:
        self.policy = policy
        self.name = policy.name

    def handle(self, contention: Contention) -> Any:
        """Run ``policy``; a skip result becomes a retry."""
        outcome = self.policy.handle(contention)
        if is_skipped(outcome):
            # Unbounded: its retries count on in its re-sends, and a budget
            # spent behind a long holder would drop the only copy after all.
            return _RETRY_UNBOUNDED.handle(contention)
        return outcome


class RetryWhileOwnDeliveryHolds(ContentionPolicy):
    """Apply ``policy`` for a message whose own task id holds the key, but never drop it.

    The holder is the message's own earlier delivery: dead (its lock expires
    within its TTL) or still running (a visibility-timeout redelivery).
    Skipping or failing the copy would drop the task, or store a result under
    the id the running delivery will store its own. So the configured policy
    decides as usual (a ``Retry``'s countdown, a ``Wait``), but a skip, a
    ``LockContended`` or a spent budget becomes one more retry after the
    holder's remaining TTL, for as long as that holder lives.
    """

    def __init__(self, policy: ContentionPolicy) -> None:
        self.policy = policy
        self.name = policy.name

    def handle(self, contention: Contention) -> Any:
        """Run ``policy``; its skip or failure becomes a retry."""
        try:
            outcome = self.policy.handle(contention)
        except LockContended:
            outcome = skipped_result(contention.key, contention.task_name, None)
        if is_skipped(outcome):
            return _RETRY_UNBOUNDED.handle(contention)
        return outcome


_RETRY_UNBOUNDED = Retry(max_retries=2**62)

_SHORTHANDS: dict[str, Callable[[], ContentionPolicy]] = {
    "skip": Skip,
    "retry": Retry,
    "raise": Raise,
    "wait": Wait,
    "handoff": HandOff,
}


def resolve_policy(
    value: ContentionPolicy | str, where: str = "lock_on_contention"
) -> ContentionPolicy:
    """Turn a policy or its shorthand name into a policy object.

    Raises:
        ConfigurationError: unknown name or wrong type.
    """
    if isinstance(value, ContentionPolicy):
        return value
    if isinstance(value, str) and value.lower() in _SHORTHANDS:
        return _SHORTHANDS[value.lower()]()
    guess = (
        get_close_matches(value.lower(), list(_SHORTHANDS), n=1) if isinstance(value, str) else []
    )
    raise ConfigurationError(
        f"{where} must be one of {', '.join(map(repr, _SHORTHANDS))} or a ContentionPolicy "
        f"object (Skip(), Retry(...), Raise(), Wait(...), HandOff(...)), got {value!r}"
        + (f"; did you mean {guess[0]!r}?" if guess else "")
    )


#: Longest wait, in seconds, before a re-send after a lock-store error.
BACKEND_BACKOFF_MAX = 60.0


def backend_error_countdown(attempt: int) -> float:
    """Seconds before the re-send that follows the ``attempt``-th lock-store error (from 0).

    Celery's exponential backoff (1, 2, 4 ... 60 s) with "equal" jitter:
    between half and all of it. Not Celery's full jitter, which works in
    whole seconds from 0: the first retries would often come back at once,
    against a store that has just failed.
    """
    ceiling = get_exponential_backoff_interval(
        factor=1, retries=attempt, maximum=int(BACKEND_BACKOFF_MAX), full_jitter=False
    )
    return float(ceiling) * random.uniform(0.5, 1.0)
