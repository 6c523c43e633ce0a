"""The only module that talks to Redis: lock scripts, clients and their errors.

Every lock operation is one round trip: a single ``EVALSHA`` (or a pipeline
of them for batched renewal). After ``SCRIPT FLUSH``, a restart or a
failover the server answers ``NOSCRIPT``; the command is then re-sent once as
``EVAL``, which also caches the script again, so the cost is one extra round
trip per script per flush and never an error.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import hashlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError, NoScriptError, RedisError, ResponseError, TimeoutError
from redis.retry import Retry
from redis.sentinel import Sentinel

from celery_redislock._clock import clock
from celery_redislock.exceptions import LockBackendError
from celery_redislock.tokens import LockValue

__all__ = [
    "AcquireResult",
    "LockBackend",
    "ReleaseOutcome",
    "RenewOutcome",
    "fence_key",
    "release_channel",
]

logger = logging.getLogger("celery_redislock.backend")

T = TypeVar("T")

# KEYS[1] - lock key
# KEYS[2] - fence counter of this key (same hash slot: KEYS[1] .. ':fence')
# ARGV[1] - value to store (see tokens.py)
# ARGV[2] - time to live in milliseconds
# ARGV[3] - a value this caller may take over ("adopt"), or ''. A worker
#           adopts the lock its producer took at enqueue time: the queued
#           value is replaced by the running one in the same step.
# ARGV[4] - time to live of the fence counter in milliseconds
# returns {1, fence} when the lock was taken (a new fence), when the key
#         already holds ARGV[1] (a client retry after a lost reply: still
#         ours, TTL refreshed, same fence) or when it held ARGV[3] (same
#         fence as the queued holder); {0, holder value, holder PTTL in ms}
#         when someone else holds it.
# The fence is max(last fence + 1, server time in microseconds): it keeps
# increasing after a restart that lost the counter, and the counter key
# expires, so no key is left behind for ever. Lua numbers are doubles; a
# microsecond timestamp (~1.8e15) is exact below 2^53.
ACQUIRE_SCRIPT = """
local current = redis.call('GET', KEYS[1])
local ours = current == ARGV[1] or (ARGV[3] ~= '' and current == ARGV[3])
if current and not ours then
    return {0, current, redis.call('PTTL', KEYS[1])}
end
local fence = redis.call('GET', KEYS[2])
if not current or not fence then
    local now = redis.call('TIME')
    local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
    fence = string.format('%.0f', math.max(tonumber(fence or '0') + 1, micros))
end
local counter_ttl = math.max(tonumber(ARGV[4]), tonumber(ARGV[2]))
redis.call('SET', KEYS[2], fence, 'PX', counter_ttl)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, fence}
"""

# KEYS[1] - lock key
# ARGV[1] - the holder's whole value (mode "exact") or an owner prefix
#           (mode "prefix", used by a worker's parent for a dead child)
# ARGV[2] - "exact" or "prefix"
# ARGV[3] - channel to PUBLISH on when released, to wake waiters
# ARGV[4] - '' to delete; otherwise a value to leave in place instead
#           (handing the lock back to a queued retry, or keeping it as an
#           idempotency window after success)
# ARGV[5] - time to live in milliseconds for ARGV[4]
# returns 1 if released (or handed over), 0 if the key was already gone,
#         -1 if another holder's value is there (it is left alone)
RELEASE_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if not current then
    return 0
end
local ours
if ARGV[2] == 'prefix' then
    ours = string.sub(current, 1, string.len(ARGV[1])) == ARGV[1]
else
    ours = current == ARGV[1]
end
if not ours then
    return -1
end
if ARGV[4] ~= '' then
    redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
    redis.call('PUBLISH', ARGV[3], '1')  -- a waiting retry may adopt it
    return 1
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[3], '1')
return 1
"""

# KEYS[1..n] - lock keys
# ARGV[i]    - the holder's value for KEYS[i]
# ARGV[n+i]  - new time to live in milliseconds for KEYS[i]
# returns one status per key: 1 renewed, 0 gone, -1 another holder's value.
# It only PEXPIREs a key that still holds our value; it never re-creates an
# expired key, which would hide a gap in which someone else may have run.
RENEW_SCRIPT = """
local n = #KEYS
local result = {}
for i = 1, n do
    local current = redis.call('GET', KEYS[i])
    if not current then
        result[i] = 0
    elseif current == ARGV[i] then
        redis.call('PEXPIRE', KEYS[i], ARGV[n + i])
        result[i] = 1
    else
        result[i] = -1
    end
end
return result
"""


class _IdleConnections:
    """Connections of one pool kept for the direct path, handed out LIFO.

    A pool's own checkout costs a lock and a non-blocking ``recv`` (its
    "unread data" check) per command; this is a ``deque.pop``. The check is
    not needed here: redis-py closes a connection whenever a send or read is
    interrupted, so no connection is put back with a reply pending. The
    connections are built from the pool's class and arguments (so AUTH, TLS
    and Sentinel resolution are the pool's), but are not counted against its
    ``max_connections``, nor closed by ``client.close()``: they close with
    :meth:`LockBackend.close`, or when the pool is garbage-collected. After a
    fork the parent's connections are dropped unused.
    """

    def __init__(self, pool: Any) -> None:
        # Not the pool itself: it is the weak key this object is stored under.
        self._new = functools.partial(pool.connection_class, **pool.connection_kwargs)
        self._pid = os.getpid()
        self._idle: collections.deque[Any] = collections.deque()

    def take(self) -> Any:
        if self._pid != os.getpid():
            self._idle, self._pid = collections.deque(), os.getpid()
        try:
            return self._idle.pop()
        except IndexError:
            return self._new()

    def give_back(self, connection: Any) -> None:
        if self._pid == os.getpid():
            self._idle.append(connection)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().disconnect()


_IDLE: weakref.WeakKeyDictionary[Any, _IdleConnections] = weakref.WeakKeyDictionary()
_IDLE_GUARD = threading.Lock()


def _idle_connections(pool: Any) -> _IdleConnections:
    idle = _IDLE.get(pool)
    if idle is None:
        with _IDLE_GUARD:
            idle = _IDLE.setdefault(pool, _IdleConnections(pool))
    return idle


def _uses_direct_path(client: Any) -> bool:
    return (
        type(client) is redis.Redis
        and client.connection is None
        and getattr(client.connection_pool, "cache", None) is None
    )


def _on_direct_connection(client: Any, call: Callable[[Any], Any]) -> Any:
    """Run ``call(connection)`` on an idle connection, under the client's retry policy."""
    idle = _idle_connections(client.connection_pool)
    connection = idle.take()
    try:
        return connection.retry.call_with_retry(
            lambda: call(connection), lambda _error: connection.disconnect()
        )
    finally:
        idle.give_back(connection)


def _connect_direct(client: Any) -> None:
    """Have one connection of ``client``'s direct path open (or ping it)."""
    if not _uses_direct_path(client):
        client.ping()
        return
    _on_direct_connection(client, lambda connection: connection.connect())


class _Script:
    """A Lua script addressed by SHA1, re-sent as EVAL after NOSCRIPT.

    Calls on a plain :class:`redis.Redis` take a direct path: the command is
    packed here (a few byte joins) and written to one of the pool's
    connections kept by :class:`_IdleConnections`, whose reply redis-py
    parses. That skips redis-py's general command machinery (per-argument
    encoding, connection checkout, response callbacks, observability hooks),
    which cost more client CPU than the round trip itself on the per-task
    path. Connection handling stays redis-py's (connect, AUTH, TLS, Sentinel
    resolution), and so do the client's retry policy and its errors. Other
    clients (Redis Cluster, a single-connection client, client-side caching)
    go through ``evalsha``.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self._evalsha_head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n" + self.sha.encode() + b"\r\n"

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        if not _uses_direct_path(client):
            try:
                return client.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:
                return client.eval(self.source, len(keys), *keys, *args)
        return _on_direct_connection(client, lambda c: self._run_on(c, keys, args))

    def call_then_wait(
        self, client: Any, keys: Sequence[str], args: Sequence[Any], replicas: int, timeout_ms: int
    ) -> tuple[Any, int | None]:
        """Run the script, then ``WAIT`` on the same connection if it reports success.

        Returns the script's reply and the number of replicas that
        acknowledged (``None`` when the script did not succeed). ``WAIT``
        counts the writes of its own connection, so it must follow the
        script on that connection, and never inside MULTI.

        Raises:
            LockBackendError: the client cannot guarantee one connection
                for both (Redis Cluster, client-side caching).
        """

        def run_on(connection: Any) -> tuple[Any, int | None]:
            reply = self._run_on(connection, keys, args)
            if int(reply[0]) != 1:
                return reply, None
            connection.send_command("WAIT", replicas, timeout_ms)
            return reply, int(connection.read_response())

        if _uses_direct_path(client):
            return _on_direct_connection(client, run_on)  # type: ignore[no-any-return]
        if isinstance(client, redis.Redis) and client.connection is not None:
            reply = self(client, keys, args)  # a single-connection client: same connection
            if int(reply[0]) != 1:
                return reply, None
            acked = client.execute_command("WAIT", replicas, timeout_ms)  # type: ignore[no-untyped-call]
            return reply, int(acked)
        raise LockBackendError(
            f"lock_min_replicas needs a plain redis.Redis client, not {type(client).__name__}: "
            "WAIT must run on the connection that took the lock"
        )

    def _run_on(self, connection: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        # connect() first, not the implicit connect of a send: a Sentinel
        # connection resolves the current master only in connect().
        connection.connect()
        body = _bulk_strings((str(len(keys)), *keys, *args), connection.encoder.encoding)
        count = len(keys) + len(args) + 3
        connection.send_packed_command([self._evalsha_head % count + body])
        try:
            return connection.read_response()
        except NoScriptError:
            pass
        script = _bulk_strings((self.source,), "utf-8")
        connection.send_packed_command([b"*%d\r\n$4\r\nEVAL\r\n" % count + script + body])
        return connection.read_response()


def _bulk_strings(values: Sequence[Any], encoding: str) -> bytes:
    """Encode ``values`` as RESP bulk strings (the arguments of a command)."""
    out = []
    for value in values:
        if isinstance(value, str):
            data = value.encode(encoding)
        elif isinstance(value, (int, bytes)):
            data = b"%d" % value if isinstance(value, int) else value
        else:
            raise TypeError(f"cannot send {type(value).__name__} to Redis: {value!r}")
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


_ACQUIRE = _Script(ACQUIRE_SCRIPT)
_RELEASE = _Script(RELEASE_SCRIPT)
_RENEW = _Script(RENEW_SCRIPT)

#: Keys per renewal script call: bounds how long one call blocks Redis.
RENEW_CHUNK_SIZE = 500


def fence_key(key: str) -> str:
    """Return the key of ``key``'s fence counter, in the same Redis Cluster slot.

    A key with a hash tag (``...{tag}...``) keeps it; any other key becomes
    the tag itself (``{key}:fence``), which Redis hashes exactly as ``key``.
    """
    start = key.find("{")
    if start >= 0 and key.find("}", start + 1) > start + 1:
        return f"{key}:fence"
    return f"{{{key}}}:fence"


def release_channel(key: str) -> str:
    """Return the pub/sub channel a release of ``key`` is announced on."""
    return f"{key}:released"


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


@dataclass(frozen=True)
class AcquireResult:
    """The reply of one acquire.

    Attributes:
        acquired: True when the lock is now ours.
        holder: The current holder's raw value when contended.
        ttl_remaining: Seconds left on the holder's lock when contended
            (``None`` when the key has no expiry).
        sent_at: :func:`clock` reading just before the acquire was sent.
        fence: The acquisition's fencing token when acquired (see fencing.py).
    """

    acquired: bool
    holder: str | None = None
    ttl_remaining: float | None = None
    sent_at: float = 0.0
    fence: int | None = None

    @property
    def holder_task_id(self) -> str | None:
        """Task id of the holder, when the holder is a Celery task."""
        if self.holder is None:
            return None
        decoded = LockValue.decode(self.holder)
        if decoded is None or not decoded.owner.task_id:
            return None
        return decoded.owner.task_id


def _text(value: Any, client: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(client.get_encoder().encoding, "replace")
    return str(value)


_SHARED: weakref.WeakKeyDictionary[Any, LockBackend] = weakref.WeakKeyDictionary()
_SHARED_GUARD = threading.Lock()

_DEFAULT_OPTIONS: Mapping[str, Any] = {
    # Bounded, so a hung Redis can never hang a task forever.
    "socket_timeout": 5.0,
    "socket_connect_timeout": 5.0,
    "health_check_interval": 30,
}


def _sentinel_master(url: str, options: Mapping[str, Any]) -> redis.Redis:
    """Build a client that follows the master of a Sentinel-monitored service.

    ``sentinel://[[user]:password@]host:port[,host:port...]/service[/db]``.
    The credentials are the data nodes' (as in ``redis://``); the sentinels'
    own connection settings go in ``redislock_redis_options["sentinel_kwargs"]``.
    Every (re)connect asks the sentinels for the current master, and a
    connection still open to a demoted master is dropped on its first
    ``READONLY`` reply, so the client follows a failover by itself.
    """
    parsed = urlsplit(url)
    path = [part for part in parsed.path.split("/") if part]
    if not path or len(path) > 2:
        raise ValueError("expected sentinel://host:port[,host:port...]/service_name[/db]")
    service, db = path[0], int(path[1]) if len(path) > 1 else 0
    hosts = parsed.netloc.rpartition("@")[2]
    sentinels = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel address {address!r} is not host:port")
        sentinels.append((host, int(port)))
    options = dict(options)
    sentinel_kwargs = options.pop("sentinel_kwargs", None)
    if parsed.username:
        options["username"] = unquote(parsed.username)
    if parsed.password:
        options["password"] = unquote(parsed.password)
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs, **options)  # type: ignore[no-untyped-call]
    master: redis.Redis = sentinel.master_for(service, db=db)  # type: ignore[no-untyped-call]
    return master


class LockBackend:
    """Lock operations against one Redis server (one per app setting).

    Args:
        url: ``redis://`` / ``rediss://`` / ``unix://`` URL of the lock store.
        options: Extra keyword arguments for ``redis.Redis.from_url``; they
            override the package defaults (5 s socket timeouts, 2 quick
            client retries).
        renew_timeout: Socket timeout of the renewer's own connection. The
            renewer never retries inside redis-py; it retries on its next tick
            and counts the lock lost once its validity has run out.
        client: Use this client instead of building one from ``url`` (for
            the standalone lock); the renewer then builds its connection from
            the client's connection pool settings.
        fence_ttl: Seconds a key's fence counter outlives its last
            acquisition (at least the lock's TTL). After that the next fence
            falls back to the server clock in microseconds, still larger.
    """

    def __init__(
        self,
        url: str | None = None,
        options: Mapping[str, Any] | None = None,
        renew_timeout: float = 0.5,
        client: redis.Redis | None = None,
        fence_ttl: float = 3600.0,
    ) -> None:
        if client is None and url is None:
            raise ValueError("LockBackend needs a url or a client")
        self.url = url
        self.options = {**_DEFAULT_OPTIONS, **(options or {})}
        self.renew_timeout = renew_timeout
        self.fence_ttl_ms = int(fence_ttl * 1000)
        self._client = client
        self._client_pid = os.getpid() if client is not None else None
        self._renew_client: redis.Redis | None = None
        self._renew_client_pid: int | None = None
        self._guard = threading.Lock()

    def __repr__(self) -> str:
        return f"<LockBackend {self.describe()}>"

    @classmethod
    def for_client(cls, client: redis.Redis) -> LockBackend:
        """Return the backend shared by every lock on ``client``'s connection pool.

        Sharing it is what lets the renewer serve all of them in one round
        trip per tick.
        """
        # A Redis Cluster client has no single pool: it is its own key.
        pool = getattr(client, "connection_pool", client)
        with _SHARED_GUARD:
            backend = _SHARED.get(pool)
            if backend is None:
                backend = cls(client=client)
                _SHARED[pool] = backend
            return backend

    def describe(self) -> str:
        """Return the server address without credentials, for messages."""
        if self.url is None:
            return "custom client"
        head, _, tail = self.url.rpartition("@")
        scheme = self.url.split("://", 1)[0]
        return f"{scheme}://{tail}" if head else self.url

    # -- clients ---------------------------------------------------------

    @property
    def client(self) -> redis.Redis:
        """The command client; built lazily, and rebuilt in a forked child."""
        if self._client is not None and (self.url is None or self._client_pid == os.getpid()):
            return self._client
        with self._guard:
            if self._client is None or self._client_pid != os.getpid():
                assert self.url is not None
                options = dict(self.options)
                options.setdefault("retry", Retry(ExponentialBackoff(cap=0.2, base=0.01), 2))
                self._client = self._build(self.url, options)
                self._client_pid = os.getpid()
            return self._client

    def warm_up(self) -> None:
        """Open the renewal connection now, so the first renewal is a single round trip."""
        # Best effort only: the first renewal connects anyway if this fails
        # (for instance when the app's clients were closed meanwhile).
        with contextlib.suppress(Exception):
            _connect_direct(self.renewal_client())

    def renewal_client(self) -> redis.Redis:
        """The renewer's (and releases') client: short timeout, no redis-py retries."""
        if self._renew_client is not None and self._renew_client_pid == os.getpid():
            return self._renew_client
        with self._guard:
            options: dict[str, Any]
            if self.url is not None:
                options = dict(self.options)
                url = self.url
            elif isinstance(self._client, RedisCluster):
                # A caller's cluster client cannot be copied with other
                # timeouts pool by pool; the renewer shares it.
                self._renew_client, self._renew_client_pid = self._client, os.getpid()
                return self._client
            else:
                assert self._client is not None
                pool_kwargs = dict(self._client.connection_pool.connection_kwargs)
                options = {k: v for k, v in pool_kwargs.items() if k != "connection_class"}
                options["connection_class"] = self._client.connection_pool.connection_class
                url = None
            options.update(
                socket_timeout=self.renew_timeout,
                socket_connect_timeout=self.renew_timeout,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
            if url is not None:
                client = self._build(url, options)
            else:
                options.pop("retry", None)
                pool = redis.ConnectionPool(**options)
                client = redis.Redis(connection_pool=pool, retry=Retry(NoBackoff(), 0))
            self._renew_client = client
            self._renew_client_pid = os.getpid()
            return client

    @staticmethod
    def _build(url: str, options: Mapping[str, Any]) -> redis.Redis:
        try:
            if url.startswith("sentinel://"):
                return _sentinel_master(url, options)
            if url.startswith(("redis+cluster://", "rediss+cluster://")):
                scheme, rest = url.split("://", 1)
                base = scheme.split("+")[0]
                return RedisCluster.from_url(f"{base}://{rest}", **options)  # type: ignore[return-value]
            return redis.Redis.from_url(url, **options)
        except (ValueError, TypeError) as exc:
            raise LockBackendError(f"cannot use redislock_url {url!r}: {exc}") from exc

    @contextmanager
    def _errors(self, operation: str, key: str) -> Iterator[None]:
        try:
            yield
        except ResponseError as exc:
            detail = str(exc)
            lowered = detail.lower()
            refused = ("noperm", "no permissions", "unknown command", "can't run this command")
            if any(marker in lowered for marker in refused):
                detail += (
                    " (the lock store must allow EVAL/EVALSHA, GET, SET, PEXPIRE, PTTL, DEL, "
                    "TIME and PUBLISH on the lock keys for this user, and SUBSCRIBE for the "
                    "wait policy; see the README's ACL section)"
                )
            raise LockBackendError(
                f"Redis at {self.describe()} refused to {operation} lock {key!r}: {detail}"
            ) from exc
        except RedisError as exc:
            raise LockBackendError(
                f"cannot {operation} lock {key!r}: Redis at {self.describe()} is unavailable "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    # -- operations ------------------------------------------------------

    def acquire(
        self,
        key: str,
        value: str,
        ttl_ms: int,
        adopt: str = "",
        min_replicas: int = 0,
        replicas_timeout: float = 1.0,
    ) -> AcquireResult:
        """Take the lock if free (or already ours, or holding ``adopt``), in one round trip.

        The result's ``sent_at`` is the :func:`clock` reading taken just
        before the command was sent: the lease is valid from then on.

        Args:
            key: Lock key.
            value: Value to store.
            ttl_ms: Time to live in milliseconds.
            adopt: A value this caller may take over (a queued token).
            min_replicas: If > 0, a taken lock must also be acknowledged by
                this many replicas (``WAIT``, a second round trip), or it is
                released again and this raises.
            replicas_timeout: Longest ``WAIT``, in seconds.

        Raises:
            LockBackendError: Redis is unreachable or refused the script, or
                too few replicas acknowledged the lock.
        """
        sent_at = clock()
        keys, args = (key, fence_key(key)), (value, ttl_ms, adopt, self.fence_ttl_ms)
        acked: int | None = None
        with self._errors("acquire", key):
            if min_replicas > 0:
                timeout_ms = max(int(replicas_timeout * 1000), 1)
                reply, acked = _ACQUIRE.call_then_wait(
                    self.client, keys, args, min_replicas, timeout_ms
                )
            else:
                reply = _ACQUIRE(self.client, keys, args)
        if acked is not None and acked < min_replicas:
            self.release(key, value)
            raise LockBackendError(
                f"lock {key!r} was taken but only {acked} of {min_replicas} replica(s) "
                f"acknowledged it within {replicas_timeout}s; released it again "
                "(a failover now could lose it)"
            )
        if int(reply[0]) == 1:
            return AcquireResult(True, sent_at=sent_at, fence=int(reply[1]))
        pttl = int(reply[2])
        return AcquireResult(
            False,
            _text(reply[1], self.client),
            pttl / 1000.0 if pttl >= 0 else None,
            sent_at=sent_at,
        )

    def acquire_waiting(
        self,
        key: str,
        value: str,
        ttl_ms: int,
        timeout: float,
        adopt: str = "",
        min_replicas: int = 0,
        replicas_timeout: float = 1.0,
    ) -> AcquireResult:
        """Take a lock already found held, waiting up to ``timeout`` seconds.

        Callers try :meth:`acquire` first; this subscribes to the key's
        release channel *before* trying again, so a release between the
        failed try and the subscription is never missed. Each wait is also
        capped at the holder's remaining TTL, so a lost message or a holder
        that died costs at most that long.

        Args:
            key: Lock key.
            value: Value to store.
            ttl_ms: Time to live once taken.
            timeout: Longest total wait, in seconds.
            adopt: A value this caller may take over (see :meth:`acquire`).
            min_replicas: See :meth:`acquire`.
            replicas_timeout: See :meth:`acquire`.

        Raises:
            LockBackendError: Redis is unreachable (or too few replicas).
        """
        deadline = time.monotonic() + timeout
        with self._errors("wait for", key):
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call,unused-ignore]
            try:
                pubsub.subscribe(release_channel(key))
                while True:
                    result = self.acquire(key, value, ttl_ms, adopt, min_replicas, replicas_timeout)
                    remaining = deadline - time.monotonic()
                    if result.acquired or remaining <= 0:
                        return result
                    wait = remaining
                    if result.ttl_remaining is not None:
                        wait = min(wait, result.ttl_remaining + 0.005)
                    pubsub.get_message(timeout=max(wait, 0.001))
            finally:
                pubsub.close()

    def release(self, key: str, value: str, keep: str = "", keep_ms: int = 0) -> ReleaseOutcome:
        """Delete the lock if it still holds ``value`` exactly.

        Args:
            key: Lock key.
            value: The holder's value.
            keep: If given, leave this value (for ``keep_ms``) instead of
                deleting: the lock passes to whoever can adopt ``keep``.
            keep_ms: Time to live of ``keep`` in milliseconds.
        """
        return self._release(key, value, "exact", keep, keep_ms)

    def release_owner(
        self, key: str, owner_prefix: str, keep: str = "", keep_ms: int = 0
    ) -> ReleaseOutcome:
        """Delete (or hand over, see :meth:`release`) if the value starts with ``owner_prefix``."""
        return self._release(key, owner_prefix, "prefix", keep, keep_ms)

    def _release(self, key: str, match: str, mode: str, keep: str, keep_ms: int) -> ReleaseOutcome:
        # Releases go over the renewer's connection (short timeout, no
        # redis-py retries), so a frozen Redis delays a finishing task by at
        # most two short attempts; the TTL frees the key if both fail. A
        # second attempt also replaces a pooled connection that died with a
        # Redis restart. Releasing twice is harmless: if the first attempt's
        # reply was lost, "already gone" means it worked.
        args = (match, mode, release_channel(key), keep, max(keep_ms, 1))
        retried = False
        with self._errors("release", key):
            try:
                reply = _RELEASE(self.renewal_client(), (key,), args)
            except (ConnectionError, TimeoutError):
                retried = True
                reply = _RELEASE(self.renewal_client(), (key,), args)
        outcome = ReleaseOutcome(int(reply))
        if retried and outcome is ReleaseOutcome.ALREADY_GONE:
            return ReleaseOutcome.RELEASED
        return outcome

    def extend(self, key: str, value: str, ttl_ms: int) -> RenewOutcome:
        """Reset the lock's TTL to ``ttl_ms`` if it still holds ``value``."""
        with self._errors("extend", key):
            reply = _RENEW(self.client, (key,), (value, ttl_ms))
        return RenewOutcome(int(reply[0]))

    def renew_many(
        self,
        items: Sequence[tuple[str, str, int]],
        client: redis.Redis | RedisCluster | None = None,
    ) -> list[RenewOutcome]:
        """Renew many locks in one round trip (a pipeline of chunked scripts).

        Args:
            items: ``(key, value, ttl_ms)`` for each lock.
            client: Client to use; defaults to :meth:`renewal_client`.

        Raises:
            LockBackendError: the round trip failed; no outcome is known.
        """
        if not items:
            return []
        client = client or self.renewal_client()
        # A script may only touch keys of one slot: on a cluster, one call
        # per slot (and chunk), all in one cluster pipeline, i.e. one round
        # trip per node. Chunks hold indices, so outcomes keep the callers' order.
        groups: list[list[int]] = [list(range(len(items)))]
        if isinstance(client, RedisCluster):
            by_slot: dict[int, list[int]] = {}
            for index, (key, _, _) in enumerate(items):
                by_slot.setdefault(client.keyslot(key), []).append(index)  # type: ignore[no-untyped-call]
            groups = list(by_slot.values())
        chunks = [
            group[start : start + RENEW_CHUNK_SIZE]
            for group in groups
            for start in range(0, len(group), RENEW_CHUNK_SIZE)
        ]
        batches = [[items[i] for i in chunk] for chunk in chunks]
        with self._errors("renew", items[0][0]):
            if len(batches) == 1:
                replies = [_RENEW(client, *self._renew_args(batches[0]))]
            else:
                replies = self._renew_pipelined(client, batches)
        outcomes = [RenewOutcome.GONE] * len(items)
        for chunk, reply in zip(chunks, replies, strict=True):
            for index, status in zip(chunk, reply, strict=True):
                outcomes[index] = RenewOutcome(int(status))
        return outcomes

    @staticmethod
    def _renew_args(chunk: Sequence[tuple[str, str, int]]) -> tuple[list[str], list[Any]]:
        keys = [key for key, _, _ in chunk]
        args: list[Any] = [value for _, value, _ in chunk] + [ttl for _, _, ttl in chunk]
        return keys, args

    def _renew_pipelined(
        self, client: redis.Redis | RedisCluster, chunks: Sequence[Sequence[tuple[str, str, int]]]
    ) -> list[Any]:
        # Plain evalsha in a non-transactional pipeline: redis-py's Script
        # objects would add a SCRIPT EXISTS round trip to every execute().
        pipe = client.pipeline(transaction=False)
        prepared = [self._renew_args(chunk) for chunk in chunks]
        for keys, args in prepared:
            pipe.execute_command("EVALSHA", _RENEW.sha, len(keys), *keys, *args)
        replies = pipe.execute(raise_on_error=False)
        for index, reply in enumerate(replies):
            if isinstance(reply, NoScriptError):
                keys, args = prepared[index]
                replies[index] = client.eval(_RENEW.source, len(keys), *keys, *args)
            elif isinstance(reply, Exception):
                raise reply
        return list(replies)

    def inspect(self, key: str) -> tuple[str | None, float | None]:
        """Return the raw value and remaining TTL (seconds) of ``key``."""
        value, ttl, _ = self.inspect_many([key])[0]
        return value, ttl

    def scan_keys(self, match: str, batch: int = 1000) -> Iterator[list[str]]:
        """Yield batches of keys matching the glob ``match`` (SCAN, never KEYS).

        Fence counters (``...:fence``) are left out. SCAN may return a key
        twice while the keyspace is being resized; callers deduplicate.
        """
        with self._errors("list", match):
            keys: list[str] = []
            # scan_iter walks every node of a Redis Cluster too.
            for found in self.client.scan_iter(match=match, count=batch):
                key = found.decode() if isinstance(found, bytes) else str(found)
                if not key.endswith(":fence"):
                    keys.append(key)
                if len(keys) >= batch:
                    yield keys
                    keys = []
            if keys:
                yield keys

    def inspect_many(
        self, keys: Sequence[str]
    ) -> list[tuple[str | None, float | None, int | None]]:
        """Return ``(value, remaining TTL in s, last fence)`` for each key, in one round trip."""
        if not keys:
            return []
        with self._errors("inspect", keys[0]):
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
                pipe.pttl(key)
                pipe.get(fence_key(key))
            replies = pipe.execute()
        out: list[tuple[str | None, float | None, int | None]] = []
        for index in range(0, len(replies), 3):
            value, pttl, fence = replies[index : index + 3]
            out.append(
                (
                    None if value is None else _text(value, self.client),
                    pttl / 1000.0 if value is not None and pttl >= 0 else None,
                    int(fence) if fence is not None else None,
                )
            )
        return out

    def close(self) -> None:
        """Disconnect this process's clients."""
        for client in (self._client, self._renew_client):
            if client is not None and self.url is not None:
                pool = getattr(client, "connection_pool", None)
                idle = _IDLE.get(pool) if pool is not None else None
                if idle is not None:
                    idle.close()
                client.close()
        if self.url is not None:
            self._client = None
        self._renew_client = None
