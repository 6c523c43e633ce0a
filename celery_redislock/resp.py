"""The RESP2 wire: commands packed, replies read, straight on a connection's socket.

:mod:`celery_redislock.transport` decides which connection an exchange runs
on and what happens to it afterwards; this module only writes bytes to
that connection's socket and reads the replies back. Commands are packed
here with a few byte joins: redis-py's general command path (argument
encoding, connection checkout, response callbacks, observability hooks)
cost more client CPU than the round trip itself.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from redis._parsers.base import BaseParser
from redis.exceptions import (
    ConnectionError,
    InvalidResponse,
    ReadOnlyError,
    ResponseError,
    TimeoutError,
)

from celery_redislock.exceptions import ConfigurationError

__all__ = [
    "MasterDemoted",
    "after_asking",
    "pack_arguments",
    "pack_command",
    "read_replies",
    "send_and_read",
    "wire_encoding",
]

T = TypeVar("T")


def wire_encoding(encoding: str) -> str:
    """``encoding``, if it writes ASCII as ASCII (command names are sent as ASCII bytes).

    Raises:
        ConfigurationError: it does not (``utf-16``, ``utf-8-sig``), or is unknown.
    """
    try:
        ascii_as_ascii = "SET|k".encode(encoding) == b"SET|k"
    except LookupError:
        ascii_as_ascii = False
    if not ascii_as_ascii:
        raise ConfigurationError(
            f"the lock store's encoding {encoding!r} is unknown or does not write ASCII as "
            "ASCII; Redis commands need an ASCII-compatible one (utf-8, the default)"
        )
    return encoding


def pack_command(args: Sequence[Any], encoding: str = "utf-8") -> bytes:
    """Encode one command (name and arguments) as a RESP array of bulk strings.

    Accepts ``str``, ``bytes`` and ``int`` (not ``bool``); anything else is a
    ``TypeError`` naming the value, before anything is sent.
    """
    return b"*%d\r\n%s" % (len(args), pack_arguments(args, encoding))


def pack_arguments(args: Iterable[Any], encoding: str = "utf-8") -> bytes:
    """Encode ``args`` as RESP bulk strings (the body of a command, without its length).

    Dispatches on the exact type first: a lock cycle packs about twenty
    arguments, and the ``isinstance`` chain was a third of the packing's CPU.
    """
    out: list[bytes] = []
    append = out.append
    for value in args:
        kind = type(value)
        if kind is str:
            data = value.encode(encoding)
        elif kind is int:
            data = b"%d" % value
        elif kind is bytes:
            data = value
        elif isinstance(value, str):
            data = value.encode(encoding)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            data = bytes(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            data = b"%d" % value
        else:
            raise TypeError(f"cannot send {type(value).__name__} to Redis: {value!r}")
        append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def send_and_read(connection: Any, packed: bytes, replies: int) -> list[Any]:
    """Send ``packed`` on ``connection`` and read ``replies`` replies, errors in place.

    The socket is written and read here, not through redis-py's
    ``send_packed_command`` and parser: with the layers of checks,
    buffers and hooks between a command and its socket, redis-py spent more
    client CPU than the round trip itself (measured: see bench scenario 2).
    redis-py still makes the connection (``connect()``: AUTH, TLS, Sentinel
    master discovery, the handshake), so only the exchanges after it are
    ours. A connection these exchanges used is never handed to redis-py's
    parser afterwards: every reply an exchange asked for is read here, and
    any exception disconnects the connection (see :meth:`Endpoint.run`).
    """
    sock = connection._sock
    if sock is None:
        # connect() first: a Sentinel-managed connection resolves the
        # current master only there.
        connection.connect()
        sock = connection._sock
    if connection.__dict__.get(_ASKING_FLAG):
        # Redirected by ASK: ``ASKING`` lets only the next command use the
        # importing slot, so it goes before every write of the exchange.
        packed, replies = _ASKING + packed, replies + 1
    try:
        if type(sock) is _PLAIN_SOCKET:
            _write(sock, packed)
        else:  # TLS (OpenSSL writes it), gevent's and eventlet's sockets (their hub waits)
            sock.sendall(packed)
    except socket.timeout:  # noqa: UP041 - TimeoutError is redis-py's here
        raise TimeoutError("Timeout writing to socket") from None
    except OSError as error:
        raise ConnectionError(f"Error while writing to socket: {error}") from None
    out = read_replies(sock, replies)
    for reply in out:
        if isinstance(reply, (ConnectionError, ReadOnlyError)):
            _raise_connection_errors(connection, reply)
    return out[1:] if connection.__dict__.get(_ASKING_FLAG) else out


def _write(sock: Any, packed: bytes) -> None:
    """Send ``packed`` on a plain socket: one ``write()`` when it fits, ``sendall`` for the rest.

    CPython's socket with a timeout calls ``poll()`` before every send (and
    releases and retakes the GIL around each). A command sent here always
    finds an empty send buffer (the connection read every earlier reply), so
    a command of a few hundred bytes is written whole by one non-blocking
    ``write()`` (the socket's descriptor is non-blocking while it has a
    timeout): measured, 8 system calls per locked task became 6 (``strace``
    on a worker). What does not fit (a large value, a full buffer) is sent by
    ``sendall``, under the socket's own timeout. The receive keeps CPython's
    ``poll()`` and its deadline, which a retried, signal-interrupted wait
    does not stretch (a kernel ``SO_RCVTIMEO`` would restart with each retry).
    """
    try:
        written = os.write(sock.fileno(), packed)
    except BlockingIOError:
        written = 0
    if written < len(packed):
        sock.sendall(memoryview(packed)[written:])


def _raise_connection_errors(connection: Any, reply: ResponseError | ConnectionError) -> None:
    """Raise the error replies redis-py's own reader raises as connection errors.

    ``-LOADING`` (``BusyLoadingError``) and ``-NOAUTH``/``-WRONGPASS``
    (``AuthenticationError``) are ``ConnectionError`` subclasses in redis-py:
    raised, they disconnect the connection and are retried with the
    client's policy, as with redis-py. A Sentinel-managed connection to a
    master answering ``-READONLY`` was demoted by a failover; redis-py's
    ``SentinelManagedConnection`` turns that into a ``ConnectionError`` so
    the retry reconnects to the new master, and so does this.
    """
    if isinstance(reply, ConnectionError):
        raise reply
    if getattr(getattr(connection, "connection_pool", None), "is_master", False):
        raise MasterDemoted("The previous master is now a slave")


class MasterDemoted(ConnectionError):
    """A Sentinel-managed master answered ``-READONLY`` (demoted): the write did not run."""


#: The standard library's socket class, as imported before any monkey-patching
#: (gevent's patched class is a different type, whose sends wait in its hub).
_PLAIN_SOCKET: Any = socket.socket if socket.socket.__module__ == "socket" else type(None)

#: Bytes asked of the socket per read: replies to the lock's scripts fit in one.
_READ_SIZE = 65536


def read_replies(sock: Any, count: int) -> list[Any]:
    """Read ``count`` RESP2 replies from ``sock``; an error reply is returned in place.

    Raises:
        TimeoutError: the socket timed out (the connection must be dropped).
        ConnectionError: the server closed the connection or sent bytes
            after the replies (the connection must be dropped).
    """
    buffer = _recv(sock)
    if count == 1 and 0 < buffer.find(b"\r\n") == len(buffer) - 2:
        # One reply of one line, read whole (nearly every lock command's):
        # parsed without the general loop. Not an array's or a bulk
        # string's header: the rest of it is still to come.
        kind = buffer[0]
        if kind == 58:  # ":" integer
            return [int(buffer[1:-2])]
        if kind == 43 or kind == 45 or buffer == b"$-1\r\n":  # "+", "-", nil
            return [_parse(buffer, 0)[0]]
    out: list[Any] = []
    position = 0
    while len(out) < count:
        try:
            value, position = _parse(buffer, position)
        except _Incomplete:
            # Not all in one read (a large reply): parse the rest as it comes,
            # never going back over what is parsed (re-parsing from the
            # reply's start after every read made a 50,000-element reply
            # take 11x redis-py's time).
            out.extend(_read_rest(sock, bytearray(buffer[position:]), count - len(out)))
            return out
        out.append(value)
    if position != len(buffer):
        _unexpected(len(buffer) - position, count)
    return out


def _unexpected(extra: int, count: int) -> None:
    raise ConnectionError(f"Redis sent {extra} unexpected bytes after {count} replies")


def _read_rest(sock: Any, buffer: bytearray, count: int) -> list[Any]:
    """Read ``count`` replies, the first of which starts ``buffer``, parsing each byte once.

    Arrays are frames on a stack ([items, still expected]); a line or a
    bulk string that is not all in ``buffer`` yet waits for the next read.
    """
    out: list[Any] = []
    frames: list[tuple[list[Any], int]] = []
    position = 0
    searched = 0  # where to look for the next CR LF: the bytes before hold none
    while len(out) < count:
        end = buffer.find(b"\r\n", max(position, searched))
        if end < 0:
            searched = max(len(buffer) - 1, position)
            buffer += _recv(sock)
            continue
        kind, line = buffer[position], bytes(buffer[position + 1 : end])
        value: Any
        if kind == 36:  # "$" bulk string
            length = int(line)
            if length < 0:
                value, after = None, end + 2
            else:
                after = end + 2 + length + 2
                while len(buffer) < after:
                    buffer += _recv(sock)
                value = bytes(buffer[end + 2 : after - 2])
        elif kind == 42 and int(line) > 0:  # "*" a non-empty array: a new frame
            frames.append(([], int(line)))
            position = searched = end + 2
            continue
        else:  # a one-line reply: an integer, a simple string, an error, an empty/nil array
            value, after = _parse(bytes(buffer[position : end + 2]), 0)[0], end + 2
        position = searched = after
        if position > _READ_SIZE:  # drop what is parsed, so the buffer stays small
            del buffer[:position]
            position = searched = 0
        while frames:
            items, expected = frames[-1]
            items.append(value)
            if len(items) < expected:
                break
            frames.pop()
            value = items
        else:
            out.append(value)
    if position != len(buffer):
        _unexpected(len(buffer) - position, count)
    return out


def _recv(sock: Any) -> bytes:
    try:
        data: bytes = sock.recv(_READ_SIZE)
    except socket.timeout:  # noqa: UP041 - TimeoutError is redis-py's here
        raise TimeoutError("Timeout reading from socket") from None
    except OSError as error:
        raise ConnectionError(f"Error while reading from socket: {error}") from None
    if not data:
        raise ConnectionError("Connection closed by server.")
    return data


class _Incomplete(Exception):
    """The buffer ends inside a reply: read more."""


def _parse(buffer: bytes, position: int) -> tuple[Any, int]:
    """Parse one RESP2 reply starting at ``position``; return it and where the next starts."""
    end = buffer.find(b"\r\n", position)
    if end < 0:
        raise _Incomplete
    kind = buffer[position]
    line = buffer[position + 1 : end]
    position = end + 2
    if kind == 58:  # ":" integer
        return int(line), position
    if kind == 36:  # "$" bulk string
        length = int(line)
        if length < 0:
            return None, position
        stop = position + length
        if len(buffer) < stop + 2:
            raise _Incomplete
        return buffer[position:stop], stop + 2
    if kind == 42:  # "*" array
        length = int(line)
        if length < 0:
            return None, position
        items = []
        for _ in range(length):
            item, position = _parse(buffer, position)
            items.append(item)
        return items, position
    if kind == 43:  # "+" simple string
        return line, position
    if kind == 45:  # "-" error: an exception object, as redis-py's parser makes it
        return BaseParser.parse_error(line.decode("utf-8", "replace")), position  # type: ignore[no-untyped-call]
    raise InvalidResponse(f"Protocol error, got {chr(kind)!r} as reply type byte")


#: ``ASKING``, as sent before each command of an exchange redirected by ASK.
_ASKING = b"*1\r\n$6\r\nASKING\r\n"
#: Set on a connection (in its ``__dict__``) while an ASK-redirected exchange runs on it.
_ASKING_FLAG = "_redislock_asking"


def after_asking(exchange: Callable[[Any], T]) -> Callable[[Any], T]:
    """The exchange with ``ASKING`` before each of its commands (see :func:`send_and_read`).

    ``ASKING`` lets one command use a slot being imported: a take-over (``SET
    NX GET``, then the script) or a release that hands over sends two.
    """

    def run(connection: Any) -> T:
        connection.__dict__[_ASKING_FLAG] = True
        try:
            return exchange(connection)
        finally:
            connection.__dict__.pop(_ASKING_FLAG, None)

    return run
