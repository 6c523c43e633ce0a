"""Taking and keeping a lock: acquire, fence, extend and the renewer's batched renewal."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import (
    AskError,
    ConnectionError,
    MovedError,
    RedisError,
    ResponseError,
    TimeoutError,
)

from celery_redislock import scripts
from celery_redislock._clock import clock
from celery_redislock.key_family import family_of
from celery_redislock.outcomes import AcquireResult, RenewOutcome, held_by
from celery_redislock.protocol import (
    RENEW_CHUNK_SIZE,
    TAKE_OVER,
    RenewItem,
    accepted,
    after_set_nx_get,
    backend_error,
    check_lock_value,
    renew_call,
    set_nx_get,
    unsupported,
)
from celery_redislock.store_connections import _command_runner, _Kind, _script_runner
from celery_redislock.store_release import LockRelease
from celery_redislock.transport import Endpoint, Topology, pack_command, send_and_read

__all__ = ["LockAcquire"]


class LockAcquire(LockRelease):
    """Take a lock in one round trip, issue its fence, extend and renew it."""

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
        check_lock_value(value, ttl_ms)
        sent_at = clock()
        # try/except, not the _errors() context manager, on the two hot paths
        # (measured: 1.1 µs per call for the generator-based manager).
        try:
            # The fast lane does what do_acquire would: not when it is
            # overridden (a subclass, a patch of the class or of this store).
            own = getattr(self.do_acquire, "__func__", None) is LockAcquire.do_acquire
            if own and not (adopt or min_replicas or waiting):
                taken = self._take_free(key, value, ttl_ms)
                if taken is not None:
                    return self._acquire_result(key, taken, sent_at)
            call = (key, value, ttl_ms, adopt, min_replicas, replicas_timeout)
            reply, acked = self.do_acquire(*call, waiting) if waiting else self.do_acquire(*call)
        except RedisError as exc:
            raise backend_error(exc, "acquire", key, self.describe()) from exc
        self._check_replicas(key, value, acked, min_replicas, replicas_timeout)
        return self._acquire_result(key, reply, sent_at)

    def _take_free(self, key: str, value: str, ttl_ms: int) -> Any:
        """The plain acquire on one server, ``do_acquire``'s first step written out.

        One ``SET NX PX GET`` through :meth:`Endpoint.round_trip`: no
        closures per call (measured with ``bench.layers``: the store's
        layers cost more than half the client CPU of a bare round trip).

        Returns:
            The reply as ``do_acquire`` gives it, or ``None`` when the key
            holds our own value (a first attempt's reply was lost and the
            exchange retried), on a cluster, or on a server without ``SET NX
            GET``: :meth:`do_acquire` then takes it (over).
        """
        topology = self._topology(_Kind.COMMANDS)
        if not self._set_nx_get or type(topology) is not Topology:
            return None
        endpoint = topology.endpoint
        found = endpoint.round_trip(set_nx_get(key, value, ttl_ms, endpoint.encoding))
        if unsupported(found):
            self._set_nx_get = False  # Redis < 7: NX and GET not together
            return None
        reply = after_set_nx_get(found, (value,), endpoint.encoding)
        return None if reply is TAKE_OVER else reply

    def _acquire_result(self, key: str, reply: Any, sent_at: float) -> AcquireResult:
        if int(reply[0]) == 1:
            return AcquireResult(True, sent_at=sent_at)
        encoding = self._topology(_Kind.COMMANDS).endpoint_for(key).encoding
        # SET NX GET: the holder, not its TTL (read on demand).
        return held_by(reply, sent_at, encoding, lambda: self.holder_ttl(key))

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
        call = (scripts.FENCE, (key, family_of(key).fence), (value, self.fence_ttl_ms))
        with self._errors("fence", key):
            reply = self._topology(_Kind.COMMANDS).run_for_key(key, _script_runner(call))
        return int(reply[1]) if int(reply[0]) == 1 else None

    def extend(self, key: str, value: str, ttl_ms: int, fenced: bool = False) -> RenewOutcome:
        """Reset the lock's TTL to ``ttl_ms`` if it still holds ``value``.

        ``fenced``: the holder read a fence; its counter is renewed with it.
        """
        with self._errors("extend", key):
            # Passed only when set: an override of do_extend(key, value, ttl_ms) still works.
            flags = accepted(type(self).do_extend, fenced=fenced)
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
        topology, timeout_ms = self._for_replicas(min_replicas, replicas_timeout)
        script = scripts.WAIT_TRY if waiting else scripts.ACQUIRE
        args = (value, ttl_ms, *adopt)
        own = (value, *adopt)
        set_nx = not waiting and self._set_nx_get

        def make(endpoint: Endpoint) -> Callable[[Any], tuple[Any, int | None]]:
            encoding = endpoint.encoding
            # Packed now only when it is what is sent first (every argument
            # checked before anything is sent); after a SET NX GET, only when
            # the key must be taken over (a free key never runs the script).
            scripted = None if set_nx else script.exchange((key,), args, encoding)
            packed = set_nx_get(key, value, ttl_ms, encoding) if set_nx else b""
            if packed and adopt:
                pack_command(tuple(adopt), encoding)  # a TypeError for a bad one, before sending

            def run(connection: Any) -> tuple[Any, int | None]:
                reply = TAKE_OVER
                if packed:
                    (found,) = send_and_read(connection, packed, 1)
                    if unsupported(found):
                        self._set_nx_get = False  # Redis < 7: NX and GET not together
                    else:
                        reply = after_set_nx_get(found, own, encoding)
                if reply is TAKE_OVER:
                    reply = (scripted or script.exchange((key,), args, encoding))(connection)
                if timeout_ms and int(reply[0]) == 1:
                    wait = pack_command(("WAIT", min_replicas, timeout_ms), encoding)
                    (acked,) = send_and_read(connection, wait, 1)
                    if isinstance(acked, ResponseError):
                        raise acked
                    return reply, int(acked)
                return reply, None

            return run

        return topology.run_for_key(key, make)

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
            try:
                replies = scripts.RENEW.many(endpoint, calls)
            except (MovedError, AskError, ConnectionError, TimeoutError):
                # A resharding moved a slot, or the node failed (a failover may
                # have promoted its replica): each chunk (keys of one slot)
                # follows its redirection or the map read again. Renewing
                # again is harmless (a compare, then PEXPIRE).
                replies = [
                    topology.run_for_key(keys[0], _script_runner((scripts.RENEW, keys, args)))
                    for keys, args in calls
                ]
            for chunk, reply in zip(chunks, replies, strict=True):
                for index, status in zip(chunk, reply, strict=True):
                    statuses[index] = int(status)
        return statuses
