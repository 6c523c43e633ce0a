"""One locked execution in the worker: take the lock, apply the policy, give it back.

:class:`Execution` is created by ``SingletonTaskMixin.__call__`` for every
run. :meth:`Execution.take_lock` acquires (one round trip, ``acquire.py``),
and when the key is held applies the contention policy (parking through
``parking.py``); :meth:`Execution.give_back` runs in the ``finally`` and
gives back exactly what was taken. A lock-store error re-sends the task
with backoff (``resend.py``), carrying the value whose reply was lost so
the re-send can take it over. May import ``acquire``, ``parking``,
``resend``, ``lease``, ``policies``, ``abort``; never ``task``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore
from celery.exceptions import Retry as CeleryRetry

from celery_redislock import signals
from celery_redislock._clock import clock
from celery_redislock._local import ExecutionStack
from celery_redislock.abort import interrupter_for_current_thread
from celery_redislock.acquire import SecondCopy
from celery_redislock.brokers import whole_second_delays
from celery_redislock.exceptions import LockBackendError, LockKeyError
from celery_redislock.handoff import forget_revocable, keep_revocable
from celery_redislock.headers import (
    LOCK_RETRIES_HEADER,
    PARKED_SINCE_HEADER,
    as_received,
    redelivered,
    request_header,
    seconds_until,
)
from celery_redislock.lease import LockHandle
from celery_redislock.parking import ParkingAttempt, handoff_policy
from celery_redislock.pending import RevocableCall
from celery_redislock.policies import (
    LOCK_ACQUIRED,
    Contention,
    Retry,
    RetryInsteadOfSkip,
    RetryWhileOwnDeliveryHolds,
    uses_handoff,
)
from celery_redislock.resend import (
    on_backend_error,
    resend,
    send_contention_event,
    signal_contention,
)
from celery_redislock.store import AcquireResult
from celery_redislock.takeback import take_back_value
from celery_redislock.tokens import LockValue

if TYPE_CHECKING:
    from celery_redislock.settings import TaskSettings
    from celery_redislock.task_shape import LockedTask

__all__ = ["Decision", "Execution"]

# The documented logger name: this was part of task.py.
logger = logging.getLogger("celery_redislock.task")

#: Longest wait for the lock still held by this task's own previous attempt.
_OWN_RETRY_WAIT = 10.0


class Decision:
    """A value a policy returned instead of running the body."""

    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result


class Execution(ParkingAttempt):
    """One run of a locked task in the worker: what it took, and what it gives back.

    :meth:`give_back` runs in the ``finally`` of ``__call__`` and gives back the
    lock if it was granted (deleting it, handing it to a queued retry, or
    keeping it as an idempotency window), or, if an acquire was interrupted
    before its reply was read, deletes the value that acquire may have
    stored (a compare-and-delete: a no-op if it did not).
    """

    def __init__(
        self,
        task: LockedTask,
        settings: TaskSettings,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        held: ExecutionStack[Execution],
    ) -> None:
        super().__init__(task, settings, args, kwargs)
        #: The task's executions running in this thread (``task.lock`` reads the top).
        self.held = held

    def take_lock(self) -> Decision | None:
        """Take the lock; None means "run the body", else the policy's result."""
        task, request, settings = self.task, self.request, self.settings
        started = clock()
        try:
            if self.handoff:
                self._drop_if_revoked()
            if self.debounced:
                self._wait_for_debounce()
            result = self._acquire()
        except LockBackendError as exc:
            self._on_backend_error(exc)
            return None  # lock_on_backend_error="run": run unprotected
        except SecondCopy:
            self._drop_second_copy()
        if result.acquired:
            self._grant(result, started)
            return None
        holder = result.holder_value
        if (
            holder is not None
            and holder.owner.task_id == request.id
            and holder.is_queued
            and result.holder is not None
            and result.holder not in self.adopt
        ):
            # This task's own queued value, from a message that lost its
            # header (a re-send): no process runs it, so take it over.
            self.adopt.append(result.holder)
            result = self._acquire()
            if result.acquired:
                self._grant(result, started)
                return None
            holder = result.holder_value
        if holder is not None and holder.owner.task_id == request.id and holder.is_kept:
            # A second delivery of a message whose own run succeeded
            # (acks_late and a crash before the ack, a visibility timeout):
            # its result is already stored. Drop the copy.
            self._contended(result, "already_succeeded")
            if self.may_park:
                self._withdraw()  # any parked entry of this call: it ran
            logger.info(
                "%s[%s] delivered again after it succeeded; dropped (lock %s kept its window)",
                task.name,
                request.id,
                self.key,
            )
            raise Ignore()
        granted = self._granted

        def wait_for_lock(timeout: float) -> bool:
            waited = self._acquire(wait=timeout)
            if waited.acquired:
                granted.append(waited)
            return waited.acquired

        try:
            previous_attempt_released = (
                holder is not None
                and holder.owner.task_id == request.id
                and holder.owner.attempt < (request.retries or 0)
                and wait_for_lock(min(result.ttl_remaining or _OWN_RETRY_WAIT, _OWN_RETRY_WAIT))
            )
        except LockBackendError as exc:
            self._on_backend_error(exc)
            return None  # lock_on_backend_error="run": run unprotected
        if previous_attempt_released:
            # Our own previous attempt raised Retry and published this
            # message just before its ``finally`` released the lock: the
            # release is a moment away, so wait for it instead of retrying.
            self._grant(granted[-1], started)
            return None

        lock_retries = int(request_header(request, LOCK_RETRIES_HEADER) or 0)
        parked_since = request_header(request, PARKED_SINCE_HEADER)
        holder_task_id, is_redelivered = result.holder_task_id, redelivered(request)
        policy = settings.beat_policy if self.from_beat else settings.policy
        if self.must_run:
            policy = handoff_policy(policy)
        if holder_task_id == request.id:
            # Its own earlier delivery holds the key: wait for it by retrying,
            # never by parking (a parked call is handed the next free slot,
            # with lock_limit > 1 while its own delivery still runs).
            policy = RetryWhileOwnDeliveryHolds(
                Retry(jitter=1.0, max_retries=0) if uses_handoff(policy) else policy
            )
        elif is_redelivered:
            policy = RetryInsteadOfSkip(policy)
        # The holder's TTL costs a round trip (a contended SET NX GET names
        # the holder only): read only for a policy that uses it.
        ttl = result.ttl_remaining if policy.needs_ttl else result.known_ttl
        contention = Contention(
            key=self.key,
            task_name=task.name,
            task_id=request.id,
            holder_task_id=holder_task_id,
            ttl_remaining=ttl,
            redelivered=is_redelivered,
            lock_retries=lock_retries,
            wait_for_lock=wait_for_lock,
            retry_later=lambda countdown, exc: resend(
                task, countdown, exc, {LOCK_RETRIES_HEADER: lock_retries + 1}
            ),
            park=None
            if request.is_eager
            else lambda countdown, exc: self._park(countdown, exc, lock_retries, parked_since),
            parked_for=max(time.time() - float(parked_since), 0.0) if parked_since else 0.0,
            withdraw=self._withdraw if self.handoff else None,
        )
        logger.info(
            "%s[%s] not running: lock %s is held by %s (expires in %s s); policy %s",
            task.name,
            request.id,
            self.key,
            holder_task_id or "an unknown holder",
            "?" if ttl is None else f"{ttl:.3f}",
            policy.name,
        )
        self._contended(result, policy.name)
        try:
            decision = policy.handle(contention)
        except LockBackendError as exc:  # the store failed while a policy waited
            self._on_backend_error(exc)
            return None  # lock_on_backend_error="run": run unprotected
        except SecondCopy:
            self._drop_second_copy()
        if decision is LOCK_ACQUIRED:
            self._grant(granted[-1], started)
            return None
        return Decision(decision)

    def _on_backend_error(self, exc: LockBackendError) -> None:
        """The store failed: re-send with backoff (taking this value over), or run unprotected.

        Returns (None: run the body) only with ``lock_on_backend_error="run"``.
        """
        self.unsettled = False
        # The acquire may land after all: after this execution ran without
        # its lock ("run"), or after the re-send ("fail") ran and released.
        # The re-send also carries the value, to take it over if it is there.
        take_back_value(
            self.settings.backend,
            self.key,
            self.value,
            now=False,
            limit=self.settings.limit,
        )
        on_backend_error(self.task, self.settings, self.key, exc, self.value)

    def _contended(self, result: AcquireResult, policy: str) -> None:
        task = self.task
        holder = result.holder_task_id
        signal_contention(task, self.key, self.request.id, holder, result.known_ttl, policy)
        send_contention_event(task, self.key, result.holder_task_id, policy)

    def _grant(self, result: AcquireResult, started: float) -> None:
        task, settings = self.task, self.settings
        handle = LockHandle(
            settings.backend,
            result.key or self.key,  # the slot taken, with lock_limit > 1
            self.value,
            settings.ttl,
            result.sent_at,
            task_name=task.name,
            task_id=self.request.id,
            sender=task,
            renew=False,
            fence=result.fence,
        )
        self.handle = handle
        self.unsettled = False
        handle.on_lost(task.on_lock_lost)
        if settings.on_lost == "abort":
            interrupt = interrupter_for_current_thread()
            if interrupt is not None:
                handle.on_lost(interrupt)
        handle.start_renewal()
        if self.request.eta and (settings.enqueue or settings.debounce):
            # It waited for its countdown, maybe in the broker, with a record
            # of what a revoke would free (``revoked.py``): no longer needed.
            prefix = settings.app.key_prefix
            forget_revocable(task.app, settings.backend, prefix, self.request.id or "")
        signals.lock_acquired.send(
            sender=task,
            key=handle.key,
            task_name=task.name,
            task_id=self.request.id,
            waited=clock() - started,
            fence=result.fence,
        )

    # -- how it ends --

    def succeeded(self) -> None:
        """The body returned: keep an idempotency window if configured."""
        hold = self.settings.hold_after_success
        if hold and self.handle is not None:
            request = self.request
            kept = LockValue.kept(request.id or "", request.retries or 0, self.task.name)
            self.keep = (kept.encode(), hold)

    def retrying(self, retry: CeleryRetry) -> None:
        """The body raised Retry: hand the key to the queued retry (``lock_enqueue``).

        Only if the retried message will lock the same key: ``self.retry(args=...)``
        may change the arguments, and then the old key is simply released.
        """
        sig = getattr(retry, "sig", None)  # set by Task.retry(); absent on a bare Retry
        if not (self.settings.enqueue and self.queued_token) or self.queued_slot or sig is None:
            return
        task = self.task
        try:
            args, kwargs = sig.args or (), dict(sig.kwargs or {})
            received = as_received(args, kwargs, task.serializer, task.name)
            same_key = task.lock_key_for_received(*received, self.settings) == self.key
        except LockKeyError:
            same_key = False
        if same_key:
            # The retried message carries the same token and takes it over.
            ttl = self.settings.enqueue_ttl + seconds_until(retry.when)
            self.keep = (self.queued_token, ttl)
            if retry.when and whole_second_delays(task.app, task, sig.options, args, kwargs):
                # Its countdown waits in the broker: a revoke frees the key from this.
                call = RevocableCall(task.name, self.key, self.queued_token, False)
                store = self.settings.enqueue_backend or self.settings.backend
                prefix = self.settings.app.key_prefix
                due = seconds_until(retry.when)
                keep_revocable(task.app, store, prefix, self.request.id or "", call, due)

    def give_back(self) -> None:
        """Give back what this execution took; safe to call again if interrupted."""
        held = self.held
        if held.top is self:
            held.pop()
        if self.handle is not None:
            if self.keep is not None:
                self.handle.release(*self.keep)
            else:
                self.handle.release()
        elif self.unsettled:
            # Interrupted between sending an acquire and reading its reply.
            take_back_value(
                self.settings.backend,
                self.key,
                self.value,
                limit=self.settings.limit,
                ttl=self.settings.ttl,
            )
            self.unsettled = False
