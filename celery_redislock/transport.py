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
The bytes on the wire are ``resp.py``'s.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ConnectionError,
    MovedError,
    RedisClusterException,
    ResponseError,
    TimeoutError,
    TryAgainError,
)
from redis.retry import Retry

from celery_redislock._process import current_pid
from celery_redislock.evalsha import Script, ScriptCall, scripts_exchange
from celery_redislock.resp import (
    MasterDemoted,
    after_asking,
    pack_command,
    read_replies,
    send_and_read,
    wire_encoding,
)

try:  # redis-py >= 8
    from redis.driver_info import DriverInfo as _DriverInfo
except ImportError:  # pragma: no cover - older redis-py has no per-connection lookup
    _DriverInfo = None  # type: ignore[assignment,misc]

__all__ = [
    "NO_RETRY",
    "ClusterTopology",
    "Endpoint",
    "MasterDemoted",
    "Script",
    "ScriptCall",
    "Subscription",
    "Topology",
    "cluster_errors",
    "connection_factory",
    "connection_settings",
    "pack_command",
    "read_replies",
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
        self.encoding = wire_encoding(encoding)
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
            failed: Exception | None = None
            try:
                result = exchange(connection)
            except Exception as error:
                failed = error
            if failed is not None:
                # The retry policy takes over from the first failure on (so an
                # exchange that succeeds builds none of it: 2 µs per exchange),
                # outside the ``except``: a later attempt's error is not
                # chained to the first one's (review helper-38 F1).
                result = self._again(exchange, connection, failed)
        except BaseException:
            connection.disconnect()
            # Disconnected, it is as good as new (the next use reconnects);
            # if anything interrupts the disconnect, it is dropped instead.
            self._keep(connection)
            raise
        self._keep(connection)
        return result

    def _again(self, exchange: Callable[[Any], T], connection: Any, error: Exception) -> T:
        """The exchange failed with ``error``: what :attr:`retry` does with that first failure.

        Its first try re-raises ``error``, so the policy counts it, backs
        off and disconnects as if it had run the exchange itself (an error
        it does not retry propagates at once).
        """
        first: list[Exception] = [error]

        def attempt() -> T:
            if first:
                raise first.pop()
            return exchange(connection)

        return self.retry.call_with_retry(attempt, lambda _error: connection.disconnect())

    def _keep(self, connection: Any) -> None:
        if self._pid == current_pid():
            self._idle.append(connection)

    def round_trip(self, packed: bytes) -> Any:
        """Send one packed command and return its reply (an error reply in place).

        :meth:`run` with the exchange written out: the hot path's commands
        (a free key's ``SET NX PX GET``) make no closure per call (measured
        with ``bench.layers``: see the store's acquire). Same connection
        rules, same retry of a first failure.
        """
        connection = self._take()
        try:
            failed: Exception | None = None
            try:
                (reply,) = send_and_read(connection, packed, 1)
            except Exception as error:
                failed = error
            if failed is not None:
                reply = self._again(
                    lambda again: send_and_read(again, packed, 1)[0], connection, failed
                )
        except BaseException:
            connection.disconnect()
            self._keep(connection)
            raise
        self._keep(connection)
        return reply

    def call(self, *args: Any) -> Any:
        """Send one command and return its reply."""
        reply = self.round_trip(pack_command(args, self.encoding))
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


class Subscription:
    """A pub/sub subscription to one channel on a connection of its own.

    The connection is never reused: :meth:`close` disconnects it, and so
    does any exception while reading. Use it as a context manager.
    """

    def __init__(self, endpoint: Endpoint, channel: str) -> None:
        self._connection = connection = endpoint.new_connection()

        def subscribe() -> None:
            # connect() first: a Sentinel-managed connection looks up the
            # current master only there (send_command alone would connect
            # to redis-py's default address, localhost:6379).
            connection.connect()
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
    on the node it names. ``refresh_after_failure=False`` (the releases'
    connections, whose short timeout bounds a finishing task): a node that
    stopped answering is not followed by a refresh, which reads the map with
    the client's own, longer timeouts.
    """

    #: Redirections (and ``TRYAGAIN`` replies) followed before giving up.
    MAX_REDIRECTS = 5
    #: Seconds to wait after a ``TRYAGAIN`` reply (a slot migration in progress).
    TRY_AGAIN_DELAY = 0.1

    def __init__(
        self,
        nodes_manager: Any,
        make_endpoint: Callable[[Any], Endpoint],
        refresh_after_failure: bool = True,
    ) -> None:
        self._nodes = nodes_manager
        self._make_endpoint = make_endpoint
        self._by_node: dict[str, Endpoint] = {}
        self.refresh_after_failure = refresh_after_failure

    def _endpoint_of(self, node: Any) -> Endpoint:
        endpoint = self._by_node.get(node.name)
        if endpoint is None:
            endpoint = self._by_node.setdefault(
                node.name, self._make_endpoint(node.redis_connection.connection_pool)
            )
        return endpoint

    def endpoint_for(self, key: str) -> Endpoint:
        """The endpoint of the primary serving ``key``'s slot."""
        return self._endpoint_of(self._node_for(_slot(key)))

    def _node_for(self, slot: int) -> Any:
        with cluster_errors():
            return self._nodes.get_node_from_slot(slot)

    def primaries(self) -> list[Endpoint]:
        """One endpoint per primary."""
        return [self._endpoint_of(node) for node in self._nodes.get_nodes_by_server_type("primary")]

    def group(self, keys: Sequence[str]) -> list[tuple[Endpoint, list[int]]]:
        """Indices grouped by slot (a script may only touch keys of one slot)."""
        by_slot: dict[int, list[int]] = {}
        for index, key in enumerate(keys):
            by_slot.setdefault(_slot(key), []).append(index)
        return [
            (self._endpoint_of(self._node_for(slot)), indices) for slot, indices in by_slot.items()
        ]

    def run_for_key(self, key: str, make_exchange: Callable[[Endpoint], Callable[[Any], T]]) -> T:
        """Run an exchange on ``key``'s primary, following MOVED and ASK."""
        asking: Endpoint | None = None
        failed = False
        for _ in range(self.MAX_REDIRECTS + 1):
            endpoint = asking or self.endpoint_for(key)
            exchange = make_exchange(endpoint)
            if asking is not None:
                exchange = after_asking(exchange)

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
                if failed or not self.refresh_after_failure:
                    raise
                failed, asking = True, None
                self.refresh()
        raise ResponseError(f"too many cluster redirections for key {key!r}")

    def refresh(self) -> None:
        """Read the slot map again (after a MOVED reply or a failed node)."""
        with cluster_errors():
            self._nodes.initialize()

    def close(self) -> None:
        """Disconnect every node's idle connections."""
        for endpoint in self._by_node.values():
            endpoint.close()


@contextlib.contextmanager
def cluster_errors() -> Iterator[None]:
    """redis-py's cluster errors (not ``RedisError``s) as the connection errors they are.

    No node reachable (``RedisClusterException``), a slot no node serves
    (``SlotNotCoveredError``): the lock store is unavailable, which the
    callers handle as ``ConnectionError``.
    """
    try:
        yield
    except RedisClusterException as exc:
        raise ConnectionError(f"Redis Cluster unavailable: {exc}") from exc


def _slot(key: str) -> int:
    return int(key_slot(key.encode()))
