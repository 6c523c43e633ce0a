"""Lua scripts sent by SHA1: packed once, re-sent as ``EVAL`` after ``NOSCRIPT``, pipelined.

Built on :mod:`celery_redislock.resp` (the wire); the scripts' sources are
in :mod:`celery_redislock.scripts`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from redis.exceptions import NoScriptError, ResponseError

from celery_redislock.resp import pack_arguments, pack_command, send_and_read

__all__ = [
    "Runner",
    "Script",
    "ScriptCall",
    "evals_after_noscript",
    "raise_error_reply",
    "scripts_exchange",
]

T = TypeVar("T")


class Script:
    """A Lua script sent by SHA1, re-sent as ``EVAL`` after ``NOSCRIPT``.

    After ``SCRIPT FLUSH``, a restart or a failover the server answers
    ``NOSCRIPT``; the call is then re-sent once as ``EVAL`` on the same
    connection, which also caches the script again: one extra round trip
    per script per flush, never an error.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        # "EVALSHA <sha>", packed once: the same for every call.
        self._evalsha_head = pack_arguments(("EVALSHA", self.sha))
        self._one_key_one_arg = (
            b"*5\r\n" + self._evalsha_head + b"$1\r\n1\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
        )

    def pack_evalsha(self, keys: Sequence[str], args: Sequence[Any], encoding: str) -> bytes:
        """The packed ``EVALSHA`` command running the script on ``keys`` and ``args``."""
        if len(keys) == 1 and len(args) == 1 and isinstance(keys[0], str) and type(args[0]) is str:
            # A plain release (key, value): one format (0.6 µs, not 1.4). The
            # key may be its family (a str subclass), encoded as the general
            # packer encodes it.
            key, value = keys[0].encode(encoding), args[0].encode(encoding)
            return self._one_key_one_arg % (len(key), key, len(value), value)
        return b"*%d\r\n%s%s" % (
            3 + len(keys) + len(args),
            self._evalsha_head,
            pack_arguments((len(keys), *keys, *args), encoding),
        )

    def evalsha_command(self, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
        """The ``EVALSHA`` command running the script on ``keys`` and ``args``."""
        return ["EVALSHA", self.sha, len(keys), *keys, *args]

    def eval_command(self, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
        """The ``EVAL`` command (sends the source; caches it again after a flush)."""
        return ["EVAL", self.source, len(keys), *keys, *args]

    def exchange(
        self, keys: Sequence[str], args: Sequence[Any], encoding: str
    ) -> Callable[[Any], Any]:
        """Return an exchange that runs the script once and returns its reply.

        Raises (from the exchange):
            ResponseError: the script failed or the server refused it.
        """
        packed = self.pack_evalsha(keys, args, encoding)

        def run(connection: Any) -> Any:
            (reply,) = send_and_read(connection, packed, 1)
            if isinstance(reply, NoScriptError):
                (reply,) = send_and_read(
                    connection, pack_command(self.eval_command(keys, args), encoding), 1
                )
            if isinstance(reply, ResponseError):
                raise reply
            return reply

        return run

    def __call__(self, endpoint: Runner, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run the script on ``endpoint`` and return its reply."""
        return endpoint.run(self.exchange(keys, args, endpoint.encoding))

    def many(
        self, endpoint: Runner, calls: Iterable[tuple[Sequence[str], Sequence[Any]]]
    ) -> list[Any]:
        """Run the script once per ``(keys, args)`` in one pipelined round trip.

        Raises:
            ResponseError: any call failed (other than ``NOSCRIPT``).
        """
        return endpoint.run(scripts_exchange([(self, k, a) for k, a in calls], endpoint.encoding))


ScriptCall = tuple[Script, Sequence[str], Sequence[Any]]


def scripts_exchange(calls: Sequence[ScriptCall], encoding: str) -> Callable[[Any], list[Any]]:
    """An exchange running ``calls`` (script, keys, args) in one pipelined round trip.

    A ``NOSCRIPT`` reply is followed by the ``EVAL`` of that call on the same
    connection (one more round trip after a flush).

    Raises (from the exchange):
        ResponseError: any call failed (other than ``NOSCRIPT``).
    """
    prepared = list(calls)
    packed = b"".join(script.pack_evalsha(k, a, encoding) for script, k, a in prepared)

    def run(connection: Any) -> list[Any]:
        replies = send_and_read(connection, packed, len(prepared))
        missing, again = evals_after_noscript(prepared, replies, encoding)
        if missing:
            for index, reply in zip(
                missing, send_and_read(connection, again, len(missing)), strict=True
            ):
                replies[index] = reply
        return raise_error_reply(replies)

    return run


class Runner(Protocol):
    """What runs an exchange on one server (a transport ``Endpoint``)."""

    encoding: str

    def run(self, exchange: Callable[[Any], T]) -> T:
        """Run ``exchange(connection)`` on one of its connections."""


def evals_after_noscript(
    calls: Sequence[ScriptCall], replies: Sequence[Any], encoding: str
) -> tuple[list[int], bytes]:
    """Which ``calls`` were answered ``NOSCRIPT``, and their ``EVAL`` commands in one write."""
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    again = b"".join(
        pack_command(calls[i][0].eval_command(*calls[i][1:]), encoding) for i in missing
    )
    return missing, again


def raise_error_reply(replies: list[Any]) -> list[Any]:
    """``replies``, unless one is an error reply: that one is raised."""
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply
    return replies
