"""The lock store: acquire, release, renew and inspect, their outcomes, one transport.

Every lock operation is one round trip over :mod:`celery_redislock.transport`:
``SET NX PX GET`` to take a free key, a single ``EVALSHA`` otherwise, or one
pipeline of them for batched renewal. :class:`LockStore` is one class per
job, each in its module (``store_connections``, ``store_release``,
``store_acquire``, ``store_slots``, ``store_parking``), and here the store
shared per client, the start-up check and inspection. It re-exports the
result types (``outcomes``) and the call builders (``protocol``).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from celery_redislock import scripts
from celery_redislock.exceptions import ConfigurationError, LockBackendError, LockStoreRefused
from celery_redislock.key_family import NOT_LOCK_SUFFIXES, family_of
from celery_redislock.outcomes import AcquireResult, ParkResult, ReleaseOutcome, RenewOutcome
from celery_redislock.protocol import (
    RENEW_CHUNK_SIZE,
    RenewItem,
    backend_error,
    decode_text,
    release_call,
    renew_call,
)
from celery_redislock.store_connections import (
    StoreConnections,
    _command_runner,
    _Kind,
    _script_runner,
)
from celery_redislock.store_parking import LockParking
from celery_redislock.tokens import without_mark
from celery_redislock.transport import Topology

__all__ = [
    "RENEW_CHUNK_SIZE",
    "AcquireResult",
    "LockStore",
    "ParkResult",
    "ReleaseOutcome",
    "RenewItem",
    "RenewOutcome",
    "StoreConnections",
    "backend_error",
    "decode_text",
    "release_call",
    "renew_call",
]

# The logger keeps the name the docs document (the module was backend.py).
logger = logging.getLogger("celery_redislock.backend")

#: Suffixes of the keys kept beside a lock that are not locks themselves.
_NOT_LOCKS = tuple(f":{suffix}" for suffix in NOT_LOCK_SUFFIXES)


def _not_a_string(reply: Any) -> Any:
    """A ``WRONGTYPE`` reply to ``GET`` as ``None``: a key of another type is no lock.

    Someone else's list or hash under the prefix must not stop a listing
    (``celery redislock ls``) or a worker's start-up recovery.
    """
    if isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE"):
        return None
    return reply


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


def _is_cluster(client: Any) -> bool:
    """Whether ``client`` is a ``RedisCluster``, known once per client class.

    ``RedisCluster``'s metaclass is a ``Protocol``'s: an ``isinstance`` costs
    1.1 µs, paid by every standalone lock built (measured); a dict look-up
    by class, 0.1 µs.
    """
    kind = type(client)
    cluster = _CLUSTER_CLASSES.get(kind)
    if cluster is None:
        cluster = isinstance(client, RedisCluster)
        if client.__class__ is kind:  # not a proxy, which may wrap either kind
            _CLUSTER_CLASSES[kind] = cluster
    return cluster


_CLUSTER_CLASSES: dict[type, bool] = {}


class LockStore(LockParking):
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

    # -- override points -------------------------------------------------
    #
    # The do_* methods (do_acquire, do_acquire_slot, do_release,
    # do_release_slots, do_extend, do_renew, do_park, do_script), inherited
    # from the job classes below, each run one script over the transport and
    # return its raw reply; the public methods map errors and build the
    # outcome types. Override them in a subclass (as redis-py's
    # ``Lock.do_acquire``) to add instrumentation or a different script, and
    # pass an instance as ``RedisLock(store=...)`` or the class as
    # ``redislock_store_class``.

    @classmethod
    def for_client(cls, client: redis.Redis | RedisCluster) -> LockStore:
        """Return the backend shared by every lock on ``client``'s connection pool.

        Sharing it is what lets the renewer serve all of them in one round
        trip per tick. It lives as long as the pool does, and no longer.
        """
        pool = client if _is_cluster(client) else getattr(client, "connection_pool", None)
        backend = None if pool is None else _SHARED.get(pool)
        if backend is None:
            if pool is None or not (pool is client or isinstance(client, redis.Redis)):
                # An asyncio client "acquired" nothing, silently (review helper-54 F3).
                raise ConfigurationError(
                    "RedisLock needs a redis.Redis or RedisCluster client (AsyncRedisLock "
                    f"takes redis.asyncio's), got {type(client).__module__}."
                    f"{type(client).__name__}"
                )
            with _SHARED_GUARD:
                backend = _SHARED.get(pool)
                if backend is None:
                    backend = cls(client=client)
                    _SHARED[pool] = backend
        return backend

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
            if "db index is out of range" in str(exc).lower():  # SELECT, at connect
                raise LockStoreRefused(
                    f"Redis at {self.describe()} has no such database ({exc}; the server's "
                    "`databases` setting says how many it has)"
                ) from exc
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

    def keep_record(self, key: str, value: str, ttl_ms: int) -> None:
        """Keep ``value`` at ``key`` for ``ttl_ms`` (a record beside the locks: ``SET PX``)."""
        with self._errors("keep a record at", key):
            command = _command_runner("SET", key, value, "PX", max(int(ttl_ms), 1))
            self._topology(_Kind.COMMANDS).run_for_key(key, command)

    def read_record(self, key: str) -> str | None:
        """The record at ``key`` (``None``: none): one ``GET``."""
        with self._errors("read the record at", key):
            reply = self._topology(_Kind.COMMANDS).run_for_key(key, _command_runner("GET", key))
        return None if reply is None else decode_text(reply, self.encoding_for(key))

    def delete_record(self, key: str) -> None:
        """Delete the record at ``key``: one ``DEL``."""
        with self._errors("delete the record at", key):
            self._topology(_Kind.COMMANDS).run_for_key(key, _command_runner("DEL", key))

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
                    commands += [("GET", key), ("PTTL", key), ("GET", family_of(key).fence)]
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
