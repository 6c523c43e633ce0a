"""The lock store for ``redis.asyncio``: the same scripts, keys and values, awaited.

The asyncio counterpart of :mod:`celery_redislock.store`, used by
:class:`~celery_redislock.aiolock.AsyncRedisLock`. It runs the very scripts of
:mod:`celery_redislock.scripts` (same SHA1s), on the same keys, with values in
the format of :mod:`celery_redislock.tokens`: a sync and an async lock of the
same name exclude each other. What it sends and what a reply means are
``protocol.py``'s, shared with the sync store; its connections are
``aiotransport.py``'s.

A single server only (``redis://``, ``rediss://``, ``unix://``): an asyncio cluster or
Sentinel client is refused with a clear error.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis.asyncio
import redis.asyncio.sentinel
from redis.exceptions import ConnectionError, RedisError, ResponseError, TimeoutError

from celery_redislock import scripts
from celery_redislock._clock import clock
from celery_redislock.aiotransport import (
    AsyncEndpoint,
    AsyncSubscription,
    Exchange,
    endpoints,
    script_exchange,
    script_many_exchange,
    send_and_read,
)
from celery_redislock.exceptions import ConfigurationError
from celery_redislock.key_family import family_of
from celery_redislock.outcomes import (
    AcquireResult,
    ReleaseOutcome,
    RenewOutcome,
    held_by,
    release_wait,
)
from celery_redislock.protocol import (
    TAKE_OVER,
    ReleaseAttempts,
    RenewItem,
    accepted,
    after_native_release,
    after_retry,
    after_set_nx_get,
    backend_error,
    check_lock_value,
    decode_text,
    hand_off,
    native_release,
    release_call,
    renew_call,
    renew_chunks,
    set_nx_get,
    unsupported,
)
from celery_redislock.tokens import without_mark

__all__ = ["AsyncEndpoint", "AsyncLockStore", "AsyncSubscription"]

#: How long a key handed to a parked execution is held for it (as LockStore's).
HANDOFF_TTL_MS = 30_000

#: Times one wait subscribes again after its subscription dropped.
_RESUBSCRIPTIONS = 3


# Stores shared by every AsyncRedisLock on one client, keyed weakly by its pool.
_SHARED: weakref.WeakKeyDictionary[Any, AsyncLockStore] = weakref.WeakKeyDictionary()
_SHARED_GUARD = threading.Lock()


class AsyncLockStore:
    """Lock operations against one Redis server, for ``redis.asyncio`` clients.

    Three sets of connections, as in the sync store: ``commands`` (acquire,
    extend; the client's timeouts, two retries), ``releases`` (the renewal
    timeout, one retry) and ``renewals`` (the loop's renewer task only; the
    renewal timeout, no retry).

    Args:
        client: A ``redis.asyncio.Redis`` client (single server). The store
            keeps no reference to it.
        renew_timeout: Socket timeout of the renewal and release connections.
        fence_ttl: Seconds a key's fence counter is kept after the lock (0:
            it goes with the lock; see :class:`LockStore`).

    Raises:
        ConfigurationError: ``client`` is not a single-server
            ``redis.asyncio.Redis`` (a cluster or Sentinel client).
    """

    def __init__(
        self, client: redis.asyncio.Redis, renew_timeout: float = 0.5, fence_ttl: float = 0.0
    ) -> None:
        pool = getattr(client, "connection_pool", None)
        if not isinstance(client, redis.asyncio.Redis) or pool is None:
            raise ConfigurationError(
                f"AsyncRedisLock needs a redis.asyncio.Redis client, got {type(client).__name__}"
            )
        if isinstance(pool, redis.asyncio.sentinel.SentinelConnectionPool):
            raise ConfigurationError(
                "AsyncRedisLock supports a single Redis server (redis://, rediss://, unix://), "
                "not an asyncio Sentinel client; use the sync RedisLock for Sentinel"
            )
        self.renew_timeout = renew_timeout
        self.fence_ttl_ms = int(fence_ttl * 1000)
        #: The server takes ``SET NX GET`` (cleared at its first "syntax error").
        self._set_nx_get = True
        #: The server takes ``DELIFEQ`` (Valkey >= 9; cleared at its first refusal).
        self._native_release = True
        self.where, self.commands, self.releases, self.renewals = endpoints(pool, renew_timeout)

    def __repr__(self) -> str:
        return f"<AsyncLockStore {self.where}>"

    @classmethod
    def for_client(cls, client: redis.asyncio.Redis) -> AsyncLockStore:
        """Return the store shared by every lock on ``client``'s connection pool.

        Sharing it is what lets a loop's renewer task serve all of them in
        one round trip per tick.
        """
        pool = getattr(client, "connection_pool", None)
        if pool is None:
            return cls(client)  # raises the clear error
        store = _SHARED.get(pool)
        if store is None:
            with _SHARED_GUARD:
                store = _SHARED.get(pool)
                if store is None:
                    store = _SHARED[pool] = cls(client)
        return store

    @contextlib.asynccontextmanager
    async def _errors(self, operation: str, key: str) -> AsyncIterator[None]:
        try:
            yield
        except RedisError as exc:
            raise backend_error(exc, operation, key, self.where) from exc

    # -- operations ------------------------------------------------------

    async def acquire(
        self, key: str, value: str, ttl_ms: int, adopt: Sequence[str] = (), waiting: bool = False
    ) -> AcquireResult:
        """Take the lock if free, already ours, or holding a value in ``adopt``.

        One round trip, ``SET NX PX GET``; see :meth:`LockStore.acquire`
        (``waiting``: mark the holder found, one ``EVALSHA``).

        Raises:
            LockBackendError: Redis is unreachable or refused the script.
        """
        check_lock_value(value, ttl_ms)
        sent_at = clock()
        async with self._errors("acquire", key):
            reply = await (
                self.do_acquire(key, value, ttl_ms, adopt, waiting)
                if waiting
                else self.do_acquire(key, value, ttl_ms, adopt)
            )
        if int(reply[0]) == 1:
            return AcquireResult(True, sent_at=sent_at)
        # A contended SET NX GET says who holds the key, not for how long:
        # read with holder_ttl() where it is needed (blocking waits do).
        return held_by(reply, sent_at, self.commands.encoding)

    async def holder_ttl(self, key: str) -> float | None:
        """Seconds left on ``key``'s lock (``None``: gone, or no expiry). One round trip."""
        async with self._errors("inspect", key):
            pttl = int(await self.commands.call("PTTL", key))
        return pttl / 1000.0 if pttl >= 0 else None

    async def fence(self, key: str, value: str) -> int | None:
        """Issue a fence to the holder of ``value``; see :meth:`LockStore.fence`."""
        keys, args = (key, family_of(key).fence), (value, self.fence_ttl_ms)
        async with self._errors("fence", key):
            reply = await self.commands.run(
                script_exchange(scripts.FENCE, keys, args, self.commands.encoding)
            )
        return int(reply[1]) if int(reply[0]) == 1 else None

    async def acquire_waiting(
        self, key: str, value: str, ttl_ms: int, timeout: float, adopt: Sequence[str] = ()
    ) -> AcquireResult:
        """Take a lock already found held, waiting up to ``timeout`` seconds.

        Subscribes to the key's release channel *before* trying again (a
        release in between is never missed); each wait is capped at the
        holder's remaining TTL (a lost message or a dead holder costs at most
        that). Woken by the release, never by polling.

        Raises:
            LockBackendError: Redis is unreachable.
        """
        deadline = clock() + timeout
        dropped = 0
        async with self._errors("wait for", key):
            while True:
                subscribed = False
                try:
                    async with AsyncSubscription(self.commands, family_of(key).channel) as sub:
                        subscribed = True
                        while True:
                            result = await self.acquire(key, value, ttl_ms, adopt, waiting=True)
                            wait = release_wait(result, deadline)
                            if wait is None:
                                return result
                            if not await sub.wait(wait):
                                break  # timed out: subscribe again, then try again
                except (ConnectionError, TimeoutError):
                    dropped += 1
                    if not subscribed or dropped > _RESUBSCRIPTIONS:
                        raise

    async def release(
        self, key: str, value: str, fenced: bool = False, resent: bool = False
    ) -> ReleaseOutcome:
        """Delete the lock if it still holds ``value`` exactly (and wake the waiters).

        ``fenced``: the holder read a fence, whose counter is settled (True
        from a caller that releases for another holder). ``resent``: sent
        again after an exception cut off the same release's reply.
        """
        check_lock_value(value)
        async with self._errors("release", key):
            # Passed only when set: an override of do_release(key, value) still works.
            flags = (
                accepted(type(self).do_release, fenced=fenced, resent=resent)
                if fenced or resent
                else {}
            )
            reply = await self.do_release(key, value, **flags)
            if resent and "resent" not in flags:  # an override that predates it
                reply = after_retry(key, reply)
            return ReleaseOutcome(reply)

    async def extend(self, key: str, value: str, ttl_ms: int, fenced: bool = False) -> RenewOutcome:
        """Reset the TTL to ``ttl_ms`` if the key holds ``value`` (``fenced``: the fence's too)."""
        async with self._errors("extend", key):
            # Passed only when set: an override of do_extend(key, value, ttl_ms) still works.
            flags = accepted(type(self).do_extend, fenced=fenced)
            return RenewOutcome(await self.do_extend(key, value, ttl_ms, **flags))

    async def renew_many(self, items: Sequence[RenewItem]) -> list[RenewOutcome]:
        """Renew many locks in one pipelined round trip (the loop's renewer task only).

        Raises:
            LockBackendError: the round trip failed; no outcome is known.
        """
        if not items:
            return []
        async with self._errors("renew", items[0][0]):
            return [RenewOutcome(status) for status in await self.do_renew(items)]

    async def inspect(self, key: str) -> tuple[str | None, float | None]:
        """Return the raw value and remaining TTL (seconds) of ``key``."""
        async with self._errors("inspect", key):
            value = await self.commands.call("GET", key)
            pttl = await self.commands.call("PTTL", key)
        if value is None:
            return None, None
        text = without_mark(decode_text(value, self.commands.encoding))
        return text, (pttl / 1000 if pttl >= 0 else None)

    async def aclose(self) -> None:
        """Disconnect the running loop's idle connections."""
        for endpoint in (self.commands, self.releases, self.renewals):
            await endpoint.close()

    # -- override points (as LockStore's: one script, its raw reply) ------

    async def do_acquire(
        self, key: str, value: str, ttl_ms: int, adopt: Sequence[str], waiting: bool = False
    ) -> Any:
        """Take the key as :meth:`LockStore.do_acquire` does; return the reply."""
        encoding = self.commands.encoding
        args = (value, ttl_ms, *adopt)
        scripted = script_exchange(
            scripts.WAIT_TRY if waiting else scripts.ACQUIRE, (key,), args, encoding
        )
        packed = b""
        if not waiting and self._set_nx_get:
            packed = set_nx_get(key, value, ttl_ms, encoding)

        async def run(connection: Any) -> Any:
            reply = TAKE_OVER
            if packed:
                (found,) = await send_and_read(connection, packed, 1)
                if unsupported(found):
                    self._set_nx_get = False  # Redis < 7: NX and GET not together
                else:
                    reply = after_set_nx_get(found, (value, *adopt), encoding)
            if reply is TAKE_OVER:
                reply = await scripted(connection)
            return reply

        return await self.commands.run(run)

    async def do_release(
        self, key: str, value: str, fenced: bool = False, resent: bool = False
    ) -> int:
        """Release as :meth:`LockStore.do_release` does; return its reply (1, 0 or -1).

        A lost reply (or ``resent``) makes the next attempt a retry, as there.
        A key handed to a task call parked on it (``HandOff`` on the same key
        name) is reported as 1: this store cannot publish the call's message,
        a worker's sweep hands it the key again once the hand-over expires.
        """
        encoding = self.releases.encoding
        attempts = ReleaseAttempts(key, resent)

        def full(retry: bool) -> Exchange[Any]:
            keys, args = release_call(
                key, value, "exact", "", 1, HANDOFF_TTL_MS, self.fence_ttl_ms, retry
            )
            return script_exchange(scripts.RELEASE_FULL, keys, args, encoding)

        lean = None if fenced else script_exchange(scripts.RELEASE, (key,), (value,), encoding)

        async def plain(connection: Any, script: Exchange[Any]) -> Any:
            if self._native_release:
                native = native_release(key, value, encoding)
                deleted = after_native_release((await send_and_read(connection, native, 1))[0])
                if deleted:
                    return 1
                if deleted is None:
                    self._native_release = False  # refused: the scripts from now on
                else:
                    attempts.answered()  # nothing deleted, and known (as LockStore's)
            reply = await script(connection)
            if reply == 2:  # someone waits behind us: wake them
                attempts.answered()  # read, and it deleted nothing
                attempts.start()  # the full release may run: its reply matters
                reply = await full(False)(connection)
            return reply

        async def attempt(connection: Any) -> Any:
            retry = attempts.start()
            try:
                if retry or lean is None:
                    reply = await full(retry)(connection)
                else:
                    reply = await plain(connection, lean)
            except ResponseError:
                attempts.refused()  # a refusal: nothing ran
                raise
            attempts.answered()
            return reply

        reply = attempts.outcome(await self.releases.run(attempt))
        if isinstance(reply, list):
            hand_off(None, key, reply)  # no publisher here: logged
            return 1
        return int(reply)

    async def do_extend(self, key: str, value: str, ttl_ms: int, fenced: bool = False) -> int:
        """Run ``RENEW_SCRIPT`` for one key (and its fence counter); return its status."""
        keys, args = renew_call(((key, value, ttl_ms, fenced),), self.fence_ttl_ms)
        reply = await self.commands.run(
            script_exchange(scripts.RENEW, keys, args, self.commands.encoding)
        )
        return int(reply[0])

    async def do_renew(self, items: Sequence[RenewItem]) -> list[int]:
        """Run ``RENEW_SCRIPT`` over many keys, chunked, in one pipelined round trip."""
        calls = renew_chunks(items, self.fence_ttl_ms)
        replies = await self.renewals.run(
            script_many_exchange(scripts.RENEW, calls, self.renewals.encoding)
        )
        return [int(status) for reply in replies for status in reply]
