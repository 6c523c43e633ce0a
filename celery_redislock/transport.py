"""The one place that writes to and reads from Redis sockets.

Every command the package sends goes through an :class:`Endpoint`: one
Redis server, as used by one kind of caller (task threads, releases, the
renewer thread). The rule it enforces, for every caller:

    A connection goes back to the idle set only after the exchange that
    used it has read every reply. Anything else that ends an exchange (a
    timeout, a soft time limit, ``KeyboardInterrupt``, an asynchronous
    exception, a gevent ``Timeout``) disconnects it, so no later command can
    read an earlier command's reply.

redis-py's own pool does not promise this: a pooled connection that an
exception left between a command and its reply goes back to the pool, and
its ``can_read()`` check on checkout only sees a reply that has already
arrived.

The connections are redis-py ``Connection`` objects made from the client's
own pool settings (so AUTH, TLS, Unix sockets and Sentinel master discovery
are redis-py's), with three changes: they speak RESP2 (a subscription's
messages are then plain replies), they return raw bytes, and they never
retry inside ``connect()``. Retrying is done once, here,
around the whole exchange, with the client's retry policy; redis-py's
connect retries inside it would multiply the time to give up on a frozen
server (measured: 45 s for an acquire with 5 s timeouts and 2 retries).

Commands are packed here with a few byte joins: redis-py's general command
path (argument encoding, connection checkout, response callbacks,
observability hooks) cost more client CPU than the round trip itself.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import redis
from redis._parsers.base import BaseParser
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ConnectionError,
    InvalidResponse,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    TimeoutError,
    TryAgainError,
)
from redis.retry import Retry

from celery_redislock._process import current_pid

try:  # redis-py >= 8
    from redis.driver_info import DriverInfo as _DriverInfo
except ImportError:  # pragma: no cover - older redis-py has no per-connection lookup
    _DriverInfo = None  # type: ignore[assignment,misc]

__all__ = [
    "NO_RETRY",
    "ClusterTopology",
    "Endpoint",
    "Script",
    "ScriptCall",
    "Subscription",
    "Topology",
    "connection_factory",
    "connection_settings",
    "pack_command",
    "scripts_exchange",
    "send_and_read",
]

T = TypeVar("T")

#: Retry policy of the connections themselves: none (see the module docstring).
NO_RETRY = Retry(NoBackoff(), 0)

# Connection settings the transport fixes, whatever the client's are.
_FIXED = {"retry": NO_RETRY, "decode_responses": False, "protocol": 2}
# Settings dropped where the client has them: maintenance notifications
# (RESP3 only; their handler also holds the pool, which would keep a
# dropped client alive) and a cluster client's connect
# callback (it holds the cluster client; only replicas need it).
_DROPPED = ("maint_notifications_config", "maint_notifications_pool_handler", "redis_connect_func")


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


def connection_factory(
    connection_class: type, connection_kwargs: Mapping[str, Any], **overrides: Any
) -> Callable[[], Any]:
    """Return a maker of connections like a pool's, with the transport's fixed settings."""
    kwargs = {**connection_settings(connection_kwargs), **overrides, **_FIXED}
    if not {"driver_info", "lib_name", "lib_version"} & kwargs.keys() and _DriverInfo is not None:
        # redis-py 8 looks its own version up on disk (importlib.metadata)
        # for every Connection built without one: measured 860 µs each.
        kwargs["driver_info"] = _DriverInfo(name="redis-py", lib_version=redis.__version__)
    return functools.partial(connection_class, **kwargs)


def connection_settings(connection_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a pool's connection settings that holds nothing of the pool or client."""
    return {name: None if name in _DROPPED else value for name, value in connection_kwargs.items()}


class Endpoint:
    """One Redis server for one kind of caller: idle connections kept LIFO.

    Args:
        make_connection: Builds a new (unconnected) connection.
        retry: Policy for a whole exchange (connection and timeout errors).
        encoding: How ``str`` arguments are encoded.

    It is safe to use from several threads (the idle set is a ``deque``,
    whose ``pop`` and ``append`` are atomic). Connections made in a process
    are never used by a forked child: it starts with an empty idle set.
    """

    def __init__(
        self, make_connection: Callable[[], Any], retry: Retry, encoding: str = "utf-8"
    ) -> None:
        self._make = make_connection
        self.retry = retry
        self.encoding = encoding
        self._idle: collections.deque[Any] = collections.deque()
        self._pid = current_pid()

    def _take(self) -> Any:
        if self._pid != current_pid():
            # The parent's sockets: leave them to the parent, unused.
            self._idle, self._pid = collections.deque(), current_pid()
        try:
            return self._idle.pop()
        except IndexError:
            return self._make()

    def run(self, exchange: Callable[[Any], T]) -> T:
        """Run ``exchange(connection)`` (send, then read every reply) on an idle connection.

        Connection and timeout errors are retried under :attr:`retry`, on a
        fresh connection. The connection is kept only if the exchange
        returned; on any exception it is disconnected.
        """
        connection = self._take()
        try:
            result = self.retry.call_with_retry(
                lambda: exchange(connection), lambda _error: connection.disconnect()
            )
        except BaseException:
            connection.disconnect()
            # Disconnected, it is as good as new (the next use reconnects);
            # if anything interrupts the disconnect, it is dropped instead.
            self._keep(connection)
            raise
        self._keep(connection)
        return result

    def _keep(self, connection: Any) -> None:
        if self._pid == current_pid():
            self._idle.append(connection)

    def call(self, *args: Any) -> Any:
        """Send one command and return its reply."""
        packed = pack_command(args, self.encoding)
        reply = self.run(lambda connection: send_and_read(connection, packed, 1)[0])
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    def pipeline(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Send ``commands`` in one write and return their replies, in order.

        An error reply is returned in place (a ``ResponseError``), not raised,
        so every reply is read and the connection stays usable.
        """
        packed = b"".join(pack_command(command, self.encoding) for command in commands)
        return self.run(lambda connection: send_and_read(connection, packed, len(commands)))

    def new_connection(self) -> Any:
        """A connection of its own (for a subscription), never put in the idle set."""
        return self._make()

    def close(self) -> None:
        """Disconnect the idle connections (the ones in use close when their exchange ends)."""
        while self._idle:
            self._idle.pop().disconnect()


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
        raise ConnectionError("The previous master is now a slave")


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

    def pack_evalsha(self, keys: Sequence[str], args: Sequence[Any], encoding: str) -> bytes:
        """The packed ``EVALSHA`` command running the script on ``keys`` and ``args``."""
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

    def __call__(self, endpoint: Endpoint, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run the script on ``endpoint`` and return its reply."""
        return endpoint.run(self.exchange(keys, args, endpoint.encoding))

    def many(
        self, endpoint: Endpoint, calls: Iterable[tuple[Sequence[str], Sequence[Any]]]
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
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            again = b"".join(
                pack_command(prepared[i][0].eval_command(*prepared[i][1:]), encoding)
                for i in missing
            )
            for index, reply in zip(
                missing, send_and_read(connection, again, len(missing)), strict=True
            ):
                replies[index] = reply
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return replies

    return run


class Subscription:
    """A pub/sub subscription to one channel on a connection of its own.

    The connection is never reused: :meth:`close` disconnects it, and so
    does any exception while reading. Use it as a context manager.
    """

    def __init__(self, endpoint: Endpoint, channel: str) -> None:
        self._connection = connection = endpoint.new_connection()

        def subscribe() -> None:
            # redis-py's reader, not ours: a message published right after
            # the confirmation may arrive in the same read, and redis-py's
            # buffer keeps it for :meth:`wait` (ours would call it stray
            # bytes and drop the connection).
            connection.send_command("SUBSCRIBE", channel)
            connection.read_response()

        try:
            endpoint.retry.call_with_retry(subscribe, lambda _error: connection.disconnect())
        except BaseException:
            self._connection.disconnect()
            raise

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a message; True if one came."""
        try:
            if not self._connection.can_read(timeout=max(timeout, 0.0)):
                return False
            self._connection.read_response()
        except BaseException:
            self._connection.disconnect()
            raise
        return True

    def close(self) -> None:
        """Drop the connection (unsubscribing is not needed: it is closed)."""
        self._connection.disconnect()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Topology:
    """Where a key lives: one server (this base class), or a cluster node."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    def endpoint_for(self, key: str) -> Endpoint:
        """The endpoint that serves ``key``."""
        return self.endpoint

    def primaries(self) -> list[Endpoint]:
        """One endpoint per primary (for SCAN)."""
        return [self.endpoint]

    def group(self, keys: Sequence[str]) -> list[tuple[Endpoint, list[int]]]:
        """Indices of ``keys`` grouped by the endpoint and hash slot serving them."""
        return [(self.endpoint, list(range(len(keys))))]

    def run_for_key(self, key: str, make_exchange: Callable[[Endpoint], Callable[[Any], T]]) -> T:
        """Run an exchange on the endpoint serving ``key``."""
        endpoint = self.endpoint_for(key)
        return endpoint.run(make_exchange(endpoint))

    def close(self) -> None:
        """Disconnect every idle connection."""
        for endpoint in self.primaries():
            endpoint.close()


class ClusterTopology(Topology):
    """A Redis Cluster: keys routed by hash slot to their primary's endpoint.

    The slot map is redis-py's (``RedisCluster.nodes_manager``); the
    connections are the transport's, one :class:`Endpoint` per node. A
    ``MOVED`` reply (or a node that stopped answering) refreshes the map and
    the call is tried again; an ``ASK`` reply is followed with ``ASKING``
    on the node it names.
    """

    #: Redirections (and ``TRYAGAIN`` replies) followed before giving up.
    MAX_REDIRECTS = 5
    #: Seconds to wait after a ``TRYAGAIN`` reply (a slot migration in progress).
    TRY_AGAIN_DELAY = 0.1

    def __init__(self, nodes_manager: Any, make_endpoint: Callable[[Any], Endpoint]) -> None:
        self._nodes = nodes_manager
        self._make_endpoint = make_endpoint
        self._by_node: dict[str, Endpoint] = {}

    def _endpoint_of(self, node: Any) -> Endpoint:
        endpoint = self._by_node.get(node.name)
        if endpoint is None:
            endpoint = self._by_node.setdefault(
                node.name, self._make_endpoint(node.redis_connection.connection_pool)
            )
        return endpoint

    def endpoint_for(self, key: str) -> Endpoint:
        """The endpoint of the primary serving ``key``'s slot."""
        return self._endpoint_of(self._nodes.get_node_from_slot(_slot(key)))

    def primaries(self) -> list[Endpoint]:
        """One endpoint per primary."""
        return [self._endpoint_of(node) for node in self._nodes.get_nodes_by_server_type("primary")]

    def group(self, keys: Sequence[str]) -> list[tuple[Endpoint, list[int]]]:
        """Indices grouped by slot (a script may only touch keys of one slot)."""
        by_slot: dict[int, list[int]] = {}
        for index, key in enumerate(keys):
            by_slot.setdefault(_slot(key), []).append(index)
        return [
            (self._endpoint_of(self._nodes.get_node_from_slot(slot)), indices)
            for slot, indices in by_slot.items()
        ]

    def run_for_key(self, key: str, make_exchange: Callable[[Endpoint], Callable[[Any], T]]) -> T:
        """Run an exchange on ``key``'s primary, following MOVED and ASK."""
        asking: Endpoint | None = None
        failed = False
        for _ in range(self.MAX_REDIRECTS + 1):
            endpoint = asking or self.endpoint_for(key)
            exchange = make_exchange(endpoint)
            if asking is not None:
                exchange = _after_asking(exchange)

            try:
                return endpoint.run(exchange)
            except TryAgainError:
                # A script whose keys are split by a slot migration: wait for it
                # (redis-py's cluster client waits likewise), within the bound.
                time.sleep(self.TRY_AGAIN_DELAY)
            except MovedError:
                asking = None
                self.refresh()
            except AskError as error:
                node = self._nodes.get_node(host=error.host, port=error.port)
                if node is None:
                    self.refresh()
                    node = self._nodes.get_node(host=error.host, port=error.port)
                asking = None if node is None else self._endpoint_of(node)
            except (ConnectionError, TimeoutError):
                # The endpoint already retried; one more try after a refresh,
                # in case a failover moved the slot to another node.
                if failed:
                    raise
                failed, asking = True, None
                self.refresh()
        raise ResponseError(f"too many cluster redirections for key {key!r}")

    def refresh(self) -> None:
        """Read the slot map again (after a MOVED reply or a failed node)."""
        self._nodes.initialize()

    def close(self) -> None:
        """Disconnect every node's idle connections."""
        for endpoint in self._by_node.values():
            endpoint.close()


#: ``ASKING``, as sent before each command of an exchange redirected by ASK.
_ASKING = b"*1\r\n$6\r\nASKING\r\n"
#: Set on a connection (in its ``__dict__``) while an ASK-redirected exchange runs on it.
_ASKING_FLAG = "_redislock_asking"


def _after_asking(exchange: Callable[[Any], T]) -> Callable[[Any], T]:
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


def _slot(key: str) -> int:
    return int(key_slot(key.encode()))
