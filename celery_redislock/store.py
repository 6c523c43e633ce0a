"""The lock store: acquire, release, renew and inspect, their outcomes, one transport.

Every lock operation is one round trip over :mod:`celery_redislock.transport`:
``SET NX PX GET`` to take a free key, a single ``EVALSHA`` otherwise, or one
pipeline of them for batched renewal. A
backend keeps three sets of connections to its server, one per kind of
caller, so that no two kinds ever share a socket:

* ``commands``: acquire, extend, ``WAIT``, inspection; the client's
  timeouts and retry policy;
* ``releases``: releases from task threads (or greenlets); the renewal
  timeout and one retry, so a frozen Redis delays a finishing task by at
  most two short attempts;
* ``renewals``: the renewer thread only, a native OS thread even under
  gevent; the renewal timeout and no retry (the renewer tries again on its
  next tick).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    ConnectionError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TimeoutError,
)
from redis.retry import Retry

from celery_redislock import park_scripts, pending_scripts, scripts
from celery_redislock._clock import clock
from celery_redislock._process import current_pid
from celery_redislock.clients import (
    DEFAULT_OPTIONS,
    build_client,
    client_source,
    default_retry,
    describe_client,
)
from celery_redislock.exceptions import LockBackendError, LockStoreRefused
from celery_redislock.keys import (
    NOT_LOCK_SUFFIXES,
    debounce_key,
    fence_key,
    handoff_keys,
    next_run_key,
    release_channel,
    slot_keys,
)
from celery_redislock.keys import queued_key as queued_key_of
from celery_redislock.protocol import (
    TAKE_OVER,
    ReleaseAttempts,
    after_retry,
    after_set_nx_get,
    set_nx_get,
    takes_keyword,
    unsupported,
)
from celery_redislock.tokens import LockValue, without_mark
from celery_redislock.transport import (
    NO_RETRY,
    ClusterTopology,
    Endpoint,
    Script,
    ScriptCall,
    Subscription,
    Topology,
    connection_factory,
    pack_command,
    scripts_exchange,
    send_and_read,
)
from celery_redislock.urls import mask_url

__all__ = [
    "AcquireResult",
    "LockStore",
    "ParkResult",
    "ReleaseOutcome",
    "RenewOutcome",
    "backend_error",
    "decode_text",
    "release_call",
    "renew_call",
]

# The logger keeps the name the docs document (the module was backend.py).
logger = logging.getLogger("celery_redislock.backend")

T = TypeVar("T")

#: Locks per renewal script call: bounds how long one call blocks Redis.
#: Each lock comes with its fence counter: 500 keys per call.
RENEW_CHUNK_SIZE = 250
#: Suffixes of the keys kept beside a lock that are not locks themselves.
_NOT_LOCKS = tuple(f":{suffix}" for suffix in NOT_LOCK_SUFFIXES)
#: Times one wait subscribes again after its subscription dropped.
_RESUBSCRIPTIONS = 3


class ReleaseOutcome(enum.Enum):
    """What a release found."""

    RELEASED = 1
    ALREADY_GONE = 0
    NOT_OURS = -1


class RenewOutcome(enum.Enum):
    """What a renewal found for one key."""

    RENEWED = 1
    GONE = 0
    STOLEN = -1


class AcquireResult:
    """The reply of one acquire.

    Attributes:
        acquired: True when the lock is now ours.
        holder: The current holder's raw value when contended.
        sent_at: :func:`clock` reading just before the acquire was sent.
        fence: Unused: fences are issued on demand (:meth:`LockStore.fence`).
        key: The key taken, when acquired with :meth:`LockStore.acquire_slot`:
            the slot key (``None`` from :meth:`LockStore.acquire`: the key
            itself).
    """

    __slots__ = ("_ttl", "_ttl_of", "acquired", "fence", "holder", "key", "sent_at")

    def __init__(
        self,
        acquired: bool,
        holder: str | None = None,
        ttl_remaining: float | None = None,
        sent_at: float = 0.0,
        fence: int | None = None,
        key: str | None = None,
        *,
        ttl_of: Callable[[], float | None] | None = None,
    ) -> None:
        self.acquired = acquired
        self.holder = holder
        self._ttl = ttl_remaining
        self._ttl_of = ttl_of
        self.sent_at = sent_at
        self.fence = fence
        self.key = key

    def __repr__(self) -> str:
        return (
            f"AcquireResult(acquired={self.acquired}, holder={self.holder!r}, "
            f"ttl_remaining={self._ttl!r}, key={self.key!r})"
        )

    @property
    def ttl_remaining(self) -> float | None:
        """Seconds left on the holder's lock when contended (``None``: no expiry, or gone).

        A contended ``SET NX GET`` says who holds the key, not for how long:
        the first read asks the server (one round trip, a ``PTTL``), so a
        caller that never needs it (the skip policy) never pays for it. A
        store gone by then leaves it unknown (``None``): the contention is
        what the acquire found, and the caller's policy still applies.
        """
        read, self._ttl_of = self._ttl_of, None
        if read is not None:
            try:
                self._ttl = read()
            except LockBackendError as exc:
                logger.info("the holder's TTL is unknown: %s", exc)
        return self._ttl

    @property
    def known_ttl(self) -> float | None:
        """:attr:`ttl_remaining` if it was read (or came with the reply), else ``None``."""
        return self._ttl

    @property
    def holder_value(self) -> LockValue | None:
        """The holder's decoded value, when it is in this package's format."""
        return None if self.holder is None else LockValue.decode(self.holder)

    @property
    def holder_task_id(self) -> str | None:
        """Task id of the holder, when the holder is a Celery task."""
        decoded = self.holder_value
        if decoded is None or not decoded.owner.task_id:
            return None
        return decoded.owner.task_id


@dataclass(frozen=True)
class ParkResult:
    """The reply of :meth:`LockStore.park`.

    Attributes:
        result: Granted, or the holder (as :meth:`LockStore.acquire`).
        parked: Not granted, and queued behind the holder.
        already_ran: This hand-off value's execution was already granted
            the lock once: this is a second copy of it.
    """

    result: AcquireResult
    parked: bool = False
    already_ran: bool = False


#: What a refusal (not an outage) says: an ACL, a renamed or disabled command.
_REFUSALS = ("noperm", "no permissions", "unknown command", "can't run this command")


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
    waiters, parked, _ = handoff_keys(key)
    args = (
        match,
        mode,
        release_channel(key),
        keep,
        max(keep_ms, 1),
        handoff_ttl_ms,
        fence_ttl_ms,
        "1" if retry else "",
    )
    return (key, waiters, parked, fence_key(key)), args


RenewItem = tuple[str, str, int] | tuple[str, str, int, bool]


def renew_call(chunk: Sequence[RenewItem], fence_ttl_ms: int) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``RENEW_SCRIPT`` for ``(key, value, ttl_ms[, fenced])`` items.

    A fenced item (its holder read a fence) renews its fence counter too.
    """
    keys = [item[0] for item in chunk]
    fenced = [len(item) > 3 and bool(item[3]) for item in chunk]
    keys += [fence_key(item[0]) for item, flag in zip(chunk, fenced, strict=True) if flag]
    args: list[Any] = [item[1] for item in chunk] + [item[2] for item in chunk]
    args += ["1" if flag else "" for flag in fenced]
    args.append(fence_ttl_ms)
    return keys, args


def _not_a_string(reply: Any) -> Any:
    """A ``WRONGTYPE`` reply to ``GET`` as ``None``: a key of another type is no lock.

    Someone else's list or hash under the prefix must not stop a listing
    (``celery redislock ls``) or a worker's start-up recovery.
    """
    if isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE"):
        return None
    return reply


def decode_text(value: Any, encoding: str) -> str:
    """A reply (bytes or str) as text."""
    if isinstance(value, bytes):
        return value.decode(encoding, "replace")
    return str(value)


# Backends shared by every RedisLock on one client, keyed weakly by the
# client's pool (or by the cluster client). A backend holds no strong
# reference to that key, so dropping the client frees the backend and closes
# its connections (it used to keep the client alive: an fd leak per client).
_SHARED: weakref.WeakKeyDictionary[Any, LockStore] = weakref.WeakKeyDictionary()
_SHARED_GUARD = threading.Lock()


def _new_shared_guard() -> None:
    global _SHARED_GUARD
    _SHARED_GUARD = threading.Lock()  # it may have been held by another thread at the fork


os.register_at_fork(after_in_child=_new_shared_guard)


class _Kind(enum.Enum):
    """Who uses a set of connections (see the module docstring)."""

    COMMANDS = "commands"
    RELEASES = "releases"
    RENEWALS = "renewals"


class LockStore:
    """Lock operations against one Redis server (one per app setting).

    Args:
        url: ``redis://`` / ``rediss://`` / ``unix://`` / ``sentinel://`` /
            ``redis+cluster://`` URL of the lock store.
        options: Extra keyword arguments for the redis-py client; they
            override the package defaults (5 s socket and connect timeouts,
            2 quick retries). A ``retry`` given here is the command retry
            policy.
        renew_timeout: Socket timeout of the renewer's and the releases'
            connections. The renewer never retries within a tick; a release
            tries twice.
        client: Use this client's settings instead of a URL (the standalone
            lock). The backend keeps no reference to it.
        fence_ttl: Seconds a key's fence counter is kept after the lock
            (after its release, or its expiry). 0, the default: the counter
            goes with the lock, unless it is still ahead of the server clock
            (then it stays until the clock passes it); the next fence is the
            server clock in microseconds, still larger. A positive value
            keeps fences increasing for that long even if the server clock
            steps back (a failover to a replica with a slower clock).
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
        #: Milliseconds a lock handed to a parked execution waits for it to start.
        self.handoff_ttl_ms = 30_000
        #: The server takes ``SET NX GET`` (Redis >= 7, Valkey): cleared at its
        #: first "syntax error", after which acquires run ``ACQUIRE_SCRIPT``.
        self._set_nx_get = True
        if client is not None:
            self._client_ref = weakref.ref(client)
            self._where = describe_client(client)
            self._source: Callable[[], Any] = client_source(client)
        else:
            self._source = self._url_source

    def __repr__(self) -> str:
        return f"<LockStore {self.describe()}>"

    @classmethod
    def for_client(cls, client: redis.Redis | RedisCluster) -> LockStore:
        """Return the backend shared by every lock on ``client``'s connection pool.

        Sharing it is what lets the renewer serve all of them in one round
        trip per tick. It lives as long as the pool does, and no longer.
        """
        pool = client if isinstance(client, RedisCluster) else client.connection_pool
        backend = _SHARED.get(pool)
        if backend is None:
            with _SHARED_GUARD:
                backend = _SHARED.get(pool)
                if backend is None:
                    backend = cls(client=client)
                    _SHARED[pool] = backend
        return backend

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
                    topology = self._make_topology(kind)
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
            )
        return Topology(endpoint_of(source.connection_class, source.connection_kwargs))

    def warm_up(self) -> None:
        """Open the renewal connection now, so the first renewal is a single round trip.

        Call it only from the renewer thread, like :meth:`renew_many`.
        """
        topology = self._topology(_Kind.RENEWALS)
        if type(topology) is Topology:
            topology.endpoint.run(lambda connection: connection.connect())

    def load_scripts(self, probe_key: str | None = None) -> int:
        """Check that the store answers: ``SCRIPT LOAD`` the lock scripts on every primary.

        A check for worker start, on connections of its own (closed after):
        the renewal timeout (``redislock_renew_timeout``) bounds the connect
        and each reply, with no retry, so an unreachable store costs at most
        about twice that per primary (a Sentinel lookup adds the sentinels'
        own timeouts; a cluster's first slot-map lookup, redis-py's).

        Args:
            probe_key: A key this user may touch (under the key prefix): the
                release script is run on it once (it is absent: nothing
                changes), so that a user refused ``EVALSHA`` is found now,
                not at the first release.

        Returns:
            How many primaries loaded the scripts.

        Raises:
            LockStoreRefused: the store refuses the package's commands.
            LockBackendError: the store is unreachable or refused the scripts.
        """
        sources = [
            scripts.ACQUIRE,
            scripts.RELEASE,
            scripts.RENEW,
            scripts.RELEASE_FULL,
            scripts.FENCE,
            scripts.WAIT_TRY,
        ]
        topology: Topology | None = None
        try:
            topology = self._make_topology(_Kind.RENEWALS)
            primaries = topology.primaries()
            for endpoint in primaries:
                replies = endpoint.pipeline([("SCRIPT", "LOAD", s.source) for s in sources])
                for script, reply in zip(sources, replies, strict=True):
                    if isinstance(reply, ResponseError):
                        raise reply
                    if decode_text(reply, endpoint.encoding) != script.sha:
                        raise ResponseError(f"SCRIPT LOAD answered {reply!r}, not {script.sha}")
            if probe_key is not None:
                topology.run_for_key(
                    probe_key,
                    _script_runner((scripts.RELEASE, (probe_key,), ("startup-check",))),
                )
            return len(primaries)
        except ResponseError as exc:
            refusal = backend_error(exc, "load the scripts of", "*", self.describe())
            if refusal.refused:
                raise LockStoreRefused(str(refusal)) from exc
            raise LockBackendError(
                f"Redis at {self.describe()} refused to load the lock scripts: {exc}"
            ) from exc
        except (RedisError, RedisClusterException) as exc:
            raise LockBackendError(
                f"Redis at {self.describe()} is unavailable ({type(exc).__name__}: {exc})"
            ) from exc
        finally:
            if topology is not None:
                topology.close()

    @contextmanager
    def _errors(self, operation: str, key: str) -> Iterator[None]:
        try:
            yield
        except RedisError as exc:
            raise backend_error(exc, operation, key, self.describe()) from exc

    # -- operations ------------------------------------------------------

    def acquire(
        self,
        key: str,
        value: str,
        ttl_ms: int,
        adopt: Sequence[str] = (),
        min_replicas: int = 0,
        replicas_timeout: float = 1.0,
        waiting: bool = False,
    ) -> AcquireResult:
        """Take the lock if free (or already ours, or holding a value in ``adopt``).

        One round trip, ``SET NX PX GET``: the server's cost of a plain
        ``SET``. It also says who holds a taken key; not for how long (read
        :meth:`holder_ttl` if the policy needs it). Two round trips with
        ``min_replicas``. The result's ``sent_at`` is the :func:`clock`
        reading taken just before the command was sent: the lease is valid
        from then on.

        Args:
            key: Lock key.
            value: Value to store.
            ttl_ms: Time to live in milliseconds.
            adopt: Values this caller may take over (see ``ACQUIRE_SCRIPT``):
                a key found holding one of them is taken over in a second
                round trip on the same connection.
            min_replicas: If > 0, a taken lock must also be acknowledged by
                this many replicas (``WAIT`` on the same connection), or it
                is released again and this raises.
            replicas_timeout: Longest ``WAIT``, in seconds.
            waiting: The caller waits for the key's release: a holder found
                is marked waited for (``WAIT_TRY_SCRIPT``), so that its
                release publishes; one ``EVALSHA``.

        Raises:
            LockBackendError: Redis is unreachable or refused the script, or
                too few replicas acknowledged the lock.
            TypeError: an argument cannot be sent to Redis.
        """
        sent_at = clock()
        # try/except, not the _errors() context manager, on the two hot paths
        # (measured: 1.1 µs per call for the generator-based manager).
        try:
            call = (key, value, ttl_ms, adopt, min_replicas, replicas_timeout)
            reply, acked = self.do_acquire(*call, waiting) if waiting else self.do_acquire(*call)
        except RedisError as exc:
            raise backend_error(exc, "acquire", key, self.describe()) from exc
        if acked is not None and acked < min_replicas:
            self.release(key, value)
            raise LockBackendError(
                f"lock {key!r} was taken but only {acked} of {min_replicas} replica(s) "
                f"acknowledged it within {replicas_timeout}s; released it again "
                "(a failover now could lose it)"
            )
        return self._acquire_result(key, reply, sent_at)

    def _acquire_result(self, key: str, reply: Any, sent_at: float) -> AcquireResult:
        if int(reply[0]) == 1:
            return AcquireResult(True, sent_at=sent_at)
        encoding = self._topology(_Kind.COMMANDS).endpoint_for(key).encoding
        holder = without_mark(decode_text(reply[1], encoding))
        if reply[2] is None:  # SET NX GET: the holder, not its TTL (read on demand)
            return AcquireResult(
                False, holder, sent_at=sent_at, ttl_of=lambda: self.holder_ttl(key)
            )
        pttl = int(reply[2])
        return AcquireResult(False, holder, pttl / 1000.0 if pttl >= 0 else None, sent_at=sent_at)

    def holder_ttl(self, key: str) -> float | None:
        """Seconds left on ``key``'s lock (``None``: gone, or no expiry). One round trip."""
        with self._errors("inspect", key):
            pttl = int(
                self._topology(_Kind.COMMANDS).run_for_key(key, _command_runner("PTTL", key))
            )
        return pttl / 1000.0 if pttl >= 0 else None

    def fence(self, key: str, value: str) -> int | None:
        """Issue a fence to the holder of ``value`` (see ``FENCE_SCRIPT``): one round trip.

        Larger than every fence issued for the key before; ``None`` when the
        key no longer holds ``value`` (the lock was lost: no fence for it).

        Raises:
            LockBackendError: Redis is unreachable or refused the script.
        """
        call = (scripts.FENCE, (key, fence_key(key)), (value, self.fence_ttl_ms))
        with self._errors("fence", key):
            reply = self._topology(_Kind.COMMANDS).run_for_key(key, _script_runner(call))
        return int(reply[1]) if int(reply[0]) == 1 else None

    def park(
        self,
        key: str,
        value: str,
        ttl_ms: int,
        handoff: str = "",
        copy: str = "",
        message: bytes = b"",
        park_ttl_ms: int = 3_600_000,
        queued: tuple[str, str] | None = None,
        adopt: Sequence[str] = (),
        limit: int = 1,
        task_prefix: str = "",
        touch: ScriptCall | None = None,
        after: ScriptCall | None = None,
    ) -> ParkResult:
        """Take the lock, or park behind its holder until a release hands it over.

        One round trip. Parked, ``handoff`` waits in the key's queue (in
        arrival order, at most once); the release that frees the key leaves
        ``handoff`` in it instead and returns ``message`` for the releasing
        process to publish (see ``PARK_SCRIPT`` and ``RELEASE_SCRIPT``).

        Args:
            key: Lock key.
            value: Value to store when granted.
            ttl_ms: Lock time to live in milliseconds.
            handoff: This execution's hand-off value ('' if it never parks).
            copy: Tag of this copy of the parked execution.
            message: The message to publish when handed the lock; empty
                means only try (do not park).
            park_ttl_ms: Time to live of the queue keys, and of the
                queued key while this run is parked.
            queued: ``(queued key, this run's value in it)`` for a coalesced
                run: freed once granted.
            adopt: Values this caller may take over (as :meth:`acquire`).
            limit: Slots of the key (``lock_limit``); the result's ``key``
                is the slot taken.
            task_prefix: As :meth:`acquire_slot` (only with ``limit`` > 1).
            touch: The pending index's touch for this key
                (``PendingIndex.touch_call``), sent first in the same round
                trip (two on a cluster): a parked call is then found by the
                workers' sweep even if its holder's worker dies.
            after: A script call sent right after the park, in the same
                round trip (``PendingIndex.forget_queued_call``).

        Raises:
            LockBackendError: Redis is unreachable or refused the script.
        """
        queued_at, queued_value = queued or (queued_key_of(key), "")
        slots = slot_keys(key, limit)
        keys = (*slots, fence_key(key), *handoff_keys(key), queued_at, next_run_key(key))
        args = (
            value,
            ttl_ms,
            self.fence_ttl_ms,
            handoff,
            copy,
            message,
            park_ttl_ms,
            queued_value,
            task_prefix if limit > 1 else "",
            self.handoff_ttl_ms,
            *adopt,
        )
        sent_at = clock()
        with self._errors("acquire", key):
            reply = self.do_park(keys, args, touch, after)
        status = int(reply[0])
        if status == 1:
            taken = slots[int(reply[1]) - 1]
            return ParkResult(AcquireResult(True, sent_at=sent_at, key=taken))
        if status == 2:
            return ParkResult(AcquireResult(False, sent_at=sent_at), already_ran=True)
        if status == 3:
            # An earlier parked call goes first: this copy handed it the slot.
            self._hand_off_reply(key, reply[:2] + reply[3:])
        pttl = int(reply[2])
        encoding = self._topology(_Kind.COMMANDS).endpoint_for(key).encoding
        return ParkResult(
            AcquireResult(
                False,
                None if reply[1] is None else without_mark(decode_text(reply[1], encoding)),
                pttl / 1000.0 if pttl >= 0 else None,
                sent_at=sent_at,
            ),
            parked=status == 3 or bool(int(reply[3])),
        )

    def withdraw(self, key: str, handoff: str, park_ttl_ms: int, limit: int = 1) -> None:
        """Withdraw a parked call that gave up: it leaves the queue and no copy of it runs.

        A slot already handed to it passes to the next parked call (whose
        message is published, as after a release). One round trip.

        Raises:
            LockBackendError: Redis is unreachable or refused the script.
        """
        keys = (*slot_keys(key, limit), *handoff_keys(key), fence_key(key))
        args = (
            handoff,
            "withdrawn",
            park_ttl_ms,
            self.handoff_ttl_ms,
            release_channel(key),
            self.fence_ttl_ms,
        )
        with self._errors("withdraw", key):
            reply = self.do_script(park_scripts.UNPARK, keys, args)
        if isinstance(reply, list):
            self._hand_off_reply(key, reply)

    def debounce(
        self,
        key: str,
        task_id: str,
        window_ms: int,
        max_wait_ms: int,
        message: bytes = b"",
        handoff: str = "",
        touch: ScriptCall | None = None,
        grace_ms: int = 0,
        delay_ms: int = 0,
    ) -> tuple[bool, str, float]:
        """Record a call in ``key``'s debounce burst (one round trip).

        A new burst keeps ``message`` (its run, with hand-off value
        ``handoff``, published with a countdown of ``delay_ms`` if that is
        longer than the window) for the workers' sweep, which publishes it
        again if the run has not started ``grace_ms`` after it was due;
        ``touch`` (``PendingIndex.touch_call``) is sent first in the same
        round trip.

        Returns:
            ``(new burst, burst task id, seconds until the run is due)``.
        """
        ttl_ms = max(max_wait_ms + window_ms, delay_ms) + grace_ms + 60_000
        call = (
            pending_scripts.DEBOUNCE,
            (debounce_key(key),),
            (task_id, window_ms, max_wait_ms, ttl_ms, message, handoff, delay_ms, grace_ms),
        )
        with self._errors("debounce", key):
            if touch is not None:
                reply = self.run_scripts([touch, call])[1]
            else:
                reply = self.do_script(*call)
        encoding = self._topology(_Kind.COMMANDS).endpoint_for(key).encoding
        return bool(int(reply[0])), decode_text(reply[1], encoding), int(reply[2]) / 1000.0

    def debounce_due(
        self, key: str, task_id: str, forget: bool = False, after: ScriptCall | None = None
    ) -> float:
        """Seconds until ``task_id``'s debounced run is due; 0 (or less): run now.

        At 0 the burst is over (its record deleted). ``forget`` deletes the
        record of a burst whose message was never published. ``after`` is
        sent right after, in the same round trip
        (``PendingIndex.forget_debounced_call``).
        """
        call = (
            pending_scripts.DEBOUNCE_DUE,
            (debounce_key(key),),
            (task_id, "1" if forget else ""),
        )
        with self._errors("debounce", key):
            reply = self._with_neighbours(call, None, after)
        return int(reply) / 1000.0

    def acquire_waiting(
        self,
        key: str,
        value: str,
        ttl_ms: int,
        timeout: float,
        adopt: Sequence[str] = (),
        min_replicas: int = 0,
        replicas_timeout: float = 1.0,
        limit: int = 1,
        task_prefix: str = "",
    ) -> AcquireResult:
        """Take a lock already found held, waiting up to ``timeout`` seconds.

        Callers try :meth:`acquire` first; this subscribes to the key's
        release channel *before* trying again, so a release between the
        failed try and the subscription is never missed. Each wait is also
        capped at the holder's remaining TTL, so a lost message or a holder
        that died costs at most that long. The subscription has a connection
        of its own, closed on the way out. With ``limit`` > 1 it takes any of
        the key's slots (see :meth:`acquire_slot`); every slot's release
        wakes it.

        Raises:
            LockBackendError: Redis is unreachable (or too few replicas).
        """
        deadline = clock() + timeout
        endpoint = self._topology(_Kind.COMMANDS).endpoint_for(key)
        dropped = 0
        with self._errors("wait for", key):
            while True:
                subscribed = False
                try:
                    with Subscription(endpoint, release_channel(key)) as sub:
                        subscribed = True
                        while True:
                            if limit > 1:
                                result = self.acquire_slot(
                                    key,
                                    limit,
                                    value,
                                    ttl_ms,
                                    adopt,
                                    task_prefix,
                                    min_replicas,
                                    replicas_timeout,
                                    waiting=True,
                                )
                            else:
                                result = self.acquire(
                                    key,
                                    value,
                                    ttl_ms,
                                    adopt,
                                    min_replicas,
                                    replicas_timeout,
                                    waiting=True,
                                )
                            remaining = deadline - clock()
                            if result.acquired or remaining <= 0:
                                return result
                            wait = remaining
                            if result.ttl_remaining is not None:
                                wait = min(wait, result.ttl_remaining + 0.005)
                            sub.wait(max(wait, 0.001))
                except (ConnectionError, TimeoutError):
                    # The subscription dropped (a restart, a failover, a
                    # client kill): subscribe again. The acquire that follows
                    # a new subscription sees any release that came between.
                    # A subscription that never came up is a store that is
                    # down: give up at once, within the documented bound.
                    dropped += 1
                    if not subscribed or dropped > _RESUBSCRIPTIONS:
                        raise

    def wait_released(self, key: str, owner_prefix: str, timeout: float, limit: int = 1) -> bool:
        """Wait up to ``timeout`` seconds until ``key`` no longer holds a value of this owner.

        Woken by the release notification (a subscription of its own), not
        by polling: the value is marked waited for (``WATCH_SCRIPT``), so its
        release publishes. Returns True once released (or taken by someone
        else). With ``limit`` > 1, until none of the key's slots holds one.

        Raises:
            LockBackendError: Redis is unreachable.
        """
        deadline = clock() + timeout
        endpoint = self._topology(_Kind.COMMANDS).endpoint_for(key)
        watch = (scripts.WATCH, slot_keys(key, limit), (owner_prefix,))
        with self._errors("wait for", key), Subscription(endpoint, release_channel(key)) as sub:
            while True:
                # Marks the value waited for: its release then publishes.
                if not int(endpoint.run(_script_runner(watch)(endpoint))):
                    return True
                remaining = deadline - clock()
                if remaining <= 0:
                    return False
                sub.wait(remaining)

    def release(
        self,
        key: str,
        value: str,
        keep: str = "",
        keep_ms: int = 0,
        fenced: bool = False,
        resent: bool = False,
    ) -> ReleaseOutcome:
        """Delete the lock if it still holds ``value`` exactly.

        Args:
            key: Lock key.
            value: The holder's value.
            keep: If given, leave this value (for ``keep_ms``) instead of
                deleting: the lock passes to whoever can adopt ``keep``, or
                stays as an idempotency window.
            keep_ms: Time to live of ``keep`` in milliseconds.
            fenced: The holder read a fence: the key's counter is settled
                (kept only while ahead of the clock, or ``fence_ttl``). A
                caller that releases for another holder (an operator, a
                take-back) passes True: it cannot know.
            resent: Sent again after an exception cut off the reply of the
                same release: it runs as a retry (it publishes a hand-over
                the first made, and reports a key found gone or retaken as
                released).
        """
        return self._release(key, value, "exact", keep, keep_ms, fenced, resent)

    def release_owner(
        self, key: str, owner_prefix: str, keep: str = "", keep_ms: int = 0
    ) -> ReleaseOutcome:
        """Delete (or hand over, see :meth:`release`) if the value starts with ``owner_prefix``."""
        return self._release(key, owner_prefix, "prefix", keep, keep_ms)

    def acquire_slot(
        self,
        key: str,
        limit: int,
        value: str,
        ttl_ms: int,
        adopt: Sequence[str] = (),
        task_prefix: str = "",
        min_replicas: int = 0,
        replicas_timeout: float = 1.0,
        waiting: bool = False,
    ) -> AcquireResult:
        """Take one of ``key``'s ``limit`` slots (``lock_limit``): at most ``limit`` holders.

        One round trip (two with ``min_replicas``); see ``ACQUIRE_SLOT_SCRIPT``.
        Each slot is an ordinary lock key (slot 1 is ``key``): the result's
        ``key`` is the slot taken, which the holder renews and releases as
        any lock. When every slot is held, the result names the holder whose
        slot frees first (or a holder of the same task, ``task_prefix``).

        Args:
            key: The base lock key.
            limit: Number of slots (>= 1).
            value: Value to store.
            ttl_ms: Time to live in milliseconds.
            adopt: Values this caller may take over, in whichever slot.
            task_prefix: ``"v1|<task id>|"``: a slot held by the same task
                counts as contention, so one message never runs twice at once.
            min_replicas: As :meth:`acquire`.
            replicas_timeout: As :meth:`acquire`.
            waiting: As :meth:`acquire` (every holder is marked).

        Raises:
            LockBackendError: Redis is unreachable or refused the script, or
                too few replicas acknowledged the slot.
        """
        sent_at = clock()
        with self._errors("acquire", key):
            reply, acked = self.do_acquire_slot(
                key,
                limit,
                value,
                ttl_ms,
                adopt,
                task_prefix,
                min_replicas,
                replicas_timeout,
                waiting,
            )
        if int(reply[0]) == 1:
            taken = slot_keys(key, limit)[int(reply[1]) - 1]
            if acked is not None and acked < min_replicas:
                self.release(taken, value)
                raise LockBackendError(
                    f"lock {taken!r} was taken but only {acked} of {min_replicas} replica(s) "
                    f"acknowledged it within {replicas_timeout}s; released it again "
                    "(a failover now could lose it)"
                )
            return AcquireResult(True, sent_at=sent_at, key=taken)
        pttl = int(reply[2])
        encoding = self._topology(_Kind.COMMANDS).endpoint_for(key).encoding
        return AcquireResult(
            False,
            without_mark(decode_text(reply[1], encoding)),
            pttl / 1000.0 if pttl >= 0 else None,
            sent_at=sent_at,
        )

    def release_slot_of(
        self, key: str, limit: int, match: str, mode: str = "exact"
    ) -> ReleaseOutcome:
        """Release whichever of ``key``'s slots holds ``match`` (a value, or an owner prefix).

        For callers that do not know the slot: a take-back of an unanswered
        acquire, a worker's parent releasing a dead child's slot. With
        ``limit`` 1 it is :meth:`release` / :meth:`release_owner`.

        Returns:
            ``RELEASED``; ``ALREADY_GONE`` if no slot matched and one is
            free; ``NOT_OURS`` if every slot holds another value.
        """
        if limit <= 1:
            return self._release(key, match, mode, "", 0)
        with self._errors("release", key):
            reply = self.do_release_slots(key, limit, match, mode)
        if isinstance(reply, list):
            self._hand_off_reply(key, reply)
            return ReleaseOutcome.RELEASED
        return ReleaseOutcome(max(min(reply, 1), -1))

    def _release(
        self,
        key: str,
        match: str,
        mode: str,
        keep: str,
        keep_ms: int,
        fenced: bool = False,
        resent: bool = False,
    ) -> ReleaseOutcome:
        # Passed only when set: an override of do_release(key, match, mode,
        # keep, keep_ms) still works.
        flags = {name: True for name, on in (("settle", fenced), ("resent", resent)) if on}
        if resent and not takes_keyword(self.do_release, "resent"):
            del flags["resent"]
        try:
            reply = self.do_release(key, match, mode, keep, keep_ms, **flags)
            if resent and "resent" not in flags:
                reply = after_retry(key, reply)
        except RedisError as exc:
            raise backend_error(exc, "release", key, self.describe()) from exc
        if isinstance(reply, list):
            self._hand_off_reply(key, reply)
            return ReleaseOutcome.RELEASED
        return ReleaseOutcome(reply)

    def _hand_off_reply(self, key: str, reply: list[Any]) -> None:
        _, waiter, message = reply
        if isinstance(message, str):  # a client with decode_responses
            message = message.encode("utf-8")
        self._hand_off(key, decode_text(waiter, "utf-8"), message)

    def _hand_off(self, key: str, waiter: str, message: bytes) -> None:
        """The release handed ``key`` to a parked execution: publish its message.

        Never raises: the parked execution's own re-sent copy runs at its
        deadline if this publish fails (or never happens).
        """
        publish = self.on_handoff
        if publish is None:
            logger.warning(
                "lock %s was handed to a parked execution, but this process cannot publish "
                "its message; its re-sent copy runs when its countdown ends",
                key,
            )
            return
        try:
            publish(key, waiter, message)
        except Exception:
            logger.exception(
                "could not publish the parked execution lock %s was handed to; its re-sent "
                "copy runs when its countdown ends",
                key,
            )

    def extend(self, key: str, value: str, ttl_ms: int, fenced: bool = False) -> RenewOutcome:
        """Reset the lock's TTL to ``ttl_ms`` if it still holds ``value``.

        ``fenced``: the holder read a fence; its counter is renewed with it.
        """
        with self._errors("extend", key):
            # Passed only when set: an override of do_extend(key, value, ttl_ms) still works.
            flags = {"fenced": True} if fenced else {}
            return RenewOutcome(self.do_extend(key, value, ttl_ms, **flags))

    def renew_many(self, items: Sequence[RenewItem]) -> list[RenewOutcome]:
        """Renew many locks: one pipelined round trip per node.

        Call it only from the renewer thread: its connections belong to that
        thread (under gevent, a greenlet must never touch them).

        Args:
            items: ``(key, value, ttl_ms)`` for each lock, or ``(key, value,
                ttl_ms, fenced)``: a lock whose holder read a fence renews
                its fence counter too.

        Raises:
            LockBackendError: a round trip failed; no outcome is known.
        """
        if not items:
            return []
        with self._errors("renew", items[0][0]):
            return [RenewOutcome(status) for status in self.do_renew(items)]

    def inspect(self, key: str) -> tuple[str | None, float | None]:
        """Return the raw value and remaining TTL (seconds) of ``key``."""
        value, ttl, _ = self.inspect_many([key])[0]
        return value, ttl

    def inspect_many(
        self, keys: Sequence[str]
    ) -> list[tuple[str | None, float | None, int | None]]:
        """Return ``(value, remaining TTL in s, last fence)`` for each key.

        The value as its holder stored it (a waiter's mark left out).

        One pipelined round trip per node.
        """
        out: list[tuple[str | None, float | None, int | None]] = [(None, None, None)] * len(keys)
        if not keys:
            return out
        topology = self._topology(_Kind.COMMANDS)
        with self._errors("inspect", keys[0]):
            for endpoint, indices in topology.group(keys):
                commands: list[tuple[str, str]] = []
                for index in indices:
                    key = keys[index]
                    commands += [("GET", key), ("PTTL", key), ("GET", fence_key(key))]
                replies = [_not_a_string(reply) for reply in endpoint.pipeline(commands)]
                for error in replies:
                    if isinstance(error, ResponseError):
                        raise error
                for position, index in enumerate(indices):
                    value, pttl, fence = replies[position * 3 : position * 3 + 3]
                    out[index] = (
                        None
                        if value is None
                        else without_mark(decode_text(value, endpoint.encoding)),
                        pttl / 1000.0 if value is not None and pttl >= 0 else None,
                        int(fence) if fence is not None else None,
                    )
        return out

    def scan_keys(self, match: str, batch: int = 1000) -> Iterator[list[str]]:
        """Yield batches of keys matching the glob ``match`` (SCAN, never KEYS), on every primary.

        Fence counters (``...:fence``), debounce records and the keys of
        parked executions (``...:waiters``, ``...:parked``, ``...:ran``) are
        left out. SCAN may return a key
        twice while the keyspace is being resized; callers deduplicate.
        """
        with self._errors("list", match):
            for endpoint in self._topology(_Kind.COMMANDS).primaries():
                cursor = b"0"
                while True:
                    cursor, found = endpoint.call("SCAN", cursor, "MATCH", match, "COUNT", batch)
                    keys = [decode_text(key, endpoint.encoding) for key in found]
                    keys = [key for key in keys if not key.endswith(_NOT_LOCKS)]
                    if keys:
                        yield keys
                    if cursor in (b"0", 0, "0"):
                        break

    # -- override points -------------------------------------------------
    #
    # Each runs one script over the transport and returns its raw reply; the
    # public methods above map errors and build the outcome types. Override
    # them in a subclass (as redis-py's ``Lock.do_acquire``) to add
    # instrumentation or a different script, and pass an instance as
    # ``RedisLock(store=...)`` or the class as ``redislock_store_class``.

    def do_acquire(
        self,
        key: str,
        value: str,
        ttl_ms: int,
        adopt: Sequence[str],
        min_replicas: int,
        replicas_timeout: float,
        waiting: bool = False,
    ) -> tuple[Any, int | None]:
        """Take the key: ``SET NX PX GET`` (then ``WAIT`` when ``min_replicas`` > 0).

        A key found holding our value or one in ``adopt`` is taken over with
        ``ACQUIRE_SCRIPT`` on the same connection; a waiting caller runs
        ``WAIT_TRY_SCRIPT`` instead, and so does every acquire on a server
        without ``SET NX GET`` (Redis < 7).

        Returns:
            The reply as ``ACQUIRE_SCRIPT`` gives it (a contended ``SET``'s
            holder comes with ``None`` for its PTTL), and the number of
            replicas that acknowledged the write (``None`` when not asked
            for or not taken).
        """
        topology = self._topology(_Kind.COMMANDS)
        timeout_ms = 0
        if min_replicas > 0:
            if isinstance(topology, ClusterTopology):
                raise LockBackendError(
                    "lock_min_replicas is not available on Redis Cluster: WAIT must run on "
                    "the connection that took the lock"
                )
            timeout_ms = max(int(replicas_timeout * 1000), 1)
        script = scripts.WAIT_TRY if waiting else scripts.ACQUIRE
        args = (value, ttl_ms, *adopt)
        own = (value, *adopt)
        set_nx = not waiting and self._set_nx_get

        def make(endpoint: Endpoint) -> Callable[[Any], tuple[Any, int | None]]:
            encoding = endpoint.encoding
            scripted = script.exchange((key,), args, encoding)
            packed = pack_command(set_nx_get(key, value, ttl_ms), encoding) if set_nx else b""

            def run(connection: Any) -> tuple[Any, int | None]:
                reply = TAKE_OVER
                if packed:
                    (found,) = send_and_read(connection, packed, 1)
                    if unsupported(found):
                        self._set_nx_get = False  # Redis < 7: NX and GET not together
                    else:
                        reply = after_set_nx_get(found, own, encoding)
                if reply is TAKE_OVER:
                    reply = scripted(connection)
                if timeout_ms and int(reply[0]) == 1:
                    wait = pack_command(("WAIT", min_replicas, timeout_ms), encoding)
                    (acked,) = send_and_read(connection, wait, 1)
                    if isinstance(acked, ResponseError):
                        raise acked
                    return reply, int(acked)
                return reply, None

            return run

        return topology.run_for_key(key, make)

    def do_acquire_slot(
        self,
        key: str,
        limit: int,
        value: str,
        ttl_ms: int,
        adopt: Sequence[str],
        task_prefix: str,
        min_replicas: int,
        replicas_timeout: float,
        waiting: bool = False,
    ) -> tuple[Any, int | None]:
        """Run ``ACQUIRE_SLOT_SCRIPT`` (then ``WAIT`` when ``min_replicas`` > 0).

        Returns:
            The script's reply, and the number of replicas that acknowledged
            the write (``None`` when not asked for or not taken).
        """
        keys = slot_keys(key, limit)
        args = (value, ttl_ms, "1" if waiting else "", task_prefix, *adopt)
        topology = self._topology(_Kind.COMMANDS)
        if min_replicas > 0:
            if isinstance(topology, ClusterTopology):
                raise LockBackendError(
                    "lock_min_replicas is not available on Redis Cluster: WAIT must run on "
                    "the connection that took the lock"
                )
            timeout_ms = max(int(replicas_timeout * 1000), 1)
            reply, acked = topology.run_for_key(
                key,
                lambda endpoint: _then_wait(
                    endpoint, keys, args, min_replicas, timeout_ms, park_scripts.ACQUIRE_SLOT
                ),
            )
            return reply, acked
        reply = topology.run_for_key(
            key,
            lambda endpoint: park_scripts.ACQUIRE_SLOT.exchange(keys, args, endpoint.encoding),
        )
        return reply, None

    def do_release_slots(self, key: str, limit: int, match: str, mode: str) -> Any:
        """Run ``RELEASE_SLOTS_SCRIPT``; return its reply (slot number, 0, -1 or a hand-off).

        On the releases' connections (short timeout, one retry), as
        :meth:`do_release`. If the first attempt's reply was lost, the
        retry's "no match" cannot tell: it is reported as released (1), as
        :meth:`do_release` does.
        """
        waiters, parked, _ = handoff_keys(key)
        keys = (*slot_keys(key, limit), waiters, parked, fence_key(key))
        args = (match, mode, release_channel(key), self.handoff_ttl_ms, self.fence_ttl_ms)
        attempts = ReleaseAttempts(key)

        def make(endpoint: Endpoint) -> Callable[[Any], Any]:
            run_script = park_scripts.RELEASE_SLOTS.exchange(keys, args, endpoint.encoding)
            return lambda connection: _attempt(attempts, connection, lambda _retry: run_script)

        return attempts.outcome(self._topology(_Kind.RELEASES).run_for_key(key, make))

    def do_release(
        self,
        key: str,
        match: str,
        mode: str,
        keep: str,
        keep_ms: int,
        settle: bool = False,
        resent: bool = False,
    ) -> Any:
        """Release: ``RELEASE_SCRIPT``, or ``RELEASE_FULL_SCRIPT``; return the reply.

        A plain release (the exact value, nothing kept, no fence read) runs
        the lean script: ``GET``, compare, ``DEL``. If the value is marked
        waited for, or the release keeps a value, goes by owner prefix or
        must settle a fence counter (``settle``), the full one runs (the lean
        one first, when it could not know: a second round trip, paid by the
        releases someone waits for).

        Releases have connections of their own (short timeout, one retry), so
        a frozen Redis delays a finishing task by at most two short attempts;
        the TTL frees the key if both fail. An attempt whose reply was lost
        (or ``resent``: the caller sends the release again after an exception
        cut off the first one's reply) is followed by a retry: see
        :class:`~celery_redislock.protocol.ReleaseAttempts`.

        Returns:
            1, 0, -1, or ``[1, hand-off value, message]`` (see
            ``RELEASE_FULL_SCRIPT``).
        """
        lean = mode == "exact" and not keep and not settle
        attempts = ReleaseAttempts(key, resent)

        def make(endpoint: Endpoint) -> Callable[[Any], Any]:
            encoding = endpoint.encoding
            first = scripts.RELEASE.exchange((key,), (match,), encoding) if lean else None

            def full(retry: bool) -> Callable[[Any], Any]:
                keys, args = release_call(
                    key, match, mode, keep, keep_ms, self.handoff_ttl_ms, self.fence_ttl_ms, retry
                )
                return scripts.RELEASE_FULL.exchange(keys, args, encoding)

            def script(retry: bool) -> Callable[[Any], Any]:
                if retry or first is None:
                    return full(retry)

                def lean_first(connection: Any) -> Any:
                    reply = first(connection)
                    if reply == 2:  # someone waits behind us: hand over, wake them
                        return full(False)(connection)
                    return reply

                return lean_first

            return lambda connection: _attempt(attempts, connection, script)

        return attempts.outcome(self._topology(_Kind.RELEASES).run_for_key(key, make))

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

    def do_park(
        self,
        keys: Sequence[str],
        args: Sequence[Any],
        before: ScriptCall | None = None,
        after: ScriptCall | None = None,
    ) -> Any:
        """Run ``PARK_SCRIPT`` between ``before`` and ``after``; return the park's raw reply."""
        return self._with_neighbours((park_scripts.PARK, keys, args), before, after)

    def _with_neighbours(
        self, call: ScriptCall, before: ScriptCall | None, after: ScriptCall | None
    ) -> Any:
        """Run ``call`` with the calls before and after it (if any); return its reply."""
        if before is None and after is None:
            return self._topology(_Kind.COMMANDS).run_for_key(call[1][0], _script_runner(call))
        calls = [c for c in (before, call, after) if c is not None]
        return self.run_scripts(calls)[0 if before is None else 1]

    def do_extend(self, key: str, value: str, ttl_ms: int, fenced: bool = False) -> int:
        """Run ``RENEW_SCRIPT`` for one key (and its fence counter); return its status."""
        keys, args = renew_call(((key, value, ttl_ms, fenced),), self.fence_ttl_ms)
        reply = self._topology(_Kind.COMMANDS).run_for_key(
            key, lambda endpoint: scripts.RENEW.exchange(keys, args, endpoint.encoding)
        )
        return int(reply[0])

    def do_renew(self, items: Sequence[RenewItem]) -> list[int]:
        """Run ``RENEW_SCRIPT`` over many keys (renewer thread only); one status per item.

        One pipelined round trip per node. A script may only touch keys of
        one slot: the topology groups by slot; chunks hold indices, so the
        statuses keep the callers' order.
        """
        topology = self._topology(_Kind.RENEWALS)
        statuses = [0] * len(items)
        by_endpoint: dict[int, tuple[Endpoint, list[list[int]]]] = {}
        for endpoint, indices in topology.group([item[0] for item in items]):
            chunks = by_endpoint.setdefault(id(endpoint), (endpoint, []))[1]
            for start in range(0, len(indices), RENEW_CHUNK_SIZE):
                chunks.append(indices[start : start + RENEW_CHUNK_SIZE])
        for endpoint, chunks in by_endpoint.values():
            calls = [renew_call([items[i] for i in chunk], self.fence_ttl_ms) for chunk in chunks]
            replies = scripts.RENEW.many(endpoint, calls)
            for chunk, reply in zip(chunks, replies, strict=True):
                for index, status in zip(chunk, reply, strict=True):
                    statuses[index] = int(status)
        return statuses

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
    except ResponseError:
        attempts.answered()  # a redirection or a refusal: nothing ran
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


def _then_wait(
    endpoint: Endpoint,
    keys: Sequence[str],
    args: Sequence[Any],
    replicas: int,
    timeout_ms: int,
    script: Script | None = None,
) -> Callable[[Any], tuple[Any, int | None]]:
    """An exchange: the acquire script, then ``WAIT`` on the same connection if it succeeded.

    ``WAIT`` counts the writes of its own connection, so it must follow the
    script on that connection, and never inside MULTI.
    """
    acquire = (script or scripts.ACQUIRE).exchange(keys, args, endpoint.encoding)
    wait = pack_command(("WAIT", replicas, timeout_ms), endpoint.encoding)

    def run(connection: Any) -> tuple[Any, int | None]:
        reply = acquire(connection)
        if int(reply[0]) != 1:
            return reply, None
        connection.send_packed_command([wait])
        return reply, int(connection.read_response())

    return run
