"""The lock store's connections: three sets per server, one per kind of caller.

A backend keeps three sets of connections to its server (a cluster: to
each node), so that no two kinds of caller ever share a socket:

* ``commands``: acquire, extend, ``WAIT``, inspection; the client's
  timeouts and retry policy;
* ``releases``: releases from task threads (or greenlets); the renewal
  timeout and one retry, so a frozen Redis delays a finishing task by at
  most two short attempts;
* ``renewals``: the renewer thread only, a native OS thread even under
  gevent; the renewal timeout and no retry (the renewer tries again on its
  next tick).

:class:`StoreConnections` holds them and runs scripts over them; the lock
operations are built on it (:class:`~celery_redislock.store.LockStore`).
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError
from redis.retry import Retry

from celery_redislock._process import current_pid
from celery_redislock.clients import (
    DEFAULT_OPTIONS,
    build_client,
    client_source,
    default_retry,
    describe_client,
)
from celery_redislock.exceptions import LockBackendError
from celery_redislock.protocol import ReleaseAttempts, backend_error
from celery_redislock.transport import (
    NO_RETRY,
    ClusterTopology,
    Endpoint,
    MasterDemoted,
    ScriptCall,
    Topology,
    cluster_errors,
    connection_factory,
    pack_command,
    scripts_exchange,
    send_and_read,
)
from celery_redislock.urls import mask_url

__all__ = ["StoreConnections"]


class _Kind(enum.IntEnum):
    """Who uses a set of connections (see the module docstring).

    An ``IntEnum``: the look-up of a kind's topology, twice per lock cycle,
    hashes as an ``int`` (a plain ``Enum`` member hashes in Python: 0.32 µs
    a look-up against 0.14, measured).
    """

    COMMANDS = 1
    RELEASES = 2
    RENEWALS = 3


class StoreConnections:
    """The connections of one lock store, and the scripts run over them.

    The base of :class:`~celery_redislock.store.LockStore`, whose docstring
    documents the arguments.
    """

    def __init__(
        self,
        url: str | None = None,
        options: Mapping[str, Any] | None = None,
        renew_timeout: float = 0.5,
        client: redis.Redis | RedisCluster | None = None,
        fence_ttl: float = 0.0,
    ) -> None:
        if client is None and url is None:
            raise ValueError("LockStore needs a url or a client")
        self.url = url
        self.options = {**DEFAULT_OPTIONS, **(options or {})}
        self.renew_timeout = renew_timeout
        self.fence_ttl_ms = int(fence_ttl * 1000)
        self._client: redis.Redis | RedisCluster | None = None
        self._client_ref: Callable[[], Any] = lambda: None
        self._guard = threading.Lock()
        self._client_guard = threading.Lock()
        self._topologies: dict[_Kind, Topology] = {}
        self._pid = current_pid()
        self._where = "custom client"
        #: Called with ``(key, hand-off value, message)`` when a release
        #: handed the lock to a parked execution; publishes that message
        #: (installed by the Celery side, see ``handoff.py``).
        self.on_handoff: Callable[[str, str, bytes], None] | None = None
        #: Told ``(key, kept_ms)`` when a release keeps a value that a
        #: parked call or a waiter had marked (see ``RELEASE_FULL_SCRIPT``).
        self.on_kept_waited: Callable[[str, int], None] | None = None
        #: Milliseconds a lock handed to a parked execution waits for it to start.
        self.handoff_ttl_ms = 30_000
        #: The server takes ``SET NX GET`` (Redis >= 7, Valkey): cleared at its
        #: first "syntax error", after which acquires run ``ACQUIRE_SCRIPT``.
        self._set_nx_get = True
        #: The server takes ``DELIFEQ`` (Valkey >= 9): cleared at its first
        #: refusal, after which plain releases run ``RELEASE_SCRIPT``.
        self._native_release = True
        if client is not None:
            self._client_ref = weakref.ref(client)
            self._where = describe_client(client)
            self._source: Callable[[], Any] = client_source(client)
        else:
            self._source = self._url_source

    def __repr__(self) -> str:
        return f"<LockStore {self.describe()}>"

    def describe(self) -> str:
        """Return the server address without credentials, for messages."""
        if self.url is None:
            return self._where
        return mask_url(self.url, drop_credentials=True)

    # -- clients and connections ------------------------------------------

    @property
    def client(self) -> redis.Redis | RedisCluster:
        """A redis-py client of the lock store (built lazily from the URL).

        The lock operations do not use its connections; it is there for
        callers who want to look at the store with redis-py.
        """
        if self.url is None:
            client = self._client_ref()
            if client is None:
                raise LockBackendError("the client this lock was made with has been closed")
            return client  # type: ignore[no-any-return]
        if self._pid != current_pid():
            self._after_fork()
        if self._client is None:
            with self._client_guard:
                if self._client is None:
                    options = dict(self.options)
                    options.setdefault("retry", default_retry())
                    # A cluster client asks its nodes for the slot map as it
                    # is built: none answering is no RedisError (helper-44).
                    with cluster_errors():
                        self._client = build_client(self.url, options)
        return self._client

    def _after_fork(self) -> None:
        # A forked child never uses its parent's connections, nor its guards:
        # another thread of the parent may have held one at the fork.
        self._guard, self._client_guard = threading.Lock(), threading.Lock()
        self._topologies, self._pid = {}, current_pid()

    def _url_source(self) -> Any:
        return client_source(self.client)()

    def _topology(self, kind: _Kind) -> Topology:
        if self._pid != current_pid():
            self._after_fork()
        topology = self._topologies.get(kind)
        if topology is None:
            with self._guard:
                topology = self._topologies.get(kind)
                if topology is None:
                    try:
                        topology = self._make_topology(kind)
                    except RedisError as exc:
                        # A cluster client is built on first use and asks its
                        # nodes for the slot map then: the store is unavailable.
                        raise LockBackendError(
                            f"Redis at {self.describe()} is unavailable "
                            f"({type(exc).__name__}: {exc})"
                        ) from exc
                    self._topologies[kind] = topology
        return topology

    def _make_topology(self, kind: _Kind) -> Topology:
        source = self._source()
        overrides: dict[str, Any] = {}
        retry: Retry
        if kind is _Kind.COMMANDS:
            retry = source.retry or default_retry()
        else:
            overrides = {
                "socket_timeout": self.renew_timeout,
                "socket_connect_timeout": self.renew_timeout,
            }
            retry = Retry(NoBackoff(), 1) if kind is _Kind.RELEASES else NO_RETRY

        def endpoint_of(connection_class: Any, kwargs: Mapping[str, Any]) -> Endpoint:
            factory = connection_factory(connection_class, kwargs, **overrides)
            return Endpoint(factory, retry, kwargs.get("encoding", "utf-8"))

        if source.nodes_manager is not None:
            return ClusterTopology(
                source.nodes_manager,
                lambda pool: endpoint_of(pool.connection_class, pool.connection_kwargs),
                # A release is bounded by its short timeout (the TTL frees the
                # key); a renewal must find a promoted replica (a failed node
                # never answers MOVED), or the lock expires while held.
                refresh_after_failure=kind is not _Kind.RELEASES,
            )
        return Topology(endpoint_of(source.connection_class, source.connection_kwargs))

    def warm_up(self) -> None:
        """Open the renewal connection now, so the first renewal is a single round trip.

        Call it only from the renewer thread, like :meth:`renew_many`.
        """
        topology = self._topology(_Kind.RENEWALS)
        if type(topology) is Topology:
            topology.endpoint.run(lambda connection: connection.connect())

    @contextmanager
    def _errors(self, operation: str, key: str) -> Iterator[None]:
        try:
            yield
        except RedisError as exc:
            raise backend_error(exc, operation, key, self.describe()) from exc

    def _for_replicas(self, min_replicas: int, replicas_timeout: float) -> tuple[Topology, int]:
        """The commands' topology, and ``WAIT``'s timeout in ms (0: not asked for).

        Raises:
            LockBackendError: ``min_replicas`` on a cluster.
        """
        topology = self._topology(_Kind.COMMANDS)
        if min_replicas <= 0:
            return topology, 0
        if isinstance(topology, ClusterTopology):
            raise LockBackendError(
                "lock_min_replicas is not available on Redis Cluster: WAIT must run on "
                "the connection that took the lock"
            )
        return topology, max(int(replicas_timeout * 1000), 1)

    # -- running scripts -------------------------------------------------

    def do_script(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run one of the other scripts (debounce) over the commands' connections."""
        return self._topology(_Kind.COMMANDS).run_for_key(
            keys[0], lambda endpoint: script.exchange(keys, args, endpoint.encoding)
        )

    def run_scripts(self, calls: Sequence[ScriptCall], short: bool = False) -> list[Any]:
        """Run ``calls`` (script, keys, args) in order; return their replies.

        One pipelined round trip when one server serves them all (any
        topology but a cluster); on a cluster, one round trip per call, on
        the node serving its first key. ``short``: on the releases'
        connections (the renewal timeout, one retry), for a caller that must
        not block long (the worker's sweep runs in its event loop).

        Raises:
            RedisError: the store is unreachable or a script failed.
        """
        topology = self._topology(_Kind.RELEASES if short else _Kind.COMMANDS)
        if type(topology) is Topology:
            endpoint = topology.endpoint
            return endpoint.run(scripts_exchange(calls, endpoint.encoding))
        return [topology.run_for_key(call[1][0], _script_runner(call)) for call in calls]

    def run_script_or_retry(self, first: ScriptCall, again: ScriptCall, short: bool = False) -> Any:
        """Run ``first``; if its reply is lost and the exchange is retried, run ``again``.

        For a script whose retry must know it may have run already (a
        hand-over whose reply was lost). ``short`` as :meth:`run_scripts`.

        Raises:
            RedisError: the store is unreachable or the script failed.
        """
        attempts = 0

        def make(endpoint: Endpoint) -> Callable[[Any], Any]:
            def run(connection: Any) -> Any:
                nonlocal attempts
                attempts += 1
                script, keys, args = first if attempts == 1 else again
                return script.exchange(keys, args, endpoint.encoding)(connection)

            return run

        kind = _Kind.RELEASES if short else _Kind.COMMANDS
        return self._topology(kind).run_for_key(first[1][0], make)

    @property
    def single_server(self) -> bool:
        """One server holds every key (not a cluster): one script may touch any keys."""
        return type(self._topology(_Kind.COMMANDS)) is Topology

    def encoding_for(self, key: str) -> str:
        """How text in the replies about ``key`` is encoded (the client's ``encoding``)."""
        return self._topology(_Kind.COMMANDS).endpoint_for(key).encoding

    def _with_neighbours(
        self, call: ScriptCall, before: ScriptCall | None, after: ScriptCall | None
    ) -> Any:
        """Run ``call`` with the calls before and after it (if any); return its reply."""
        if before is None and after is None:
            return self._topology(_Kind.COMMANDS).run_for_key(call[1][0], _script_runner(call))
        calls = [c for c in (before, call, after) if c is not None]
        return self.run_scripts(calls)[0 if before is None else 1]

    def close(self) -> None:
        """Disconnect this process's idle connections (and the URL-built client)."""
        with self._guard:
            topologies, self._topologies = self._topologies, {}
        for topology in topologies.values():
            topology.close()
        if self.url is not None and self._client is not None:
            self._client.close()
            self._client = None


def _script_runner(call: ScriptCall) -> Callable[[Endpoint], Callable[[Any], Any]]:
    """``make_exchange`` for :meth:`Topology.run_for_key`: run one script call."""
    script, keys, args = call
    return lambda endpoint: script.exchange(keys, args, endpoint.encoding)


def _attempt(
    attempts: ReleaseAttempts, connection: Any, script: Callable[[bool], Callable[[Any], Any]]
) -> Any:
    """Run one release attempt on ``connection``: ``script(retry)`` picks its exchange."""
    exchange = script(attempts.start())
    try:
        reply = exchange(connection)
    except (ResponseError, MasterDemoted):
        attempts.refused()  # a redirection, a refusal, a demoted master: nothing ran
        raise
    attempts.answered()
    return reply


def _command_runner(*command: Any) -> Callable[[Endpoint], Callable[[Any], Any]]:
    """``make_exchange`` for :meth:`Topology.run_for_key`: send one command, raise its error."""

    def make(endpoint: Endpoint) -> Callable[[Any], Any]:
        packed = pack_command(command, endpoint.encoding)

        def run(connection: Any) -> Any:
            (reply,) = send_and_read(connection, packed, 1)
            if isinstance(reply, ResponseError):
                raise reply
            return reply

        return run

    return make
