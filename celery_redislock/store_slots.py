"""A lock with several holders (``lock_limit`` slots), and blocking waits for a release."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ConnectionError, TimeoutError

from celery_redislock import scripts, slot_scripts
from celery_redislock._clock import clock
from celery_redislock.key_family import family_of
from celery_redislock.outcomes import AcquireResult, held_by, release_wait
from celery_redislock.store_acquire import LockAcquire
from celery_redislock.store_connections import _Kind, _script_runner
from celery_redislock.transport import Endpoint, Script, Subscription, pack_command

__all__ = ["LockSlotsAndWaits"]

#: Times one wait subscribes again after its subscription dropped.
_RESUBSCRIPTIONS = 3


class LockSlotsAndWaits(LockAcquire):
    """Take one of a key's slots; wait (woken by the release) for a held key."""

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
            taken = family_of(key).slots(limit)[int(reply[1]) - 1]
            self._check_replicas(taken, value, acked, min_replicas, replicas_timeout)
            return AcquireResult(True, sent_at=sent_at, key=taken)
        return held_by(reply, sent_at, self._topology(_Kind.COMMANDS).endpoint_for(key).encoding)

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
        keys = family_of(key).slots(limit)
        args = (value, ttl_ms, "1" if waiting else "", task_prefix, *adopt)
        topology, timeout_ms = self._for_replicas(min_replicas, replicas_timeout)
        if timeout_ms:
            return topology.run_for_key(
                key,
                lambda endpoint: _then_wait(
                    endpoint, keys, args, min_replicas, timeout_ms, slot_scripts.ACQUIRE_SLOT
                ),
            )
        reply = topology.run_for_key(
            key,
            lambda endpoint: slot_scripts.ACQUIRE_SLOT.exchange(keys, args, endpoint.encoding),
        )
        return reply, None

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
        take: Callable[..., AcquireResult] = (
            functools.partial(self.acquire_slot, key, limit, value, ttl_ms, adopt, task_prefix)
            if limit > 1
            else functools.partial(self.acquire, key, value, ttl_ms, adopt)
        )
        dropped = 0
        with self._errors("wait for", key):
            while True:
                subscribed = False
                try:
                    with Subscription(endpoint, family_of(key).channel) as sub:
                        subscribed = True
                        while True:
                            result = take(min_replicas, replicas_timeout, waiting=True)
                            wait = release_wait(result, deadline)
                            if wait is None:
                                return result
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
        family = family_of(key)
        watch = (scripts.WATCH, family.slots(limit), (owner_prefix,))
        with self._errors("wait for", key), Subscription(endpoint, family.channel) as sub:
            while True:
                # Marks the value waited for: its release then publishes.
                if not int(endpoint.run(_script_runner(watch)(endpoint))):
                    return True
                remaining = deadline - clock()
                if remaining <= 0:
                    return False
                sub.wait(remaining)


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
