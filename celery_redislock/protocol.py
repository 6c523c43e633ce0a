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

from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from celery_redislock.tokens import without_mark

__all__ = ["TAKE_OVER", "after_set_nx_get", "set_nx_get", "unsupported"]

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
