"""The task message as the lock sees it: the headers it adds, and the arguments as received.

The producer stores a queued token at enqueue time and names it in a header;
a re-send (a lock retry, a lock-store backoff) carries counters and the
values of acquires whose replies were lost. A header can only ever name
values of its own task id: a forged or copied header cannot take another
task's lock. Keys are computed from the arguments as a worker receives them
(:func:`as_received`), never from the caller's objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from celery.utils.time import maybe_iso8601, maybe_make_aware
from kombu.exceptions import EncodeError
from kombu.serialization import dumps as kombu_dumps
from kombu.serialization import loads as kombu_loads

from celery_redislock.exceptions import LockKeyError
from celery_redislock.tokens import LockValue

__all__ = [
    "BACKEND_RETRIES_HEADER",
    "DEBOUNCE_HEADER",
    "HANDOFF_COPY_HEADER",
    "HANDOFF_HEADER",
    "LOCK_RETRIES_HEADER",
    "MAX_UNSETTLED",
    "PARKED_SINCE_HEADER",
    "QUEUED_TOKEN_HEADER",
    "REDELIVERED_HEADER",
    "UNSETTLED_HEADER",
    "LockKeyEncodeError",
    "as_received",
    "aware_eta",
    "own_values",
    "queued_token",
    "redelivered",
    "request_header",
    "seconds_until",
]

#: Message header counting retries caused by contention.
LOCK_RETRIES_HEADER = "redislock_lock_retries"
#: Message header counting retries caused by an unreachable lock store.
BACKEND_RETRIES_HEADER = "redislock_backend_retries"
#: Message header listing the values of this execution's earlier acquires
#: whose replies were lost (a lock-store error): the retry takes them over.
UNSETTLED_HEADER = "redislock_unsettled"
#: Set on the re-send of a redelivered message: it stays a redelivered copy
#: (retried, never skipped, while its key is held) however often it is re-sent.
REDELIVERED_HEADER = "redislock_redelivered"
#: At most this many unsettled values travel in the header.
MAX_UNSETTLED = 16

#: Message header carrying the value a producer stored at enqueue time.
QUEUED_TOKEN_HEADER = "redislock_token"
#: Message header of a parked execution's copies: its hand-off value (the
#: value a release leaves in the key to hand the lock to it).
HANDOFF_HEADER = "redislock_handoff"
#: Message header telling a parked execution's copies apart: the woken copy
#: and each safety-net re-send carry a tag of their own.
HANDOFF_COPY_HEADER = "redislock_handoff_copy"
#: Message header of a debounced run (``lock_debounce``): its burst may
#: still move its due time, which the worker checks before it runs.
DEBOUNCE_HEADER = "redislock_debounced"
#: Message header: Unix time (seconds) the execution first parked.
PARKED_SINCE_HEADER = "redislock_parked_since"


def request_header(request: Any, name: str) -> Any:
    """A custom header of ``request``, wherever Celery put it (None if absent).

    Celery flattens custom headers into request attributes in a worker;
    eager ``apply()`` keeps them in ``headers`` only.
    """
    return (request.headers or {}).get(name) or getattr(request, name, None)


def redelivered(request: Any) -> bool:
    """This message was delivered before (or is the re-send of one that was)."""
    return bool(
        (request.delivery_info or {}).get("redelivered")
        or (request.headers or {}).get(REDELIVERED_HEADER)
    )


def queued_token(request: Any) -> str | None:
    """The enqueue-time value a message carries, if it is this task's own."""
    own = own_values(request, [request_header(request, QUEUED_TOKEN_HEADER)])
    return own[0] if own else None


def own_values(request: Any, values: Any) -> list[str]:
    """The values in a header that belong to this task id (a header cannot take another's lock)."""
    if not isinstance(values, (list, tuple)):
        return []
    own = []
    for value in values:
        if isinstance(value, str):
            decoded = LockValue.decode(value)
            if decoded is not None and decoded.owner.task_id == request.id:
                own.append(value)
    return own


def aware_eta(when: Any) -> datetime | None:
    """An ETA (datetime or ISO 8601, as Celery parses it) as an aware datetime; else ``None``.

    A naive ETA is UTC, as Celery reads it.
    """
    if isinstance(when, str):
        when = maybe_iso8601(when)
    return maybe_make_aware(when) if isinstance(when, datetime) else None


def seconds_until(when: Any) -> float:
    """Seconds from now until a countdown (number) or an ETA (see :func:`aware_eta`)."""
    if isinstance(when, (int, float)):
        return max(float(when), 0.0)
    eta = aware_eta(when)
    if eta is None:
        return 0.0
    return max((eta - datetime.now(timezone.utc)).total_seconds(), 0.0)


class LockKeyEncodeError(LockKeyError, EncodeError):
    """The task's serializer refuses the arguments: no key, and nothing is published.

    Both the package's :class:`~celery_redislock.exceptions.LockKeyError`
    (a ``TypeError``) and kombu's ``EncodeError``, which Celery raises from
    ``delay()`` of a task without the lock for the same arguments: code
    that catches either around ``delay()`` catches it.
    """


def as_received(
    args: Sequence[Any], kwargs: Mapping[str, Any], serializer: str | None, task_name: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments as a worker will receive them: a round trip through ``serializer``.

    The key must be computed from what the worker sees, or the producer's
    enqueue lock could never be taken over by the worker (measured: a NumPy
    float gave one key in the producer and another in the worker).

    Raises:
        LockKeyEncodeError: the serializer refuses the arguments (kombu's
            ``EncodeError``, as a task without the lock raises at publish).
        LockKeyError: the serialized arguments cannot be read back.
    """
    try:
        content_type, encoding, body = kombu_dumps(
            (list(args), dict(kwargs)), serializer=serializer or "json"
        )
    except Exception as exc:
        raise LockKeyEncodeError(
            f"{task_name}: the arguments cannot be sent with the {serializer!r} serializer: {exc}"
        ) from exc
    try:
        received = kombu_loads(body, content_type, encoding, accept={content_type})
    except Exception as exc:
        raise LockKeyError(
            f"{task_name}: the arguments cannot be read back with the {serializer!r} "
            f"serializer: {exc}"
        ) from exc
    return tuple(received[0]), dict(received[1])
