"""What the lock sends and what its replies mean: shared by the sync and asyncio stores (no I/O).

The scripts' KEYS and ARGV, how a reply and a redis-py error read, who is
told of a hand-over.

A free key is taken with ``SET key value NX PX ttl GET`` (:func:`set_nx_get`):
its reply is ``None`` when it took the key, else the value found there
(:func:`after_set_nx_get` says what that means). A found value that is our
own (an acquire retried after its reply was lost) or one we may adopt (a
queued value, the values of our earlier unanswered acquires) is taken over
by ``ACQUIRE_SCRIPT``; any other is the holder. A server that refuses
``NX`` with ``GET`` (Redis < 7) answers "syntax error": the store then takes
every key with the script.

A plain release (our exact value, nothing kept, no fence read) is
``DELIFEQ key value`` on a server that has it (Valkey >= 9): no script runs.
Its 0 says only "not deleted" (the key gone, another holder's, or ours
marked waited for); ``RELEASE_SCRIPT`` then says which (and a marked one
goes on to the full release, which hands over).
A server without it (Redis, Valkey < 9) or an ACL user without it answers
with a refusal (:func:`command_refused`): the store then releases with the
scripts.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError, ResponseError

from celery_redislock.exceptions import LockBackendError
from celery_redislock.key_family import family_of
from celery_redislock.resp import pack_command
from celery_redislock.tokens import without_mark

logger = logging.getLogger("celery_redislock.backend")

__all__ = [
    "KEPT_WAITED",
    "RELEASE_RETRIED",
    "RENEW_CHUNK_SIZE",
    "TAKE_OVER",
    "ReleaseAttempts",
    "RenewItem",
    "accepted",
    "after_native_release",
    "after_retry",
    "after_set_nx_get",
    "backend_error",
    "check_lock_value",
    "command_refused",
    "decode_text",
    "hand_off",
    "kept_waited",
    "native_release",
    "release_call",
    "renew_call",
    "renew_chunks",
    "set_nx_get",
    "takes_keyword",
    "unsupported",
]

#: Locks per renewal script call: bounds how long one call blocks Redis.
#: Each lock comes with its fence counter: 500 keys per call.
RENEW_CHUNK_SIZE = 250
#: What a refusal (not an outage) says: an ACL, a renamed or disabled command.
_REFUSALS = (
    "noperm",
    "no permissions",
    "unknown command",
    "unsupported command",
    "can't run this command",
)

#: :func:`after_set_nx_get`'s answer for a value to take over with ``ACQUIRE_SCRIPT``.
TAKE_OVER: Any = None


# Whole commands in one format each (the two every lock cycle sends): one
# ``%`` instead of the general packer's per-argument loop (measured: 0.45 µs
# against 1.9 µs for the SET).
_SET_NX_GET = (
    b"*7\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
    b"$2\r\nNX\r\n$2\r\nPX\r\n$%d\r\n%s\r\n$3\r\nGET\r\n"
)
_DELIFEQ = b"*3\r\n$7\r\nDELIFEQ\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"


def set_nx_get(key: str, value: str, ttl_ms: int, encoding: str) -> bytes:
    """The command that takes a free key and says who holds a taken one, packed."""
    # A key may be its family (a str subclass): encoded as the general packer does.
    if not isinstance(key, str) or type(value) is not str or type(ttl_ms) is not int:
        # The general packer names what cannot be sent (a float TTL).
        return pack_command(("SET", key, value, "NX", "PX", ttl_ms, "GET"), encoding)
    key_bytes, value_bytes, ttl = key.encode(encoding), value.encode(encoding), b"%d" % ttl_ms
    return _SET_NX_GET % (len(key_bytes), key_bytes, len(value_bytes), value_bytes, len(ttl), ttl)


def check_lock_value(value: Any, ttl_ms: Any = 0) -> None:
    """Refuse a lock value that is not a ``str``, or a TTL that is not an ``int`` of ms.

    Redis would store a ``bytes`` or ``int`` value and take ``"1000"`` as a
    TTL; no lock of this package makes them (its values name their owner),
    so they are refused before anything is sent (review helper-49 F2).

    Raises:
        TypeError: naming what cannot be sent.
    """
    if type(value) is str and type(ttl_ms) is int:
        return
    if type(value) is not str:
        what, wanted = value, "a lock value: it must be a str"
    else:
        what, wanted = ttl_ms, "a lock TTL: it must be an int of milliseconds"
    raise TypeError(f"cannot send {type(what).__name__} {what!r} as {wanted}")


def unsupported(reply: Any) -> bool:
    """The server refused ``SET ... NX ... GET`` (Redis < 7): take keys with the script."""
    return isinstance(reply, ResponseError) and "syntax" in str(reply).lower()


def native_release(key: str, value: str, encoding: str) -> bytes:
    """The plain release where the server has a compare-and-delete command (Valkey >= 9), packed.

    No script runs: the server's cost of a ``DEL``.
    """
    if not isinstance(key, str) or type(value) is not str:
        return pack_command(("DELIFEQ", key, value), encoding)
    key_bytes, value_bytes = key.encode(encoding), value.encode(encoding)
    return _DELIFEQ % (len(key_bytes), key_bytes, len(value_bytes), value_bytes)


def command_refused(reply: Any) -> bool:
    """The server does not know the command, or the ACL user may not run it: nothing ran."""
    if not isinstance(reply, ResponseError):
        return False
    lowered = str(reply).lower()
    return any(marker in lowered for marker in _REFUSALS)


def after_native_release(reply: Any) -> bool | None:
    """What ``DELIFEQ``'s reply says: deleted, not (the script says why), ``None`` refused.

    Raises:
        ResponseError: any other error reply (a cluster redirection: nothing ran).
    """
    if command_refused(reply):
        return None
    if isinstance(reply, ResponseError):
        raise reply
    return bool(reply == 1)


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


#: Whether the last release read in this context (thread, asyncio task) was
#: sent again after a lost reply: its "not ours" may then follow our own
#: release, so the holder does not report it as a loss. Set by
#: :meth:`ReleaseAttempts.outcome`; a side channel, so that the stores'
#: ``release`` keeps returning a plain :class:`~.outcomes.ReleaseOutcome`.
RELEASE_RETRIED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "redislock_release_retried", default=False
)


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
        RELEASE_RETRIED.set(False)
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
        RELEASE_RETRIED.set(self.retried)
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


def decode_text(value: Any, encoding: str) -> str:
    """A reply (bytes or str) as text."""
    if isinstance(value, bytes):
        return value.decode(encoding, "replace")
    return str(value)


def backend_error(exc: RedisError, operation: str, key: str, where: str) -> LockBackendError:
    """The :class:`LockBackendError` for a redis-py error during ``operation`` on ``key``.

    A refusal (ACL, unknown command) names the commands the lock needs.
    """
    if isinstance(exc, ResponseError):
        detail = str(exc)
        lowered = detail.lower()
        refused = any(marker in lowered for marker in _REFUSALS)
        if refused:
            detail += (
                " (the lock store must allow EVAL/EVALSHA, GET, SET, PEXPIRE, PTTL, DEL, "
                "TIME, APPEND and PUBLISH on the lock keys for this user, SUBSCRIBE for "
                "the wait policy, and the list, hash and sorted-set commands of hand-off, "
                "coalescing, debounce and the workers' sweep; see the ACL list in the "
                "docs' Redis topologies page, docs/_parts/topologies.md)"
            )
        error = LockBackendError(f"Redis at {where} refused to {operation} lock {key!r}: {detail}")
        error.refused = refused
        return error
    return LockBackendError(
        f"cannot {operation} lock {key!r}: Redis at {where} is unavailable "
        f"({type(exc).__name__}: {exc})"
    )


def release_call(
    key: str,
    match: str,
    mode: str,
    keep: str,
    keep_ms: int,
    handoff_ttl_ms: int,
    fence_ttl_ms: int = 0,
    retry: bool = False,
) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """KEYS and ARGV of ``RELEASE_FULL_SCRIPT``: one place for the sync and asyncio stores.

    ``retry``: the release is sent again after its reply was lost.
    """
    family = family_of(key)
    waiters, parked, _ = family.handoff
    args = (
        match,
        mode,
        family.channel,
        keep,
        max(keep_ms, 1),
        handoff_ttl_ms,
        fence_ttl_ms,
        "1" if retry else "",
    )
    return (key, waiters, parked, family.fence), args


RenewItem = tuple[str, str, int] | tuple[str, str, int, bool]


def renew_call(chunk: Sequence[RenewItem], fence_ttl_ms: int) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``RENEW_SCRIPT`` for ``(key, value, ttl_ms[, fenced])`` items.

    A fenced item (its holder read a fence) renews its fence counter too.
    """
    keys = [item[0] for item in chunk]
    fenced = [len(item) > 3 and bool(item[3]) for item in chunk]
    keys += [family_of(item[0]).fence for item, flag in zip(chunk, fenced, strict=True) if flag]
    args: list[Any] = [item[1] for item in chunk] + [item[2] for item in chunk]
    args += ["1" if flag else "" for flag in fenced]
    args.append(fence_ttl_ms)
    return keys, args


def renew_chunks(
    items: Sequence[RenewItem], fence_ttl_ms: int
) -> list[tuple[list[str], list[Any]]]:
    """:func:`renew_call` for each chunk of at most :data:`RENEW_CHUNK_SIZE` items."""
    return [
        renew_call(items[start : start + RENEW_CHUNK_SIZE], fence_ttl_ms)
        for start in range(0, len(items), RENEW_CHUNK_SIZE)
    ]


#: ``RELEASE_FULL_SCRIPT``'s reply: kept, and a parked call or a waiter had marked the key.
KEPT_WAITED = 3


def kept_waited(look: Callable[[str, int], None] | None, key: str, kept_ms: int) -> None:
    """A release kept ``key`` for ``kept_ms`` and someone waits behind it: tell ``look``.

    ``look`` is the store's ``on_kept_waited`` (the app's sweep schedule).
    A lock-store error is logged, not raised: without it, the sweep looks
    at the key on its first schedule (one run TTL after the call parked),
    later but not never. Anything else (a soft time limit landing in its
    round trip) propagates: the caller sends the release again and re-raises
    (review helper-47 F1: it was swallowed, and the task reported SUCCESS).
    """
    if look is None:
        return
    try:
        look(key, kept_ms)
    except (LockBackendError, RedisError):
        logger.warning(
            "lock %s is kept for %d ms with calls behind it; the sweep keeps its first "
            "schedule for them",
            key,
            kept_ms,
            exc_info=True,
        )


def hand_off(publish: Callable[[str, str, bytes], None] | None, key: str, reply: Any) -> None:
    """A release handed ``key`` to a parked execution: publish its message.

    ``reply`` is the script's ``[1, hand-off value, message]``; ``publish``
    the store's ``on_handoff`` (``None``: this process cannot publish),
    which keeps a publish that fails for a sweep to make (else the parked
    execution's own re-sent copy runs at its deadline, and a sweep hands it
    the lock once the hold expires). What it
    raises is an interruption landing in it (a soft time limit, an
    ``Exception`` too): it propagates, the holder sends its release again
    and re-raises, and that release, a retry, publishes again (swallowed
    here, the task reported SUCCESS).
    """
    if publish is None:
        logger.warning(
            "lock %s was handed to a parked execution, but this process cannot publish "
            "its message; its re-sent copy runs when its countdown ends",
            key,
        )
        return
    _, waiter, message = reply
    if isinstance(message, str):  # a client with decode_responses
        message = message.encode("utf-8")
    publish(key, decode_text(waiter, "utf-8"), message)
