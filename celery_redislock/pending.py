"""The index of pending calls: what a worker's sweep must publish if nobody else does.

A call that must run later is waiting on something that can die with a
worker: a parked call on its holder's release (and its safety-net copy,
reserved by some worker), a coalesced run's message and a debounced run's
countdown message on the worker that reserved them. The Redis broker gives
a dead worker's reserved messages back only after its visibility timeout
(an hour by default). So the lock store keeps each such call's message,
and one sorted set per app (:func:`~celery_redislock.keys.pending_keys`)
says when a sweep should look at it:

* ``p|<limit>|<key>``: calls parked on ``key``. A sweep hands a free slot to
  the first of them, as a release would (``REAP_PARKED_SCRIPT``);
* ``q|<task id>|<key>``: ``key``'s coalesced run, published and not
  started (``REAP_QUEUED_SCRIPT``); dropped in the round trip that starts
  or parks it;
* ``d||<key>``: ``key``'s debounced run, due and not started
  (``REAP_DEBOUNCED_SCRIPT``); dropped in the round trip that starts it;
* ``o|<id>``: a re-send whose publish failed, kept in the outbox.

Every worker sweeps (``sweeper.py``): one ``EVALSHA`` per tick when nothing
is due, however many keys there are. A copy a sweep publishes may meet the
original message later; the hand-off value's "ran" marker (see
``PARK_SCRIPT``) lets only the first copy run.

No Celery here: the scripts, their arguments and their replies.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from redis.exceptions import RedisError

from celery_redislock.key_family import family_of
from celery_redislock.keys import pending_keys, revocable_key
from celery_redislock.pending_scripts import (
    DUE,
    FORGET_DEBOUNCED,
    FORGET_QUEUED,
    OUTBOX_PUT,
    OUTBOX_TAKE,
    QUEUE_RUN,
    REAP_DEBOUNCED,
    REAP_PARKED,
    REAP_QUEUED,
    SETTLE,
    TOUCH,
    WITHDRAW_RUN,
)
from celery_redislock.store import LockStore, backend_error, decode_text
from celery_redislock.transport import ScriptCall

__all__ = [
    "OUTBOX_TTL_MS",
    "Member",
    "PendingIndex",
    "Reaped",
    "Reaping",
    "RevocableCall",
]


#: How long an outbox lives past its last message, in ms (a week).
OUTBOX_TTL_MS = 7 * 24 * 3_600_000


class Member:
    """The index's members: what kind of pending call, and where."""

    PARKED, QUEUED, DEBOUNCED, OUTBOX = "p", "q", "d", "o"

    @staticmethod
    def parked(key: str, limit: int) -> str:
        """Calls parked on ``key`` (``limit`` slots)."""
        return f"p|{limit}|{key}"

    @staticmethod
    def queued(key: str, task_id: str) -> str:
        """``key``'s coalesced run ``task_id``, published and not started."""
        return f"q|{quote(task_id, safe='')}|{key}"

    @staticmethod
    def debounced(key: str) -> str:
        """``key``'s debounced run (whichever burst is open)."""
        return f"d||{key}"

    @staticmethod
    def parse(member: str) -> tuple[str, str, str]:
        """``(kind, key or outbox id, slots or task id)`` of a member.

        Raises:
            ValueError: not a member this package writes.
        """
        kind, _, rest = member.partition("|")
        if kind in (Member.PARKED, Member.QUEUED, Member.DEBOUNCED):
            detail, _, key = rest.partition("|")
            if key and (detail or kind == Member.DEBOUNCED):
                return kind, key, unquote(detail)
        elif kind == Member.OUTBOX and rest:
            return kind, rest, ""
        raise ValueError(f"not a pending-call member: {member!r}")


class Reaping(enum.Enum):
    """What a sweep found for one member."""

    DONE = 0
    LATER = 1
    PUBLISH = 2


@dataclass(frozen=True)
class Reaped:
    """A sweep's finding: done, look again in ``later_ms``, or publish ``message``.

    ``handoff`` is the hand-off value a slot was handed to (parked calls).
    """

    outcome: Reaping
    later_ms: int = 0
    message: bytes = b""
    handoff: str = ""


def _reaped(reply: Any) -> Reaped:
    outcome = Reaping(int(reply[0]))
    if outcome is Reaping.LATER:
        return Reaped(outcome, later_ms=max(int(reply[1]), 0))
    if outcome is Reaping.PUBLISH:
        message = reply[-1]
        handoff = decode_text(reply[2], "utf-8") if len(reply) == 4 else ""
        return Reaped(outcome, message=_as_bytes(message), handoff=handoff)
    return Reaped(outcome)


@dataclass(frozen=True)
class RevocableCall:
    """What a revoke of a call whose countdown waits in the broker must give back.

    Written at ``delay()`` where no worker holds such a message (RabbitMQ's
    native delayed delivery), read by the worker that gets the revoke.
    ``token``: the call's queued value (``lock_enqueue``); ``debounced``: its
    burst ends.
    """

    task_name: str
    key: str
    token: str | None
    debounced: bool

    def encode(self) -> str:
        """The record's text."""
        return json.dumps([self.task_name, self.key, self.token, self.debounced])

    @classmethod
    def decode(cls, text: str) -> RevocableCall | None:
        """The record in ``text``; ``None`` for text this package did not write."""
        try:
            name, key, token, debounced = json.loads(text)
        except (ValueError, TypeError):
            return None
        if not (isinstance(name, str) and isinstance(key, str)):
            return None
        return cls(name, key, token if isinstance(token, str) else None, debounced is True)


def _as_bytes(value: Any) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


class PendingIndex:
    """One app's pending calls in its lock store.

    Args:
        store: The app's lock store.
        prefix: The app's key prefix (``redislock_key_prefix``).
        app: The app's main name (``Celery(main)``; its index is its own).
    """

    def __init__(self, store: LockStore, prefix: str, app: str) -> None:
        self.store = store
        self.prefix, self.app = prefix, app
        self.index, self.outbox = pending_keys(prefix, app)

    def keep_revocable(self, task_id: str, call: RevocableCall, ttl_ms: int) -> None:
        """Keep what a revoke of ``task_id`` gives back, for ``ttl_ms`` (one ``SET``)."""
        self.store.keep_record(revocable_key(self.prefix, self.app, task_id), call.encode(), ttl_ms)

    def read_revocable(self, task_id: str) -> RevocableCall | None:
        """The record :meth:`keep_revocable` kept (``None``: none, or not the package's)."""
        text = self.store.read_record(revocable_key(self.prefix, self.app, task_id))
        return None if text is None else RevocableCall.decode(text)

    def forget_revocable(self, task_id: str) -> None:
        """Delete the record of ``task_id`` (its keys were given back)."""
        self.store.delete_record(revocable_key(self.prefix, self.app, task_id))

    def mark_revoked(self, task_id: str, ttl_ms: int) -> None:
        """Say for ``ttl_ms`` that ``task_id`` was revoked while its message waits in a queue."""
        self.store.keep_record(
            revocable_key(self.prefix, self.app, task_id, "revoked"), "1", ttl_ms
        )

    def was_revoked(self, task_id: str) -> bool:
        """Whether :meth:`mark_revoked` said so of ``task_id`` (one ``GET``)."""
        key = revocable_key(self.prefix, self.app, task_id, "revoked")
        return self.store.read_record(key) is not None

    def touch_call(self, member: str, delay_ms: int) -> ScriptCall:
        """The script call that asks a sweep to look at ``member`` in ``delay_ms`` at the latest.

        For a caller that sends it with its own script in one round trip
        (``LockStore.run_scripts``).
        """
        return TOUCH, (self.index,), (member, max(int(delay_ms), 0))

    def look_at_parked(self, key: str, limit: int, delay_ms: int) -> None:
        """Ask a sweep to look at the calls parked on ``key`` in ``delay_ms`` at the latest.

        Raises:
            LockBackendError: the lock store did not answer.
        """
        self._run([self.touch_call(Member.parked(key, limit), delay_ms)], "schedule")

    def _run(self, calls: Sequence[ScriptCall], operation: str) -> list[Any]:
        try:
            return self.store.run_scripts(calls, short=True)
        except RedisError as exc:
            raise backend_error(exc, operation, self.index, self.store.describe()) from exc

    def due(self, count: int, lease_ms: int) -> tuple[str, list[str]]:
        """Claim up to ``count`` members due now, for ``lease_ms``; return the claim and them."""
        (reply,) = self._run([(DUE, (self.index,), (count, lease_ms))], "sweep")
        claim = decode_text(reply[1], "utf-8")
        return claim, [decode_text(member, "utf-8") for member in reply[2:]]

    def settle(self, member: str, claim: str, later_ms: int | None) -> None:
        """After a sweep looked at ``member``: remove it (``None``) or look again in ``later_ms``.

        A member touched since the claim is left as the toucher set it.
        """
        later = "" if later_ms is None else max(int(later_ms), 0)
        self._run([(SETTLE, (self.index,), (member, claim, later))], "sweep")

    def reap_parked(self, key: str, limit: int, handoff_ttl_ms: int, fence_ttl_ms: int) -> Reaped:
        """Hand a free slot of ``key`` to the first parked call (see ``REAP_PARKED_SCRIPT``).

        A retry after a lost reply asks for the hand-over the lost reply was.
        """
        family = family_of(key)
        waiters, parked, _ = family.handoff
        keys = (*family.slots(limit), waiters, parked, family.fence)
        first = (REAP_PARKED, keys, (handoff_ttl_ms, fence_ttl_ms, ""))
        again = (REAP_PARKED, keys, (handoff_ttl_ms, fence_ttl_ms, "1"))
        try:
            reply = self.store.run_script_or_retry(first, again, short=True)
        except RedisError as exc:
            raise backend_error(exc, "hand over", key, self.store.describe()) from exc
        return _reaped(reply)

    def reap_queued(self, key: str, task_id: str, ran_ttl_ms: int) -> Reaped:
        """A copy of ``key``'s coalesced run if it is overdue (see ``REAP_QUEUED_SCRIPT``)."""
        family = family_of(key)
        _, parked, ran = family.handoff
        keys = (family.queued, family.next_run, ran, parked)
        (reply,) = self._run([(REAP_QUEUED, keys, (ran_ttl_ms, task_id))], "sweep")
        return _reaped(reply)

    def reap_debounced(self, key: str, ran_ttl_ms: int) -> Reaped:
        """A copy of ``key``'s debounced run if it is overdue (see ``REAP_DEBOUNCED_SCRIPT``)."""
        family = family_of(key)
        keys = (family.debounce, family.handoff[2])
        (reply,) = self._run([(REAP_DEBOUNCED, keys, (ran_ttl_ms,))], "sweep")
        return _reaped(reply)

    def forget_queued_call(
        self, key: str, task_id: str, token: str, handoff: str
    ) -> ScriptCall | None:
        """The call that drops a coalesced run's member once it started or parked.

        Sent right after the script that grants or parks it, in the same
        round trip; ``None`` on a cluster (the keys are of two slots): the
        sweep drops the member when it finds the run started.
        """
        if not self.store.single_server:
            return None
        family = family_of(key)
        keys = (self.index, family.queued, family.handoff[1])
        return FORGET_QUEUED, keys, (Member.queued(key, task_id), token, handoff)

    def forget_debounced_call(self, key: str) -> ScriptCall | None:
        """As :meth:`forget_queued_call`, for a key whose debounced run started."""
        if not self.store.single_server:
            return None
        keys = (self.index, family_of(key).debounce)
        return FORGET_DEBOUNCED, keys, (Member.debounced(key),)

    def queue_run(
        self,
        key: str,
        token: str,
        ttl_ms: int,
        handoff: str,
        message: bytes,
        due_ms: int,
        task_id: str,
        grace_ms: int,
        adopt: str = "",
    ) -> tuple[bool, str | None, float | None]:
        """Queue ``key``'s coalesced run at enqueue time, keeping its message (one round trip).

        Takes ``key``'s queued key with ``token`` (as an acquire would) and
        asks the sweep to publish ``message`` if the run has not started
        ``due_ms`` from now (again ``grace_ms`` later, doubling, a few
        times). On the commands' connections of ``store`` (a producer's).
        A key holding ``adopt`` (a revoked run's token) is taken over.

        Returns:
            ``(queued, holder's token, holder's remaining TTL in s)``; the
            holder is the run already queued when not ``queued``.

        Raises:
            LockBackendError: the store is unreachable or refused the script.
        """
        family = family_of(key)
        call = (
            QUEUE_RUN,
            (family.queued, family.next_run),
            (
                token,
                ttl_ms,
                handoff,
                message,
                max(int(due_ms), 0),
                task_id,
                max(grace_ms, 1),
                adopt,
            ),
        )
        touch = self.touch_call(Member.queued(key, task_id), due_ms)
        try:
            reply = self.store.run_scripts([touch, call])[1]
        except RedisError as exc:
            where = self.store.describe()
            raise backend_error(exc, "queue a run of", key, where) from exc
        if int(reply[0]) == 1:
            return True, None, None
        pttl = int(reply[2])
        holder = decode_text(reply[1], self.store.encoding_for(key))
        return False, holder, pttl / 1000.0 if pttl >= 0 else None

    def withdraw_run(self, key: str, token: str, task_id: str, handoff: str) -> bool:
        """Undo :meth:`queue_run` after its publish failed, unless a copy of the run runs.

        Returns:
            True when a copy a sweep published has reached a worker (granted
            or parked: nothing was withdrawn); False once the queued key and
            the run's record are gone (a copy still in the broker may yet
            run: it then takes the free key).

        Raises:
            LockBackendError: the store is unreachable or refused the script.
        """
        family = family_of(key)
        _, parked, ran = family.handoff
        keys = (family.queued, family.next_run, ran, parked)
        call = (WITHDRAW_RUN, keys, (token, task_id, handoff))
        try:
            return int(self.store.run_scripts([call])[0]) == 1
        except RedisError as exc:
            raise backend_error(exc, "withdraw a run of", key, self.store.describe()) from exc

    def put_outbox(self, message_id: str, message: bytes, delay_ms: int, ttl_ms: int) -> None:
        """Keep ``message`` for a sweep to publish in ``delay_ms`` (the broker refused it).

        On the commands' connections: the caller is a task, not the sweep.
        The outbox lives ``ttl_ms`` past its last message.
        """
        args = (message_id, message, max(int(delay_ms), 0), max(int(ttl_ms), 1))
        try:
            self.store.run_scripts([(OUTBOX_PUT, (self.index, self.outbox), args)])
        except RedisError as exc:
            where = self.store.describe()
            raise backend_error(exc, "keep a message for", self.index, where) from exc

    def take_outbox(self, message_id: str) -> bytes | None:
        """Take message ``message_id`` out of the outbox, to publish it (``None``: gone).

        Taken, not read: a sweep whose lease ran out, or that failed after
        publishing, can never publish it a second time. One that fails to
        publish puts it back (:meth:`put_outbox`).
        """
        (reply,) = self._run([(OUTBOX_TAKE, (self.index, self.outbox), (message_id,))], "sweep")
        return None if reply is None else _as_bytes(reply)
