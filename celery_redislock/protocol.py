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

import functools
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
    "accepted",
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
    means the first attempt worked. An attempt answered with an error (a
    cluster redirection, ``TRYAGAIN``) ran nothing: whether the next is a
    retry depends on the attempts before it.

    The stores call :meth:`start` as an attempt is sent, then
    :meth:`answered` once its reply is read, or :meth:`refused` for an
    error reply, and :meth:`outcome` on the last reply.
    """

    __slots__ = ("_before", "key", "retried", "unanswered")

    def __init__(self, key: str, resent: bool = False) -> None:
        self.key = key
        self.unanswered = resent
        self.retried = False
        self._before = resent

    def start(self) -> bool:
        """An attempt is being sent: True when it must run as a retry."""
        retry = self._before = self.unanswered
        self.unanswered = True
        self.retried = self.retried or retry
        return retry

    def answered(self) -> None:
        """The attempt's reply was read: whatever it says, it is known."""
        self.unanswered = False

    def refused(self) -> None:
        """The attempt was answered with an error: it ran nothing, the state is as before it."""
        self.unanswered = self._before

    def outcome(self, reply: Any) -> Any:
        """The release's reply: 1 (or a slot number), 0, -1 or ``[1, value, message]``."""
        return after_retry(self.key, reply) if self.retried else reply


def after_retry(key: str, reply: Any) -> Any:
    """What a release sent again after a lost reply found (see :class:`ReleaseAttempts`).

    "Already gone" means the first attempt released the key. Another holder's
    value may follow our own release as well as a lock lost before it (the
    first attempt may have failed before anything was sent): it stays -1,
    the key left alone.
    """
    if isinstance(reply, list) or int(reply) != 0:
        return reply
    logger.info(
        "release of lock %s was sent again after its reply was lost and found the key gone: "
        "the first attempt released it",
        key,
    )
    return 1


@functools.lru_cache(maxsize=64)
def takes_keyword(method: Callable[..., Any], name: str) -> bool:
    """Whether ``method`` (a class's function) accepts ``name``: an override may predate it."""
    parameters = inspect.signature(method).parameters.values()
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


def accepted(method: Callable[..., Any], **flags: bool) -> dict[str, bool]:
    """The ``flags`` that are set and that ``method`` (a class's function) accepts.

    A flag is passed only when set, and only to an override that takes it,
    so an override written before the flag existed still works (without
    what the flag adds).
    """
    return {name: True for name, on in flags.items() if on and takes_keyword(method, name)}
