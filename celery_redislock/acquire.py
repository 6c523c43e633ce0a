"""What one execution asks the lock store for, and the round trip that asks.

:class:`LockAttempt` holds one run's key, value and the values it may take
over (its own queued token, its hand-off value, acquires whose reply was
lost), and sends the acquire that fits the run: plain, a slot of a
``lock_limit`` key, a wait, or the park round trip of a run that may have
parked. ``parking.py`` and ``execution.py`` build on it. May import the
lock store's types, ``handoff``, ``headers``, ``keys``, ``tokens`` and,
for the type checker, ``task_shape``; never ``task``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery_redislock.exceptions import LockKeyError
from celery_redislock.handoff import app_pending, marker_ttl_ms
from celery_redislock.headers import (
    DEBOUNCE_HEADER,
    HANDOFF_COPY_HEADER,
    HANDOFF_HEADER,
    UNSETTLED_HEADER,
    as_received,
    own_values,
    queued_token,
    request_header,
)
from celery_redislock.key_family import family_of
from celery_redislock.pending import PendingIndex
from celery_redislock.store import AcquireResult
from celery_redislock.tokens import LockOwner, LockValue
from celery_redislock.transport import ScriptCall

if TYPE_CHECKING:
    from celery_redislock.lease import LockHandle
    from celery_redislock.settings import TaskSettings
    from celery_redislock.task_shape import LockedTask

__all__ = ["LockAttempt", "SecondCopy"]


class SecondCopy(Exception):
    """Another copy of this parked execution was already granted the lock."""


class LockAttempt:
    """One run's key, value and takeover values, and the acquire round trip.

    Also what the run ends up holding (``handle``), and what an interrupted
    acquire may have stored (``unsettled``), for ``Execution.give_back``.
    """

    def __init__(
        self,
        task: LockedTask,
        settings: TaskSettings,
        args: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> None:
        self.task = task
        self.settings = settings
        self.request = request = task.request
        if request.is_eager:
            # apply() passes the caller's objects; a worker gets them decoded.
            # Eager mode never serializes, so arguments the serializer refuses
            # (a set under JSON) are keyed as they are rather than refused.
            with contextlib.suppress(LockKeyError):
                args, kwargs = as_received(args, kwargs, task.serializer, task.name)
        self.key = task.lock_key_for_received(args, kwargs, settings)
        self.value = LockValue.new_for_task(
            request.id, request.retries or 0, request.hostname, task.name
        )
        headers = request.headers or {}
        self.queued_token = queued_token(request)
        # A copy of this very call that parked (Celery's retry() copies the
        # headers of the attempt before: they are not this call's).
        sent_handoff = request_header(request, HANDOFF_HEADER)
        self.handoff: str | None = (
            self.parked_value if sent_handoff and sent_handoff == self.parked_value else None
        )
        # The original message (and its redeliveries and backoff re-sends)
        # is one copy; the woken message and each safety net are others.
        self.copy_tag = str((self.handoff and request_header(request, HANDOFF_COPY_HEADER)) or "o")
        #: A coalesced run's queued key and value, freed when it is granted.
        self.queued_slot: tuple[str, str] | None = None
        if settings.coalesce and self.queued_token:
            self.queued_slot = (family_of(self.key).queued, self.queued_token)
        self.adopt = [
            *([self.queued_token] if self.queued_token and not self.queued_slot else []),
            *([self.handoff] if self.handoff else []),
            *own_values(request, headers.get(UNSETTLED_HEADER)),
        ]
        self._granted: list[AcquireResult] = []
        #: A debounced run: its burst may have moved its due time.
        self.debounced = bool(
            settings.debounce and request_header(request, DEBOUNCE_HEADER) and not request.is_eager
        )
        self.from_beat = bool(
            headers.get("celery_beat_task") or getattr(request, "celery_beat_task", None)
        )
        #: Runs after the holder, never instead: every contention parks.
        # (Coalesced and debounced tasks also when their call skipped the
        # producer's step: a canvas member, send_task.)
        self.must_run = bool(self.handoff or settings.coalesce or settings.debounce)
        #: This call may park: a copy of a call that parked (or may have: a
        #: lost reply, a redelivery) must learn whether another copy of the
        #: call already ran, and may hold the hand-off.
        self.may_park = self.must_run or (
            settings.beat_hands_off if self.from_beat else settings.hands_off
        )
        #: Its first acquire goes through PARK: so does every call of a task
        #: whose other calls may park (a beat call that skips): a key freed
        #: by a dead holder's TTL with calls parked on it is theirs first
        #: (review helper-34 C1). Not with ``lock_min_replicas``: PARK sends
        #: no ``WAIT`` (helper-35), so such a call keeps the plain acquire.
        self.parks = self.may_park or (
            not settings.min_replicas and (settings.hands_off or settings.beat_hands_off)
        )
        self.handle: LockHandle | None = None
        #: An acquire was sent and its reply not (yet) read.
        self.unsettled = False
        self.keep: tuple[str, float] | None = None

    # -- taking the lock --

    def _acquire(self, wait: float | None = None) -> AcquireResult:
        settings, backend = self.settings, self.settings.backend
        self.unsettled = True
        if wait is not None:
            # With lock_limit > 1, any free slot of the key (the task prefix
            # finds one held by this task's own earlier attempt).
            result = backend.acquire_waiting(
                self.key,
                self.value,
                settings.ttl_ms,
                wait,
                self.adopt,
                settings.min_replicas,
                settings.min_replicas_timeout,
                limit=settings.limit,
                task_prefix=LockOwner.task_prefix(self.request.id),
            )
        elif self.parks:
            # One round trip that also refuses a second copy of a parked
            # call, and frees a coalesced run's queued key when granted.
            parked = backend.park(
                self.key,
                self.value,
                settings.ttl_ms,
                self.parked_value,
                self.copy_tag,
                b"",
                self.park_ttl_ms,
                self.queued_slot,
                self.adopt,
                settings.limit,
                LockOwner.task_prefix(self.request.id),
                after=self._forget_queued_run(),
            )
            if parked.already_ran:
                self.unsettled = False
                raise SecondCopy()
            result = parked.result
        elif settings.limit > 1:
            result = backend.acquire_slot(
                self.key,
                settings.limit,
                self.value,
                settings.ttl_ms,
                self.adopt,
                LockOwner.task_prefix(self.request.id),
                settings.min_replicas,
                settings.min_replicas_timeout,
            )
        else:
            result = backend.acquire(
                self.key,
                self.value,
                settings.ttl_ms,
                self.adopt,
                settings.min_replicas,
                settings.min_replicas_timeout,
            )
        self.unsettled = result.acquired  # granted: the handle owns it from here
        return result

    @functools.cached_property
    def pending(self) -> PendingIndex:
        """The app's pending calls (``pending.py``), for the runs that may park."""
        settings = self.settings
        return app_pending(self.task.app, settings.backend, settings.app.key_prefix)

    def _forget_queued_run(self) -> ScriptCall | None:
        """A coalesced run's member of the pending index goes once it starts or parks."""
        if self.queued_slot is None:
            return None
        return self.pending.forget_queued_call(
            self.key, self.request.id or "", self.queued_slot[1], self.parked_value
        )

    @functools.cached_property
    def parked_value(self) -> str:
        """This call's hand-off value: the same for every copy and re-send of it.

        Derived from the task id and attempt, so new for a ``self.retry()``;
        computed only for runs that may park (it is a hash).
        """
        request = self.request
        return LockValue.parked(request.id or "", request.retries or 0, self.task.name).encode()

    @property
    def park_ttl_ms(self) -> int:
        """How long a parked execution's queue entries and ran markers live, in ms.

        Refreshed at every park; a ran marker must outlive the other copy of
        its execution (the woken message or the safety-net re-send).
        """
        return marker_ttl_ms(self.task.app.conf, self.settings.enqueue_ttl, self.settings.ttl)
