"""What the lock's replies mean: decisions shared by the sync and asyncio stores (no I/O).

A free key is taken with ``SET key value NX PX ttl GET`` (:func:`set_nx_get`):
its reply is ``None`` when it took the key, else the value found there
(:func:`after_set_nx_get` says what that means). A found value that is our
own (an acquire retried after its reply was lost) or one we may adopt (a
queued value, the values of our earlier unanswered acquires) is taken over
by ``ACQUIRE_SCRIPT``; any other is the holder. A server that refuses
``NX`` with ``GET`` (Redis < 7) answers "syntax error": the store then takes
every key with the script.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from celery_redislock.tokens import without_mark

logger = logging.getLogger("celery_redislock.backend")

__all__ = [
    "TAKE_OVER",
    "ReleaseAttempts",
    "after_retry",
    "after_set_nx_get",
    "set_nx_get",
    "takes_keyword",
    "unsupported",
]

#: :func:`after_set_nx_get`'s answer for a value to take over with ``ACQUIRE_SCRIPT``.
TAKE_OVER: Any = None


def set_nx_get(key: str, value: str, ttl_ms: int) -> tuple[Any, ...]:
    """The command that takes a free key and says who holds a taken one."""
    return ("SET", key, value, "NX", "PX", ttl_ms, "GET")


def unsupported(reply: Any) -> bool:
    """The server refused ``SET ... NX ... GET`` (Redis < 7): take keys with the script."""
    return isinstance(reply, ResponseError) and "syntax" in str(reply).lower()


def after_set_nx_get(reply: Any, own: Sequence[str], encoding: str) -> Any:
    """The acquire's reply, as ``ACQUIRE_SCRIPT`` gives it, from ``SET NX GET``'s.

    Args:
        reply: ``SET NX GET``'s reply (``None``, or the value found).
        own: Our value, then the values we may take over.
        encoding: How the reply's text is encoded.

    Returns:
        ``[1]`` taken; ``[0, holder, None]`` held by another (its PTTL
        unread); :data:`TAKE_OVER` when the value found is one of ``own``.

    Raises:
        ResponseError: the server refused the command (other than a Redis
            too old for it: see :func:`unsupported`).
    """
    if reply is None:
        return [1]
    if isinstance(reply, ResponseError):
        raise reply
    found = reply.decode(encoding, "replace") if isinstance(reply, bytes) else str(reply)
    if without_mark(found) in own:
        return TAKE_OVER
    return [0, reply, None]


class ReleaseAttempts:
    """One release's attempts: which script each runs, and what its reply means.

    An attempt whose reply never came back (a timeout, a dropped connection,
    or an exception between sending it and reading its reply, after which
    the caller sends the release again: ``resent``) may have run. The next
    attempt is then a retry (``RELEASE_FULL_SCRIPT`` with ``ARGV[8]`` set):
    it publishes a hand-over the lost reply carried, and its "already gone"
    or "another holder" most likely follows our own release, so both are
    reported as released. An attempt answered with an error (a cluster
    redirection, ``TRYAGAIN``) ran nothing: the next is not a retry.

    The stores call :meth:`start` as an attempt is sent, :meth:`answered`
    once its reply is read (an error reply too), and :meth:`outcome` on the
    last reply.
    """

    __slots__ = ("key", "retried", "unanswered")

    def __init__(self, key: str, resent: bool = False) -> None:
        self.key = key
        self.unanswered = resent
        self.retried = False

    def start(self) -> bool:
        """An attempt is being sent: True when it must run as a retry."""
        retry, self.unanswered = self.unanswered, True
        self.retried = self.retried or retry
        return retry

    def answered(self) -> None:
        """The attempt's reply was read: whatever it says, it is known."""
        self.unanswered = False

    def outcome(self, reply: Any) -> Any:
        """The release's reply: 1 (or a slot number), 0, -1 or ``[1, value, message]``."""
        return after_retry(self.key, reply) if self.retried else reply


def after_retry(key: str, reply: Any) -> Any:
    """What a release sent again after a lost reply found (see :class:`ReleaseAttempts`)."""
    if isinstance(reply, list) or int(reply) > 0:
        return reply
    logger.info(
        "release of lock %s was sent again after its reply was lost; it found the key %s: "
        "the first attempt released it",
        key,
        "gone" if int(reply) == 0 else "held by the next holder",
    )
    return 1


def takes_keyword(method: Callable[..., Any], name: str) -> bool:
    """Whether ``method`` accepts ``name`` as a keyword (an override may predate it)."""
    parameters = inspect.signature(method).parameters.values()
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)
