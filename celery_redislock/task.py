"""The Celery wiring: where the lock is taken, released and backed up.

* :meth:`SingletonTaskMixin.__call__` takes the lock before the body and
  releases it in a ``finally``, in one stack frame. Celery calls an
  overridden ``__call__`` for every execution, eager or in a worker, and the
  ``finally`` runs for every outcome inside the process: success, exception,
  ``self.retry()``, ``Ignore``, ``Reject``, ``SoftTimeLimitExceeded`` and the
  ``SystemExit`` that revoke-with-terminate, cold shutdown and the hard time
  limit's SIGTERM raise in a pool child. It runs before Celery stores the
  result, so ``result.get()`` returning means the lock is free.
* :class:`SingletonRequest` runs in the worker's parent process. When a pool
  child dies holding a lock (SIGKILL, OOM, the SIGKILL that follows a hard
  time limit), the parent releases it by owner prefix (task id, attempt,
  node, pid: see ``tokens.py``), which can never match a later attempt.
* A whole worker killed at once is covered by the TTL (30 s by default),
  which renewal keeps alive only while the holder's process lives.

Direct calls (``task(x)``) are plain function calls, as in Celery, and take
no lock; ``task.apply()`` and ``task_always_eager`` do lock.
"""

from __future__ import annotations

import inspect
import logging
import random
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn, cast

from billiard.exceptions import (
    SoftTimeLimitExceeded,
    Terminated,
    TimeLimitExceeded,
    WorkerLostError,
)
from celery import Task
from celery.exceptions import Reject
from celery.exceptions import Retry as CeleryRetry
from celery.signals import task_revoked
from celery.utils import uuid
from celery.utils.threads import LocalStack
from celery.worker.request import Request

from celery_redislock import signals
from celery_redislock._clock import clock
from celery_redislock.backend import AcquireResult, ReleaseOutcome
from celery_redislock.config import (
    AppSettings,
    TaskSettings,
    app_settings,
    validate_backend_error_mode,
    validate_count,
    validate_hold,
    validate_lost_mode,
)
from celery_redislock.exceptions import AlreadyQueued, ConfigurationError, LockBackendError
from celery_redislock.interrupt import interrupter_for_current_thread
from celery_redislock.keys import bind_lock_arguments, custom_key, task_key, validate_lock_args
from celery_redislock.lock import LockHandle, validate_ttl
from celery_redislock.policies import (
    LOCK_ACQUIRED,
    Contention,
    ContentionPolicy,
    Retry,
    Skip,
    resolve_policy,
)
from celery_redislock.tokens import LockOwner, LockValue

__all__ = [
    "BACKEND_RETRIES_HEADER",
    "LOCK_RETRIES_HEADER",
    "QUEUED_TOKEN_HEADER",
    "SingletonRequest",
    "SingletonTask",
    "SingletonTaskMixin",
]

logger = logging.getLogger("celery_redislock.task")

#: Message header counting retries caused by contention.
LOCK_RETRIES_HEADER = "redislock_lock_retries"
#: Message header counting retries caused by an unreachable lock store.
BACKEND_RETRIES_HEADER = "redislock_backend_retries"

# Parent-side release happens only for outcomes where the child may not have
# reached (or finished) its own ``finally``.
_ABNORMAL_EXITS = (
    WorkerLostError,
    TimeLimitExceeded,
    SoftTimeLimitExceeded,
    Terminated,
    SystemExit,
    KeyboardInterrupt,
)

#: Message header carrying the value a producer stored at enqueue time.
QUEUED_TOKEN_HEADER = "redislock_token"
#: Hostname field of a queued (not yet running) lock value.
QUEUED_HOST = "<queued>"

#: Task event sent on contention when task events are on (Flower shows it).
CONTENTION_EVENT = "task-redislock-contended"

#: Longest wait for the lock still held by this task's own previous attempt.
_OWN_RETRY_WAIT = 10.0

# Canvas members and tasks carrying callbacks are always published: dropping
# one would break a chord's counter or lose the rest of a workflow. Retries
# (same task id) are the owner coming back, never a duplicate.
_ENQUEUE_BYPASS_OPTIONS = ("retries", "chord", "group_id", "chain", "link", "link_error")

if TYPE_CHECKING:
    _TaskBase = Task[Any, Any]
    _Task = Task[Any, Any]
else:
    _TaskBase = object
    _Task = Task


def _run_signature(cls: type) -> inspect.Signature | None:
    """Return the signature of ``cls.run`` without ``self``, or None if abstract."""
    for klass in cls.__mro__:
        if "run" in vars(klass):
            attribute = vars(klass)["run"]
            break
    else:
        return None
    if klass is Task:
        return None
    if isinstance(attribute, staticmethod):
        return inspect.signature(attribute.__func__)
    signature = inspect.signature(attribute)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


class SingletonTaskMixin(_TaskBase):
    """Makes a Celery task a singleton per lock key; combine with any Task base.

    Attributes set on the class or as ``@app.task(...)`` options; ``None``
    inherits the app setting of the same meaning (see the README).

    Attributes:
        lock_args: Names of the ``run`` parameters that make up the key;
            ``None`` uses all of them, ``()`` the task name alone.
        lock_key: ``callable(args, kwargs) -> str`` giving the key yourself;
            tasks returning the same string share one lock.
        lock_ttl: Lock time to live in seconds (renewed every ``ttl/3``).
        lock_on_contention: ``"skip"``, ``"retry"``, ``"raise"``, ``"wait"``
            or a :class:`~celery_redislock.policies.ContentionPolicy`.
        lock_on_backend_error: ``"fail"`` (do not run unprotected: retry with
            backoff) or ``"run"`` (run without the lock, with a WARNING).
        lock_enabled: False turns the lock off for this task.
        lock_enqueue: Also take the lock in ``apply_async``/``delay``, before
            publishing: a duplicate call is not published and gets the
            holder's ``AsyncResult`` (or :class:`AlreadyQueued`).
        lock_enqueue_ttl: Seconds a queued (not yet started) task holds its
            key; a countdown or ETA is added to it.
        lock_enqueue_raise: A duplicate ``delay()`` raises
            :class:`AlreadyQueued` instead of returning the holder's result.
        lock_hold_after_success: Keep the key this many seconds after a
            successful run, so a late duplicate is still deduplicated.
        lock_beat_on_contention: Policy for runs sent by celery beat
            (default ``"skip"``).
        lock_on_lost: ``"report"`` (default: flag, signal, ERROR log) or
            ``"abort"`` (also raise :class:`LockLost` inside the running body
            where the pool allows it; see ``interrupt.py``).
        lock_min_replicas: After taking the lock, wait (``WAIT``) until this
            many replicas have it; if they do not within
            ``lock_min_replicas_timeout`` seconds, release it and treat the
            acquisition as a lock-store error (``lock_on_backend_error``).
        lock_min_replicas_timeout: Longest wait for the replicas (default 1 s).
    """

    lock_args: Sequence[str] | None = None
    lock_key: Callable[[tuple[Any, ...], dict[str, Any]], str] | None = None
    lock_ttl: float | None = None
    lock_on_contention: str | ContentionPolicy | None = None
    lock_on_backend_error: str | None = None
    lock_enabled: bool | None = None
    lock_enqueue: bool | None = None
    lock_enqueue_ttl: float | None = None
    lock_enqueue_raise: bool | None = None
    lock_hold_after_success: float | None = None
    lock_beat_on_contention: str | ContentionPolicy | None = None
    lock_on_lost: str | None = None
    lock_min_replicas: int | None = None
    lock_min_replicas_timeout: float | None = None

    #: The worker's request class; it adds the parent-side release.
    Request = "celery_redislock.task:SingletonRequest"

    _redislock_signature: inspect.Signature | None = None
    # Thread- (or greenlet-) local, like Celery's request stack: one task
    # instance serves every thread of the threads pool at once.
    _redislock_held: Any = LocalStack()
    _redislock_settings: tuple[AppSettings, TaskSettings] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        where = f"task {vars(cls).get('name') or cls.__qualname__}"
        cls._redislock_signature = _run_signature(cls)
        cls._redislock_held = LocalStack()
        validators: dict[str, Callable[[Any, str], Any]] = {
            "lock_ttl": validate_ttl,
            "lock_enqueue_ttl": validate_ttl,
            "lock_on_contention": resolve_policy,
            "lock_beat_on_contention": resolve_policy,
            "lock_on_lost": validate_lost_mode,
            "lock_hold_after_success": validate_hold,
            "lock_on_backend_error": validate_backend_error_mode,
            "lock_min_replicas": validate_count,
            "lock_min_replicas_timeout": validate_ttl,
        }
        for attribute, validate in validators.items():
            value = getattr(cls, attribute)
            if value is not None:
                validate(value, f"{where}: {attribute}")
        if cls.lock_key is not None and not callable(cls.lock_key):
            raise ConfigurationError(f"{where}: lock_key must be callable, got {cls.lock_key!r}")
        if cls.lock_key is not None and cls.lock_args is not None:
            raise ConfigurationError(f"{where}: set lock_args or lock_key, not both")
        if cls.lock_args is not None and cls._redislock_signature is not None:
            validate_lock_args(cls._redislock_signature, cls.lock_args, where)

    # -- public helpers ----------------------------------------------------------

    @property
    def lock(self) -> LockHandle | None:
        """The lock held by the running execution (``None`` when unlocked).

        ``self.lock.lost`` turns True if the renewer finds the lock gone or
        taken over; ``self.lock.owned`` is a zero-round-trip validity check.
        """
        held: LockHandle | None = self._redislock_held.top
        return held

    def lock_key_for(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        """Return the lock key of a call with ``args`` and ``kwargs``.

        Raises:
            LockKeyError: the arguments cannot be encoded into a key.
        """
        return self._key(self._lock_settings(), args, kwargs)

    def _key(self, settings: TaskSettings, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        prefix = settings.app.key_prefix
        key_function = type(self).lock_key
        if key_function is not None:
            return custom_key(prefix, key_function, args, kwargs or {}, self.name)
        signature = self._redislock_signature or inspect.signature(self.run)
        lock_args = None if self.lock_args is None else tuple(self.lock_args)
        arguments = bind_lock_arguments(signature, args, kwargs or {}, lock_args, self.name)
        return task_key(prefix, self.name, arguments)

    def _lock_settings(self) -> TaskSettings:
        app = app_settings(self.app)
        cached = self._redislock_settings
        if cached is None or cached[0] is not app:
            cached = (app, TaskSettings.merge(self, app))
            self._redislock_settings = cached
        return cached[1]

    # -- enqueue time ------------------------------------------------------------------

    def apply_async(  # type: ignore[override]
        self,
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        """Publish the task; with ``lock_enqueue``, only if its key is free.

        A duplicate is not published: it returns the holder's ``AsyncResult``
        (so ``.get()`` gives the first task's result), or raises
        :class:`AlreadyQueued` with ``lock_enqueue_raise``. Retries, canvas
        members and tasks carrying callbacks are always published (their run
        is still protected by the worker-side lock).
        """
        settings = self._lock_settings()
        if (
            not (settings.enabled and settings.enqueue)
            or self.app.conf.task_always_eager
            or any(options.get(name) for name in _ENQUEUE_BYPASS_OPTIONS)
        ):
            return super().apply_async(None if args is None else tuple(args), kwargs, **options)
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        key = self._key(settings, args, kwargs)
        task_id = options.pop("task_id", None) or uuid()
        token = LockValue.new(LockOwner(task_id, 0, QUEUED_HOST, None), self.name).encode()
        ttl = settings.enqueue_ttl + _seconds_until(options.get("eta") or options.get("countdown"))
        try:
            result = settings.backend.acquire(key, token, max(int(ttl * 1000), 1))
        except LockBackendError as exc:
            # Never drop the task: publish without the enqueue lock; the
            # worker's run-time lock still keeps executions apart.
            logger.warning(
                "publishing %s[%s] without its enqueue lock: %s", self.name, task_id, exc
            )
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        if not result.acquired:
            return self._duplicate(settings, key, task_id, result)
        headers = {**(options.pop("headers", None) or {}), QUEUED_TOKEN_HEADER: token}
        try:
            return super().apply_async(args, kwargs, task_id=task_id, headers=headers, **options)
        except BaseException:
            settings.backend.release(key, token)  # nothing was queued: free the key
            raise

    def _duplicate(
        self, settings: TaskSettings, key: str, task_id: str, result: AcquireResult
    ) -> Any:
        holder = result.holder_task_id
        logger.info(
            "%s[%s] not published: %s already holds lock %s", self.name, task_id, holder, key
        )
        signals.lock_contended.send(
            sender=self,
            key=key,
            task_name=self.name,
            task_id=task_id,
            holder_task_id=holder,
            ttl_remaining=result.ttl_remaining,
            policy="deduplicated",
        )
        if settings.enqueue_raise or holder is None:
            raise AlreadyQueued(key, holder, result.ttl_remaining)
        return self.AsyncResult(holder)

    def release_queued_lock(self, args: Sequence[Any], kwargs: dict[str, Any], token: str) -> None:
        """Free the key of a queued task that will never run (revoked, expired)."""
        settings = self._lock_settings()
        if settings.enabled:
            settings.backend.release(self._key(settings, args, kwargs or {}), token)

    # -- the execution ---------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body under the lock: acquire, run, release in one ``try/finally``."""
        request = self.request
        if request.called_directly:
            return super().__call__(*args, **kwargs)
        settings = self._lock_settings()
        if not settings.enabled:
            return super().__call__(*args, **kwargs)
        outcome = self._take_lock(settings, args, kwargs)
        if not isinstance(outcome, LockHandle) and outcome is not None:
            return outcome.result
        keep: tuple[str, float] | None = None
        self._redislock_held.push(outcome)
        try:
            result = super().__call__(*args, **kwargs)
            if settings.hold_after_success and outcome is not None:
                # An idempotency window: a late duplicate still finds the key.
                keep = (outcome.value, settings.hold_after_success)
            return result
        except CeleryRetry as retry:
            token = _queued_token(request)
            if settings.enqueue and token:
                # The retry keeps ownership: the key goes back to the queued
                # value that the retried message carries and will adopt.
                keep = (token, settings.enqueue_ttl + _seconds_until(retry.when))
            raise
        finally:
            self._redislock_held.pop()
            if outcome is not None:
                outcome.release(*keep) if keep else outcome.release()

    def _take_lock(
        self, settings: TaskSettings, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> LockHandle | _Result | None:
        """Return the held lock, a result to return instead of running, or None.

        None means "run unprotected" (lock store down, ``on_backend_error="run"``).
        """
        request = self.request
        key = self._key(settings, args, kwargs)
        owner = LockOwner.current(request.id, request.retries or 0, request.hostname)
        value = LockValue.new(owner, self.name).encode()
        started = clock()
        adopt = _queued_token(request) or ""
        try:
            result = settings.backend.acquire(
                key,
                value,
                settings.ttl_ms,
                adopt,
                settings.min_replicas,
                settings.min_replicas_timeout,
            )
        except LockBackendError as exc:
            self._on_backend_error(settings, key, exc)
            return None
        if result.acquired:
            return self._granted(settings, key, value, result, started)

        granted: list[AcquireResult] = []

        def wait_for_lock(timeout: float) -> bool:
            waited = settings.backend.acquire_waiting(
                key,
                value,
                settings.ttl_ms,
                timeout,
                adopt,
                settings.min_replicas,
                settings.min_replicas_timeout,
            )
            if waited.acquired:
                granted.append(waited)
            return waited.acquired

        holder = LockValue.decode(result.holder) if result.holder else None
        holder_task_id = holder.owner.task_id or None if holder is not None else None
        if (
            holder is not None
            and holder.owner.task_id == request.id
            and holder.owner.attempt < (request.retries or 0)
            and wait_for_lock(min(result.ttl_remaining or _OWN_RETRY_WAIT, _OWN_RETRY_WAIT))
        ):
            # Our own previous attempt raised Retry and published this
            # message just before its ``finally`` released the lock: the
            # release is a moment away, so wait for it instead of retrying.
            return self._granted(settings, key, value, granted[-1], started)

        headers = dict(request.headers or {})
        lock_retries = int(headers.get(LOCK_RETRIES_HEADER) or 0)
        contention = Contention(
            key=key,
            task_name=self.name,
            task_id=request.id,
            holder_task_id=holder_task_id,
            ttl_remaining=result.ttl_remaining,
            redelivered=bool((request.delivery_info or {}).get("redelivered")),
            lock_retries=lock_retries,
            wait_for_lock=wait_for_lock,
            retry_later=lambda countdown, exc: self._resend(
                countdown, exc, {LOCK_RETRIES_HEADER: lock_retries + 1}
            ),
        )
        from_beat = bool(
            headers.get("celery_beat_task") or getattr(request, "celery_beat_task", None)
        )
        policy = settings.beat_policy if from_beat else settings.policy
        if isinstance(policy, Skip) and (
            contention.redelivered or contention.holder_task_id == request.id
        ):
            # A redelivered copy may be the only surviving one (its first
            # run died holding the lock): retry it, never drop it.
            policy = Retry()
        logger.info(
            "%s[%s] not running: lock %s is held by %s (expires in %s s); policy %s",
            self.name,
            request.id,
            key,
            contention.holder_task_id or "an unknown holder",
            "?" if result.ttl_remaining is None else f"{result.ttl_remaining:.3f}",
            policy.name,
        )
        signals.lock_contended.send(
            sender=self,
            key=key,
            task_name=self.name,
            task_id=request.id,
            holder_task_id=contention.holder_task_id,
            ttl_remaining=result.ttl_remaining,
            policy=policy.name,
        )
        self._send_contention_event(key, contention.holder_task_id, policy.name)
        decision = policy.handle(contention)
        if decision is LOCK_ACQUIRED:
            return self._granted(settings, key, value, granted[-1], started)
        return _Result(decision)

    def _send_contention_event(self, key: str, holder: str | None, policy: str) -> None:
        """Tell monitors (Flower) why this task did not run yet.

        Sent only when the app sends task events (``worker_send_task_events``;
        the worker's ``-E`` flag alone does not reach pool children). A
        failure to send is logged, never raised into the task.
        """
        if not self.app.conf.worker_send_task_events:
            return
        try:
            self.send_event(
                CONTENTION_EVENT,
                retry=False,
                redislock_key=key,
                redislock_holder=holder,
                redislock_policy=policy,
            )
        except Exception:
            logger.warning("could not send the %s event", CONTENTION_EVENT, exc_info=True)

    def _granted(
        self,
        settings: TaskSettings,
        key: str,
        value: str,
        result: AcquireResult,
        started: float,
    ) -> LockHandle:
        handle = LockHandle(
            settings.backend,
            key,
            value,
            settings.ttl,
            result.sent_at,
            task_name=self.name,
            task_id=self.request.id,
            sender=self,
            fence=result.fence,
        )
        handle.on_lost(self.on_lock_lost)
        if settings.on_lost == "abort":
            interrupt = interrupter_for_current_thread()
            if interrupt is not None:
                handle.on_lost(interrupt)
        signals.lock_acquired.send(
            sender=self,
            key=key,
            task_name=self.name,
            task_id=self.request.id,
            waited=clock() - started,
            fence=result.fence,
        )
        return handle

    def _on_backend_error(self, settings: TaskSettings, key: str, exc: LockBackendError) -> None:
        request = self.request
        if settings.on_backend_error == "run":
            logger.warning(
                "%s[%s] runs WITHOUT its lock %s (lock_on_backend_error='run'): %s",
                self.name,
                request.id,
                key,
                exc,
            )
            return
        attempts = int((request.headers or {}).get(BACKEND_RETRIES_HEADER) or 0)
        if attempts >= settings.app.backend_error_max_retries:
            logger.error(
                "%s[%s] gives up after %d retries: lock store unreachable: %s",
                self.name,
                request.id,
                attempts,
                exc,
            )
            raise exc
        countdown = min(2.0**attempts, 60.0) * random.uniform(0.5, 1.0)
        logger.warning(
            "%s[%s] will retry in %.1fs (lock store error %d of %d): %s",
            self.name,
            request.id,
            countdown,
            attempts + 1,
            settings.app.backend_error_max_retries,
            exc,
        )
        self._resend(countdown, exc, {BACKEND_RETRIES_HEADER: attempts + 1})

    def _resend(self, countdown: float, exc: Exception, counters: dict[str, int]) -> NoReturn:
        """Re-send this execution to run in ``countdown`` seconds, then raise Retry.

        Unlike ``self.retry()``, ``retries`` is not incremented: a lock retry
        must not spend the task's own ``max_retries``. The counters travel in
        message headers instead.
        """
        request = self.request
        headers = {**(request.headers or {}), **counters}
        headers.pop("redelivered", None)  # set by kombu's Redis transport; not ours to copy
        signature = self.signature_from_request(
            request, countdown=countdown, retries=request.retries or 0, headers=headers
        )
        if request.is_eager:
            # Eager apply() re-runs a Retry's signature at once (no countdown).
            raise CeleryRetry(exc=exc, when=cast(Any, countdown), is_eager=True, sig=signature)
        try:
            signature.apply_async()
        except Exception as publish_error:
            raise Reject(publish_error, requeue=False) from publish_error
        raise CeleryRetry(exc=exc, when=cast(Any, countdown), sig=signature)

    def on_lock_lost(self, handle: LockHandle) -> None:
        """Called from the renewer thread when this execution's lock is lost.

        Override it to react (it must not block). The default does nothing:
        the loss is already logged, signalled and visible as
        ``self.lock.lost``.
        """

    # -- parent-side backstop ------------------------------------------------------------

    def release_dead_child_lock(
        self,
        task_id: str,
        attempt: int,
        hostname: str,
        pid: int | None,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        reason: str,
        requeued_token: str | None = None,
    ) -> ReleaseOutcome | None:
        """Release the lock of an execution whose process died (worker parent side).

        Matches on the owner prefix, so it releases only the lock taken by
        exactly that attempt in exactly that process.
        """
        settings = self._lock_settings()
        if not settings.enabled:
            return None
        key = self._key(settings, args, kwargs)
        owner = LockOwner(task_id, attempt, hostname, pid)
        if requeued_token and settings.enqueue:
            # The message goes back to the queue (retry_on_worker_lost, or
            # acks_late + reject_on_worker_lost): keep its key for it.
            ttl = settings.enqueue_ttl + float(self.default_retry_delay or 0)
            return settings.backend.release_owner(
                key, owner.prefix(), requeued_token, int(ttl * 1000)
            )
        outcome = settings.backend.release_owner(key, owner.prefix())
        if outcome is ReleaseOutcome.RELEASED:
            logger.warning(
                "released lock %s of %s[%s] attempt %d after its process %s ended abnormally (%s)",
                key,
                self.name,
                task_id,
                attempt,
                pid,
                reason,
            )
        return outcome


class _Result:
    """A value a policy returned instead of running the body."""

    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result


class SingletonTask(SingletonTaskMixin, _Task):
    """A Celery ``Task`` that runs at most once at a time per lock key."""


class SingletonRequest(Request):
    """Worker request that releases a dead pool child's lock from the parent."""

    def on_timeout(self, soft: bool, timeout: float) -> None:
        """After a hard time limit killed the child, release its lock here."""
        if not soft:
            self._release_child_lock("hard time limit")
        super().on_timeout(soft, timeout)

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        """When the child died (WorkerLostError, terminate), release its lock here."""
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # unwrap billiard's ExceptionWithTraceback
        if isinstance(exc, _ABNORMAL_EXITS):
            task = self.task
            requeued = isinstance(exc, WorkerLostError) and bool(
                getattr(task, "retry_on_worker_lost", False)
                or (task.acks_late and task.reject_on_worker_lost)
            )
            self._release_child_lock(type(exc).__name__, requeued)
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def _release_child_lock(self, reason: str, requeued: bool = False) -> None:
        task = self.task
        if not isinstance(task, SingletonTaskMixin):
            return
        token = None
        if requeued:
            headers = self.request_dict.get("headers") or {}
            token = headers.get(QUEUED_TOKEN_HEADER) or self.request_dict.get(QUEUED_TOKEN_HEADER)
        try:
            task.release_dead_child_lock(
                self.id,
                int(self.request_dict.get("retries") or 0),
                self.hostname,
                int(self.worker_pid) if self.worker_pid else None,
                self.args,
                self.kwargs,
                reason,
                token,
            )
        except Exception:
            logger.exception(
                "could not release the lock of %s[%s] (%s)", self.name, self.id, reason
            )


def _queued_token(request: Any) -> str | None:
    """The enqueue-time value a message carries, if it is this task's own."""
    token = (request.headers or {}).get(QUEUED_TOKEN_HEADER) or getattr(
        request, QUEUED_TOKEN_HEADER, None
    )
    if not isinstance(token, str):
        return None
    decoded = LockValue.decode(token)
    if decoded is None or decoded.owner.task_id != request.id:
        return None
    return token


def _seconds_until(when: Any) -> float:
    """Seconds from now until a countdown (number) or an ETA (datetime/ISO)."""
    if when is None:
        return 0.0
    if isinstance(when, (int, float)):
        return max(float(when), 0.0)
    if isinstance(when, str):
        when = datetime.fromisoformat(when)
    if isinstance(when, datetime):
        now = datetime.now(when.tzinfo) if when.tzinfo else datetime.now()
        return max((when - now).total_seconds(), 0.0)
    return 0.0


@task_revoked.connect
def _release_revoked_queued_lock(
    sender: Any = None, request: Any = None, terminated: bool = False, **kwargs: Any
) -> None:
    """A task revoked or expired before it started frees its enqueue-time key.

    Runs in the worker's main process. A running execution has already
    replaced the queued value with its own, which this compare leaves alone.
    """
    if not isinstance(sender, SingletonTaskMixin) or request is None or terminated:
        return
    token = _queued_token(request)
    if token is None:
        return
    try:
        sender.release_queued_lock(request.args or (), request.kwargs or {}, token)
    except Exception:
        logger.exception(
            "could not free the queued lock of revoked %s[%s]", sender.name, request.id
        )
