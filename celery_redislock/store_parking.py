"""Parking behind a holder until its release hands the lock over, and debounce bursts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_redislock import debounce_scripts, park_scripts
from celery_redislock._clock import clock
from celery_redislock.key_family import family_of
from celery_redislock.outcomes import AcquireResult, ParkResult, held_by
from celery_redislock.protocol import decode_text, hand_off
from celery_redislock.store_connections import _Kind
from celery_redislock.store_slots import LockSlotsAndWaits
from celery_redislock.transport import ScriptCall

__all__ = ["LockParking"]


class LockParking(LockSlotsAndWaits):
    """Park a call behind the holder (hand-off, coalescing) and keep debounce bursts."""

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
        family = family_of(key)
        queued_at, queued_value = queued or (family.queued, "")
        slots = family.slots(limit)
        keys = (*slots, family.fence, *family.handoff, queued_at, family.next_run)
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
            hand_off(self.on_handoff, key, reply[:2] + reply[3:])
        encoding = self._topology(_Kind.COMMANDS).endpoint_for(key).encoding
        return ParkResult(
            held_by(reply, sent_at, encoding), parked=status == 3 or bool(int(reply[3]))
        )

    def withdraw(self, key: str, handoff: str, park_ttl_ms: int, limit: int = 1) -> None:
        """Withdraw a parked call that gave up: it leaves the queue and no copy of it runs.

        A slot already handed to it passes to the next parked call (whose
        message is published, as after a release). One round trip.

        Raises:
            LockBackendError: Redis is unreachable or refused the script.
        """
        family = family_of(key)
        keys = (*family.slots(limit), *family.handoff, family.fence)
        args = (
            handoff,
            "withdrawn",
            park_ttl_ms,
            self.handoff_ttl_ms,
            family.channel,
            self.fence_ttl_ms,
        )
        with self._errors("withdraw", key):
            reply = self.do_script(park_scripts.UNPARK, keys, args)
        if isinstance(reply, list):
            hand_off(self.on_handoff, key, reply)

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
            debounce_scripts.DEBOUNCE,
            (family_of(key).debounce,),
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
            debounce_scripts.DEBOUNCE_DUE,
            (family_of(key).debounce,),
            (task_id, "1" if forget else ""),
        )
        with self._errors("debounce", key):
            reply = self._with_neighbours(call, None, after)
        return int(reply) / 1000.0

    def do_park(
        self,
        keys: Sequence[str],
        args: Sequence[Any],
        before: ScriptCall | None = None,
        after: ScriptCall | None = None,
    ) -> Any:
        """Run ``PARK_SCRIPT`` between ``before`` and ``after``; return the park's raw reply."""
        return self._with_neighbours((park_scripts.PARK, keys, args), before, after)
