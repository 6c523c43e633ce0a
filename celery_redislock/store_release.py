"""Releasing a lock (or a slot): compare-and-delete, or a hand-over to a parked execution."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from celery_redislock import scripts, slot_scripts
from celery_redislock.exceptions import LockBackendError
from celery_redislock.key_family import family_of
from celery_redislock.outcomes import RELEASE_OUTCOMES, ReleaseOutcome
from celery_redislock.protocol import (
    KEPT_WAITED,
    ReleaseAttempts,
    accepted,
    after_native_release,
    after_retry,
    backend_error,
    check_lock_value,
    hand_off,
    kept_waited,
    native_release,
    release_call,
)
from celery_redislock.store_connections import StoreConnections, _attempt, _Kind
from celery_redislock.transport import Endpoint, Topology, send_and_read

__all__ = ["LockRelease"]


class LockRelease(StoreConnections):
    """Release a lock (or a slot of one), and publish a hand-over it made."""

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
        check_lock_value(value)
        return self._release(key, value, "exact", keep, keep_ms, fenced, resent)

    def release_owner(
        self, key: str, owner_prefix: str, keep: str = "", keep_ms: int = 0
    ) -> ReleaseOutcome:
        """Delete (or hand over, see :meth:`release`) if the value starts with ``owner_prefix``."""
        return self._release(key, owner_prefix, "prefix", keep, keep_ms)

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
            hand_off(self.on_handoff, key, reply)
            return ReleaseOutcome.RELEASED
        return ReleaseOutcome(max(min(reply, 1), -1))

    def _check_replicas(
        self, key: str, value: str, acked: int | None, min_replicas: int, replicas_timeout: float
    ) -> None:
        """Release a lock too few replicas acknowledged (``acked``), and raise."""
        if acked is not None and acked < min_replicas:
            self.release(key, value)
            raise LockBackendError(
                f"lock {key!r} was taken but only {acked} of {min_replicas} replica(s) "
                f"acknowledged it within {replicas_timeout}s; released it again "
                "(a failover now could lose it)"
            )

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
        flags = (
            accepted(type(self).do_release, settle=fenced, resent=resent)
            if fenced or resent
            else {}
        )
        try:
            reply = self.do_release(key, match, mode, keep, keep_ms, **flags)
            if resent and "resent" not in flags:  # an override that predates it
                reply = after_retry(key, reply)
        except RedisError as exc:
            raise backend_error(exc, "release", key, self.describe()) from exc
        if isinstance(reply, list):
            hand_off(self.on_handoff, key, reply)
            return ReleaseOutcome.RELEASED
        if reply == KEPT_WAITED:
            kept_waited(self.on_kept_waited, key, keep_ms)
            return ReleaseOutcome.RELEASED
        return RELEASE_OUTCOMES.get(reply) or ReleaseOutcome(reply)

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

        A plain release (the exact value, nothing kept, no fence read) is
        ``DELIFEQ`` where the server has it (Valkey >= 9: no script), else
        the lean script: ``GET``, compare, ``DEL``. If the value is marked
        waited for, or the release keeps a value, goes by owner prefix or
        must settle a fence counter (``settle``), the full one runs (the lean
        one first, when it could not know: a second round trip, paid by the
        releases someone waits for).

        Releases have connections of their own (short timeout, one retry), so
        a frozen Redis delays a finishing task by at most two short attempts
        (two more when a kept value has calls behind it and the store stalls
        again just after answering: the sweep is told when the window ends);
        the TTL frees the key if both fail. An attempt whose reply was lost
        (or ``resent``: the caller sends the release again after an exception
        cut off the first one's reply) is followed by a retry: see
        :class:`~celery_redislock.protocol.ReleaseAttempts`.

        Returns:
            1, 0, -1, 3 (``keep`` was left, and a parked call or a waiter
            had marked the key: :meth:`_release` tells ``on_kept_waited``),
            or ``[1, hand-off value, message]`` (see ``RELEASE_FULL_SCRIPT``).
        """
        attempts = ReleaseAttempts(key, resent)
        lean = mode == "exact" and not keep and not settle
        exchange = _ReleaseExchange(self, attempts, (key, match, mode, keep, keep_ms), lean)
        topology = self._topology(_Kind.RELEASES)
        if type(topology) is Topology:  # one server: no routing (the hot path)
            return attempts.outcome(topology.endpoint.run(exchange.on(topology.endpoint)))
        return attempts.outcome(topology.run_for_key(key, exchange.on))

    def do_release_slots(self, key: str, limit: int, match: str, mode: str) -> Any:
        """Run ``RELEASE_SLOTS_SCRIPT``; return its reply (slot number, 0, -1 or a hand-off).

        On the releases' connections (short timeout, one retry), as
        :meth:`do_release`. After a lost reply the retry (``ARGV[6]``)
        returns a hand-over the first attempt made, and "no slot held it,
        one is free" is reported as released (1), as :meth:`do_release` does.
        """
        family = family_of(key)
        waiters, parked, _ = family.handoff
        keys = (*family.slots(limit), waiters, parked, family.fence)
        args = (match, mode, family.channel, self.handoff_ttl_ms, self.fence_ttl_ms)
        attempts = ReleaseAttempts(key)

        def make(endpoint: Endpoint) -> Callable[[Any], Any]:
            encoding = endpoint.encoding
            first = slot_scripts.RELEASE_SLOTS.exchange(keys, args, encoding)
            again = slot_scripts.RELEASE_SLOTS.exchange(keys, (*args, "1"), encoding)
            return lambda connection: _attempt(
                attempts, connection, lambda retry: again if retry else first
            )

        return attempts.outcome(self._topology(_Kind.RELEASES).run_for_key(key, make))


class _ReleaseExchange:
    """One release's exchange, for :meth:`Endpoint.run`: each call is one attempt.

    The lean script first (``DELIFEQ`` before it where the server has it),
    the full one when someone waits, and the full one as a retry after an
    attempt whose reply was lost (see :class:`ReleaseAttempts`). One object
    rather than a closure per step: a release is on every task's hot path
    (measured with ``bench.layers``).
    """

    __slots__ = ("attempts", "call", "encoding", "first", "lean", "store")

    def __init__(
        self,
        store: LockRelease,
        attempts: ReleaseAttempts,
        call: tuple[str, str, str, str, int],
        lean: bool,
    ) -> None:
        self.store, self.attempts, self.call, self.lean = store, attempts, call, lean
        self.encoding = "utf-8"
        self.first: Callable[[Any], Any] | None = None

    def on(self, endpoint: Endpoint) -> _ReleaseExchange:
        """This exchange for ``endpoint`` (its encoding; the lean script packed now).

        Packed before anything is sent unless ``DELIFEQ`` goes first (it
        checks the same arguments): on Valkey the script is needed only when
        ``DELIFEQ`` deleted nothing.
        """
        self.encoding = endpoint.encoding
        key, match = self.call[0], self.call[1]
        if self.lean and not self.store._native_release:
            self.first = scripts.RELEASE.exchange((key,), (match,), self.encoding)
        return self

    def __call__(self, connection: Any) -> Any:
        return _attempt(self.attempts, connection, self._step)

    def _step(self, retry: bool) -> Callable[[Any], Any]:
        """The exchange of one attempt (``retry``: after one whose reply was lost)."""
        if retry or not self.lean:
            return lambda connection: self._full(connection, retry)
        return self._lean_first

    def _full(self, connection: Any, retry: bool) -> Any:
        key, match, mode, keep, keep_ms = self.call
        store = self.store
        keys, args = release_call(
            key, match, mode, keep, keep_ms, store.handoff_ttl_ms, store.fence_ttl_ms, retry
        )
        return scripts.RELEASE_FULL.exchange(keys, args, self.encoding)(connection)

    def _lean_first(self, connection: Any) -> Any:
        key, match = self.call[0], self.call[1]
        store, encoding = self.store, self.encoding
        if store._native_release:
            native = native_release(key, match, encoding)
            deleted = after_native_release(send_and_read(connection, native, 1)[0])
            if deleted:
                return 1
            if deleted is None:
                store._native_release = False  # refused: the scripts from now on
            else:
                # Nothing deleted, and known: the script below only says why
                # (gone, another's, ours waited for); it cannot delete.
                self.attempts.answered()
        reply = (self.first or scripts.RELEASE.exchange((key,), (match,), encoding))(connection)
        if reply == 2:  # someone waits behind us: hand over, wake them
            self.attempts.answered()  # read, and it deleted nothing (helper-37)
            self.attempts.start()  # the full release may run: its reply matters
            return self._full(connection, False)
        return reply
