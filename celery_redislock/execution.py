"""One locked execution in the worker: take the lock, apply the policy, give it back.

:class:`Execution` is created by ``SingletonTaskMixin.__call__`` for every
run. :meth:`Execution.take_lock` acquires (one round trip), and when the key
is held applies the contention policy; :meth:`Execution.give_back` runs in
the ``finally`` and gives back exactly what was taken. A lock-store error
re-sends the task with backoff (:func:`on_backend_error`), carrying the
value whose reply was lost so the re-send can take it over.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn, cast

from celery.exceptions import Ignore, Reject
from celery.exceptions import Retry as CeleryRetry

from celery_redislock import signals
from celery_redislock._clock import clock
from celery_redislock.abort import interrupter_for_current_thread
from celery_redislock.brokers import publisher_headers, routable_countdown
from celery_redislock.exceptions import LockBackendError, LockContended, LockKeyError
from celery_redislock.handoff import app_pending, marker_ttl_ms, pack_message, pack_signature
from celery_redislock.headers import (
    BACKEND_RETRIES_HEADER,
    DEBOUNCE_HEADER,
    HANDOFF_COPY_HEADER,
    HANDOFF_HEADER,
    LOCK_RETRIES_HEADER,
    MAX_UNSETTLED,
    PARKED_SINCE_HEADER,
    REDELIVERED_HEADER,
    UNSETTLED_HEADER,
    own_values,
    queued_token,
    redelivered,
    seconds_until,
)
from celery_redislock.keys import queued_key
from celery_redislock.lease import LockHandle
from celery_redislock.pending import OUTBOX_TTL_MS, Member, PendingIndex
from celery_redislock.policies import (
    LOCK_ACQUIRED,
    Contention,
    ContentionPolicy,
    HandOff,
    Retry,
    RetryInsteadOfSkip,
    RetryWhileOwnDeliveryHolds,
    backend_error_countdown,
    uses_handoff,
)
from celery_redislock.store import AcquireResult
from celery_redislock.takeback import take_back_value
from celery_redislock.tokens import LockOwner, LockValue, new_nonce
from celery_redislock.transport import ScriptCall

if TYPE_CHECKING:
    from celery_redislock.settings import TaskSettings
    from celery_redislock.task import SingletonTaskMixin

__all__ = [
    "CONTENTION_EVENT",
    "Decision",
    "Execution",
    "handoff_policy",
    "on_backend_error",
    "resend",
    "resend_headers",
    "send_contention_event",
]

# The documented logger name: this was part of task.py.
logger = logging.getLogger("celery_redislock.task")

#: Task event sent on contention when task events are on (Flower shows it).
CONTENTION_EVENT = "task-redislock-contended"

#: Longest wait for the lock still held by this task's own previous attempt.
_OWN_RETRY_WAIT = 10.0


class _SecondCopy(Exception):
    """Another copy of this parked execution was already granted the lock."""


def _header(request: Any, name: str) -> Any:
    # Celery flattens custom headers into request attributes in a worker;
    # eager apply() keeps them in ``headers`` only.
    return (request.headers or {}).get(name) or getattr(request, name, None)


def handoff_policy(policy: ContentionPolicy) -> ContentionPolicy:
    """The policy of a run that must run after the holder, never instead of it.

    A coalesced run, a debounced run, and every copy of a parked execution:
    the ``HandOff`` found in ``policy``'s composition, else an unbounded one.
    """
    seen: ContentionPolicy | None = policy
    while seen is not None:
        if isinstance(seen, HandOff):
            return seen
        seen = getattr(seen, "then", None)
    return HandOff(max_wait=None)


class Decision:
    """A value a policy returned instead of running the body."""

    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result


class Execution:
    """One run of a locked task in the worker: what it took, and what it gives back.

    :meth:`give_back` runs in the ``finally`` of ``__call__`` and gives back the
    lock if it was granted (deleting it, handing it to a queued retry, or
    keeping it as an idempotency window), or, if an acquire was interrupted
    before its reply was read, deletes the value that acquire may have
    stored (a compare-and-delete: a no-op if it did not).
    """

    def __init__(
        self,
        task: SingletonTaskMixin,
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
                args, kwargs = task._as_received(args, kwargs, task.serializer)
        self.key = task._key(settings, args, kwargs)
        owner = LockOwner.current(request.id, request.retries or 0, request.hostname)
        self.value = LockValue.new_encoded(owner, task.name)
        headers = request.headers or {}
        self.queued_token = queued_token(request)
        # A copy of this very call that parked (Celery's retry() copies the
        # headers of the attempt before: they are not this call's).
        sent_handoff = _header(request, HANDOFF_HEADER)
        self.handoff: str | None = (
            self.parked_value if sent_handoff and sent_handoff == self.parked_value else None
        )
        # The original message (and its redeliveries and backoff re-sends)
        # is one copy; the woken message and each safety net are others.
        self.copy_tag = str((self.handoff and _header(request, HANDOFF_COPY_HEADER)) or "o")
        #: A coalesced run's queued key and value, freed when it is granted.
        self.queued_slot: tuple[str, str] | None = None
        if settings.coalesce and self.queued_token:
            self.queued_slot = (queued_key(self.key), self.queued_token)
        self.adopt = [
            *([self.queued_token] if self.queued_token and not self.queued_slot else []),
            *([self.handoff] if self.handoff else []),
            *own_values(request, headers.get(UNSETTLED_HEADER)),
        ]
        self._granted: list[AcquireResult] = []
        #: A debounced run: its burst may have moved its due time.
        self.debounced = bool(
            settings.debounce and _header(request, DEBOUNCE_HEADER) and not request.is_eager
        )
        self.from_beat = bool(
            headers.get("celery_beat_task") or getattr(request, "celery_beat_task", None)
        )
        #: Runs after the holder, never instead: every contention parks.
        # (Coalesced and debounced tasks also when their call skipped the
        # producer's step: a canvas member, send_task.)
        self.must_run = bool(self.handoff or settings.coalesce or settings.debounce)
        #: Its first acquire goes through PARK: a copy of a call that parked
        #: (or may have: a lost reply, a redelivery) must learn whether
        #: another copy of the call already ran, and may hold the hand-off.
        self.parks = self.must_run or uses_handoff(
            settings.beat_policy if self.from_beat else settings.policy
        )
        self.handle: LockHandle | None = None
        #: An acquire was sent and its reply not (yet) read.
        self.unsettled = False
        self.keep: tuple[str, float] | None = None

    # -- taking the lock --

    def _acquire(self, wait: float | None = None) -> AcquireResult:
        settings, backend = self.settings, self.settings.backend
        self.unsettled = True
        if wait is None and self.parks:
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
                raise _SecondCopy()
            result = parked.result
        elif settings.limit > 1:
            result = self._acquire_slot(wait)
        elif wait is None:
            result = backend.acquire(
                self.key,
                self.value,
                settings.ttl_ms,
                self.adopt,
                settings.min_replicas,
                settings.min_replicas_timeout,
            )
        else:
            result = backend.acquire_waiting(
                self.key,
                self.value,
                settings.ttl_ms,
                wait,
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

    def _acquire_slot(self, wait: float | None) -> AcquireResult:
        """``lock_limit`` > 1: take any free slot of the key (waiting up to ``wait`` s)."""
        settings, backend = self.settings, self.settings.backend
        task_prefix = LockOwner.task_prefix(self.request.id)
        if wait is None:
            return backend.acquire_slot(
                self.key,
                settings.limit,
                self.value,
                settings.ttl_ms,
                self.adopt,
                task_prefix,
                settings.min_replicas,
                settings.min_replicas_timeout,
            )
        return backend.acquire_waiting(
            self.key,
            self.value,
            settings.ttl_ms,
            wait,
            self.adopt,
            settings.min_replicas,
            settings.min_replicas_timeout,
            limit=settings.limit,
            task_prefix=task_prefix,
        )

    def take_lock(self) -> Decision | None:
        """Take the lock; None means "run the body", else the policy's result."""
        task, request, settings = self.task, self.request, self.settings
        started = clock()
        try:
            if self.debounced:
                self._wait_for_debounce()
            result = self._acquire()
        except LockBackendError as exc:
            self._on_backend_error(exc)
            return None  # lock_on_backend_error="run": run unprotected
        except _SecondCopy:
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
            if self.parks:
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

        lock_retries = int(_header(request, LOCK_RETRIES_HEADER) or 0)
        parked_since = _header(request, PARKED_SINCE_HEADER)
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
        except _SecondCopy:
            self._drop_second_copy()
        if decision is LOCK_ACQUIRED:
            self._grant(granted[-1], started)
            return None
        return Decision(decision)

    def _park(self, countdown: float, exc: Exception, lock_retries: int, parked_since: Any) -> Any:
        """Park behind the holder (see :class:`HandOff`): one round trip, then the safety net.

        Returns :data:`LOCK_ACQUIRED` if the lock was free by then; raises
        ``Retry`` once parked and re-sent, or :class:`_SecondCopy`.
        """
        task, request = self.task, self.request
        handoff = self.parked_value
        extra = {
            HANDOFF_HEADER: handoff,
            PARKED_SINCE_HEADER: parked_since or time.time(),
            LOCK_RETRIES_HEADER: lock_retries + 1,
        }
        message = pack_message(
            task, resend_headers(request, {**extra, HANDOFF_COPY_HEADER: f"w:{new_nonce()}"})
        )
        self.unsettled = True
        try:
            return self._park_and_resend(handoff, message, countdown, exc, extra)
        except (CeleryRetry, _SecondCopy, LockBackendError):
            # Parked and re-sent; or another copy ran; or the store failed
            # (the backoff re-send parks the same call again: one entry).
            raise
        except BaseException:
            # Interrupted (a soft time limit, a SIGTERM-born SystemExit) or
            # the re-send failed, after the park may have run: this call
            # ends here, visibly, so no copy of it may run later.
            self._withdraw()
            raise

    def _park_and_resend(
        self, handoff: str, message: bytes, countdown: float, exc: Exception, extra: dict[str, Any]
    ) -> Any:
        """One round trip (grant, or park), then the safety-net re-send.

        The park also asks the workers' sweep to look at the key (see
        ``pending.py``): if the holder's worker dies, a sweep hands the call
        the lock about a TTL later, whatever became of this worker and of
        the safety-net copy it reserved.
        """
        task, request, settings = self.task, self.request, self.settings
        parked = settings.backend.park(
            self.key,
            self.value,
            settings.ttl_ms,
            handoff,
            self.copy_tag,
            message,
            self.park_ttl_ms,
            self.queued_slot,
            [*self.adopt, handoff],
            settings.limit,
            LockOwner.task_prefix(request.id),
            touch=self.pending.touch_call(Member.parked(self.key, settings.limit), 0),
            after=self._forget_queued_run(),
        )
        self.unsettled = parked.result.acquired
        if parked.already_ran:
            raise _SecondCopy()
        if parked.result.acquired:
            self._granted.append(parked.result)
            return LOCK_ACQUIRED
        # The safety net is for a store that lost the queue: the release, or
        # else a sweep, hands the lock over first (so calls run in the order
        # they parked); one more TTL leaves the sweep that time.
        countdown += settings.ttl
        logger.info(
            "%s[%s] parked behind lock %s; a release hands it over (safety net in %.1fs)",
            task.name,
            request.id,
            self.key,
            countdown,
        )
        return resend(task, countdown, exc, {**extra, HANDOFF_COPY_HEADER: f"f:{new_nonce()}"})

    def _wait_for_debounce(self) -> None:
        """Re-send this debounced run if a later call of its burst moved its due time."""
        request = self.request
        task_id = request.id or ""
        due = self.settings.backend.debounce_due(
            self.key, task_id, after=self.pending.forget_debounced_call(self.key)
        )
        if due > 0:
            logger.info(
                "%s[%s] debounced: a later call moved its run %.3fs ahead",
                self.task.name,
                request.id,
                due,
            )
            resend(self.task, due, LockContended(self.key, None, due), {})

    def _withdraw(self) -> None:
        """Take this call out of the hand-off queue for good (best effort: never raises)."""
        try:
            self.settings.backend.withdraw(
                self.key, self.parked_value, self.park_ttl_ms, self.settings.limit
            )
        except Exception:
            logger.warning(
                "%s[%s]: could not withdraw the parked call from lock %s; a copy of it may "
                "still run",
                self.task.name,
                self.request.id,
                self.key,
                exc_info=True,
            )

    def _drop_second_copy(self) -> NoReturn:
        """Drop this copy: another copy of the same parked execution was granted the lock."""
        logger.info(
            "%s[%s] dropped: another copy of this parked execution already ran (lock %s)",
            self.task.name,
            self.request.id,
            self.key,
        )
        raise Ignore()

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
        signals.lock_contended.send(
            sender=task,
            key=self.key,
            task_name=task.name,
            task_id=self.request.id,
            holder_task_id=result.holder_task_id,
            ttl_remaining=result.known_ttl,
            policy=policy,
        )
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
            received = task._as_received(sig.args or (), dict(sig.kwargs or {}), task.serializer)
            same_key = task._key(self.settings, *received) == self.key
        except LockKeyError:
            same_key = False
        if same_key:
            # The retried message carries the same token and takes it over.
            self.keep = (
                self.queued_token,
                self.settings.enqueue_ttl + seconds_until(retry.when),
            )

    def give_back(self) -> None:
        """Give back what this execution took; safe to call again if interrupted."""
        held = self.task._redislock_held
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


def send_contention_event(
    task: SingletonTaskMixin, key: str, holder: str | None, policy: str
) -> None:
    """Tell monitors (Flower) why this task did not run yet.

    Sent only when the app sends task events (``worker_send_task_events``;
    the worker's ``-E`` flag alone does not reach pool children). A
    failure to send is logged, never raised into the task.
    """
    if not task.app.conf.worker_send_task_events:
        return
    try:
        task.send_event(
            CONTENTION_EVENT,
            retry=False,
            name=task.name,  # it may reach a monitor before task-received (Flower labels by it)
            redislock_key=key,
            redislock_holder=holder,
            redislock_policy=policy,
        )
    except Exception:
        logger.warning("could not send the %s event", CONTENTION_EVENT, exc_info=True)


def on_backend_error(
    task: SingletonTaskMixin,
    settings: TaskSettings,
    key: str,
    exc: LockBackendError,
    unsettled: str,
) -> None:
    """Run unprotected (``"run"``) or re-send with backoff (``"fail"``).

    ``unsettled`` is the value of the acquire that failed: its script may
    still have run (a reply after the timeout), so the re-sent message
    carries it and the retry takes it over.
    """
    request = task.request
    if settings.on_backend_error == "run":
        logger.warning(
            "%s[%s] runs WITHOUT its lock %s (lock_on_backend_error='run'): %s",
            task.name,
            request.id,
            key,
            exc,
        )
        return
    headers = request.headers or {}
    attempts = int(headers.get(BACKEND_RETRIES_HEADER) or 0)
    limit = settings.app.backend_error_max_retries
    if attempts >= limit:
        logger.error(
            "%s[%s] gives up after %d retries: lock store unreachable: %s",
            task.name,
            request.id,
            attempts,
            exc,
        )
        raise exc
    countdown = backend_error_countdown(attempts)
    if request.is_eager:
        logger.warning(
            "%s[%s] retries at once (eager mode runs a retry immediately; "
            "lock store error %d of %d): %s",
            task.name,
            request.id,
            attempts + 1,
            limit,
            exc,
        )
    else:
        logger.warning(
            "%s[%s] will retry in %.1fs (lock store error %d of %d): %s",
            task.name,
            request.id,
            countdown,
            attempts + 1,
            limit,
            exc,
        )
    values = [*own_values(request, headers.get(UNSETTLED_HEADER)), unsettled]
    resend(
        task,
        countdown,
        exc,
        {BACKEND_RETRIES_HEADER: attempts + 1, UNSETTLED_HEADER: values[-MAX_UNSETTLED:]},
    )


def resend_headers(request: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """The headers of a re-send of ``request``: its publisher's, with ``extra`` over them."""
    headers = {**publisher_headers(request.headers), **extra}
    if redelivered(request):
        headers[REDELIVERED_HEADER] = True
    return headers


def resend(
    task: SingletonTaskMixin, countdown: float, exc: Exception, headers: dict[str, Any]
) -> NoReturn:
    """Re-send this execution to run in ``countdown`` seconds, then raise Retry.

    Unlike ``self.retry()``, ``retries`` is not incremented: a lock retry
    must not spend the task's own ``max_retries``. The counters travel in
    message headers instead. The re-send carries ``retries``, so
    ``apply_async`` publishes it even while the key is held.
    """
    request = task.request
    headers = resend_headers(request, headers)
    signature = task.signature_from_request(
        request, countdown=countdown, retries=request.retries or 0, headers=headers
    )
    if request.is_eager:
        # Eager apply() re-runs a Retry's signature at once (no countdown).
        raise CeleryRetry(exc=exc, when=cast(Any, countdown), is_eager=True, sig=signature)
    countdown = routable_countdown(task, signature, countdown)  # one Celery can route
    try:
        signature.apply_async()
    except Exception as publish_error:
        keep_in_outbox(task, signature, countdown, publish_error)
    raise CeleryRetry(exc=exc, when=cast(Any, countdown), sig=signature)


def keep_in_outbox(
    task: SingletonTaskMixin, signature: Any, countdown: float, publish_error: Exception
) -> None:
    """The broker refused a re-send: keep it in the lock store for a worker's sweep.

    The sweep publishes it when due, and again until the broker takes it, so
    the call is not lost with this delivery (already acknowledged, unless
    ``acks_late``). If the store fails too, an ``acks_late`` message is
    rejected back to its queue; any other ends in FAILURE with both errors,
    never silently.
    """
    request = task.request
    settings = task._lock_settings()
    options = {
        name: value for name, value in signature.options.items() if name not in ("countdown", "eta")
    }
    message = pack_signature(
        task.signature(signature.args, signature.kwargs, **options), task.serializer
    )
    try:
        if settings.app.sweep_interval <= 0:
            # Nothing here would ever publish it (redislock_sweep_interval=0).
            raise LockBackendError("this worker does not sweep (redislock_sweep_interval=0)")
        app_pending(task.app, settings.backend, settings.app.key_prefix).put_outbox(
            f"{request.id}:{new_nonce()}", message, int(countdown * 1000), OUTBOX_TTL_MS
        )
    except LockBackendError as store_error:
        if task.acks_late:
            raise Reject(publish_error, requeue=True) from publish_error
        raise LockBackendError(
            f"{task.name}[{request.id}] could not be re-sent (the broker refused it: "
            f"{publish_error}) nor kept for a later re-send ({store_error})"
        ) from publish_error
    logger.warning(
        "%s[%s]: the broker refused its re-send (%s); kept in the lock store, a worker's "
        "sweep publishes it in %.1fs or as soon as the broker takes it",
        task.name,
        request.id,
        publish_error,
        countdown,
    )
