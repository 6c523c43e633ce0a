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
  child dies holding a lock (SIGKILL, OOM, a hard time limit, revoke with
  ``terminate``), the parent releases it by owner prefix (task id, attempt,
  node, pid: see ``tokens.py``), which can never match a later attempt, and
  only once the child has exited.
* A whole worker killed at once is covered by the TTL (30 s by default),
  which renewal keeps alive only while the holder's process lives.

Direct calls (``task(x)``) are plain function calls, as in Celery, and take
no lock; ``task.apply()`` and ``task_always_eager`` do lock.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import random
import signal as signals_module
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NoReturn, cast

from billiard.exceptions import (
    Terminated,
    TimeLimitExceeded,
    WorkerLostError,
)
from celery import Task
from celery.exceptions import Ignore, Reject
from celery.exceptions import Retry as CeleryRetry
from celery.signals import task_revoked
from celery.utils import uuid
from celery.utils.threads import LocalStack
from celery.utils.time import maybe_iso8601, maybe_make_aware
from celery.worker.request import Request
from kombu.serialization import dumps as kombu_dumps
from kombu.serialization import loads as kombu_loads

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
from celery_redislock.exceptions import (
    AlreadyQueued,
    ConfigurationError,
    LockBackendError,
    LockKeyError,
)
from celery_redislock.interrupt import interrupter_for_current_thread
from celery_redislock.keys import bind_lock_arguments, custom_key, task_key, validate_lock_args
from celery_redislock.lock import LockHandle, validate_ttl
from celery_redislock.policies import (
    LOCK_ACQUIRED,
    Contention,
    ContentionPolicy,
    RetryInsteadOfSkip,
    RetryWhileOwnDeliveryHolds,
    resolve_policy,
)
from celery_redislock.takeback import take_back_value
from celery_redislock.tokens import LockOwner, LockValue

__all__ = [
    "BACKEND_RETRIES_HEADER",
    "LOCK_RETRIES_HEADER",
    "QUEUED_TOKEN_HEADER",
    "UNSETTLED_HEADER",
    "SingletonRequest",
    "SingletonTask",
    "SingletonTaskMixin",
]

logger = logging.getLogger("celery_redislock.task")

#: Message header counting retries caused by contention.
LOCK_RETRIES_HEADER = "redislock_lock_retries"
#: Message header counting retries caused by an unreachable lock store.
BACKEND_RETRIES_HEADER = "redislock_backend_retries"
#: Message header listing the values of this execution's earlier acquires
#: whose replies were lost (a lock-store error): the retry takes them over.
UNSETTLED_HEADER = "redislock_unsettled"
#: Set on the re-send of a redelivered message: it stays a redelivered copy
#: (retried, never skipped, while its key is held) however often it is re-sent.
REDELIVERED_HEADER = "redislock_redelivered"
#: At most this many unsettled values travel in the header.
_MAX_UNSETTLED = 16

#: Message header carrying the value a producer stored at enqueue time.
QUEUED_TOKEN_HEADER = "redislock_token"

#: Longest wait for a SIGKILLed pool child to exit before its lock is released.
_KILLED_EXIT_WAIT = 5.0
#: Signals a billiard child turns into SystemExit (its ``finally`` releases the
#: lock), and the longest wait for that release. SIGINT is ignored by children.
_STOPPING_SIGNALS = (signals_module.SIGTERM, signals_module.SIGQUIT, signals_module.SIGHUP)
_STOPPING_RELEASE_WAIT = 1.0
#: billiard's grace between SIGTERM and SIGKILL at a hard time limit.
_HARD_LIMIT_GRACE = 0.1

#: Task event sent on contention when task events are on (Flower shows it).
CONTENTION_EVENT = "task-redislock-contended"

#: Longest wait for the lock still held by this task's own previous attempt.
_OWN_RETRY_WAIT = 10.0

# Canvas members and tasks carrying callbacks are always published: dropping
# one would break a chord's counter or lose the rest of a workflow.
_ENQUEUE_BYPASS_OPTIONS = ("chord", "group_id", "chain", "link", "link_error")

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
        execution: _Execution | None = self._redislock_held.top
        return None if execution is None else execution.handle

    def lock_key_for(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        """Return the lock key of a call with ``args`` and ``kwargs``.

        It is the key the worker computes from the message: the arguments
        are taken through the task's serializer first (a tuple arrives as a
        list under JSON, a NumPy float as a plain float).

        Raises:
            LockKeyError: the arguments cannot be serialized or keyed.
        """
        settings = self._lock_settings()
        args, kwargs = self._as_received(args, kwargs or {}, self.serializer)
        return self._key(settings, args, kwargs)

    def _as_received(
        self, args: Sequence[Any], kwargs: dict[str, Any], serializer: str | None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments as a worker will receive them: a round trip through ``serializer``.

        The key must be computed from what the worker sees, or the producer's
        enqueue lock could never be taken over by the worker (measured: a
        NumPy float gave one key in the producer and another in the worker).
        """
        try:
            content_type, encoding, body = kombu_dumps(
                (list(args), dict(kwargs)), serializer=serializer or "json"
            )
            received = kombu_loads(body, content_type, encoding, accept={content_type})
        except Exception as exc:
            raise LockKeyError(
                f"{self.name}: the arguments cannot be sent with the {serializer!r} "
                f"serializer: {exc}"
            ) from exc
        return tuple(received[0]), dict(received[1])

    def _key(self, settings: TaskSettings, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        """The key of a call whose arguments are as the worker receives them."""
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
        :class:`AlreadyQueued` with ``lock_enqueue_raise``. Re-sends of an
        existing task id (``self.retry()``, a lock retry, Celery's
        ``retry_on_worker_lost``: they carry ``retries``), canvas members and
        tasks carrying callbacks are always published; their run is still
        protected by the worker-side lock.
        """
        settings = self._lock_settings()
        if (
            not (settings.enabled and settings.enqueue)
            or self.app.conf.task_always_eager
            or options.get("retries") is not None
            or any(options.get(name) for name in _ENQUEUE_BYPASS_OPTIONS)
        ):
            return super().apply_async(None if args is None else tuple(args), kwargs, **options)
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        received = self._as_received(args, kwargs, options.get("serializer") or self.serializer)
        key = self._key(settings, *received)
        task_id = options.pop("task_id", None) or uuid()
        token = LockValue.queued(task_id, self.name).encode()
        ttl = settings.enqueue_ttl + _seconds_until(options.get("eta") or options.get("countdown"))
        headers = {**(options.pop("headers", None) or {}), QUEUED_TOKEN_HEADER: token}
        try:
            result = settings.backend.acquire(key, token, max(int(ttl * 1000), 1))
        except LockBackendError as exc:
            # Never drop the task: publish it. The acquire may have run after
            # all (a late reply), so the message lists its token as one to
            # take over instead of contending with. And since the token may
            # equally land after the task has run, it is taken back in the
            # background. The message's own queued token is a fresh one: a
            # retry's hand-off keeps *that*, which the take-back can never
            # mistake for the late one.
            logger.warning(
                "publishing %s[%s] without its enqueue lock: %s", self.name, task_id, exc
            )
            headers[QUEUED_TOKEN_HEADER] = LockValue.queued(task_id, self.name).encode()
            headers[UNSETTLED_HEADER] = [token]
            try:
                return super().apply_async(
                    args, kwargs, task_id=task_id, headers=headers, **options
                )
            finally:
                _take_back(settings, key, token, now=False)  # the store just failed
        except BaseException:
            # Interrupted: the key may hold a token for a task never published.
            _take_back(settings, key, token)
            raise
        if not result.acquired:
            return self._duplicate(settings, key, task_id, result)
        try:
            return super().apply_async(args, kwargs, task_id=task_id, headers=headers, **options)
        except BaseException:
            _take_back(settings, key, token)  # nothing was queued: free the key
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
        """Free the key of a queued task that will never run (revoked, expired).

        ``args`` and ``kwargs`` are the message's, as the worker received them.
        """
        settings = self._lock_settings()
        if settings.enabled:
            settings.backend.release(self._key(settings, args, kwargs or {}), token)

    # -- the execution ---------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body under the lock: take it, run, give it back in one ``try/finally``.

        Whatever lands between two lines (a soft time limit, an abort, a
        SIGTERM-born ``SystemExit``, ``KeyboardInterrupt``), the ``finally``
        gives back exactly what was taken: the lock if granted, or the value
        an acquire may have stored if it was interrupted before its reply.
        """
        request = self.request
        if request.called_directly:
            return super().__call__(*args, **kwargs)
        settings = self._lock_settings()
        if not settings.enabled:
            return super().__call__(*args, **kwargs)
        execution = _Execution(self, settings, args, kwargs)
        try:
            decision = execution.take_lock()
            if decision is not None:
                return decision.result
            self._redislock_held.push(execution)
            result = super().__call__(*args, **kwargs)
            execution.succeeded()
            return result
        except CeleryRetry as retry:
            execution.retrying(retry)
            raise
        finally:
            # Inline, not in a helper: an exception landing on a helper's
            # first instruction would escape before its own ``try``.
            try:
                execution.give_back()
            except BaseException:
                execution.give_back()  # once more, then re-raise: deferred, not lost
                raise

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

    def _on_backend_error(
        self, settings: TaskSettings, key: str, exc: LockBackendError, unsettled: str
    ) -> None:
        """Run unprotected (``"run"``) or re-send with backoff (``"fail"``).

        ``unsettled`` is the value of the acquire that failed: its script may
        still have run (a reply after the timeout), so the re-sent message
        carries it and the retry takes it over.
        """
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
        headers = request.headers or {}
        attempts = int(headers.get(BACKEND_RETRIES_HEADER) or 0)
        limit = settings.app.backend_error_max_retries
        if attempts >= limit:
            logger.error(
                "%s[%s] gives up after %d retries: lock store unreachable: %s",
                self.name,
                request.id,
                attempts,
                exc,
            )
            raise exc
        countdown = min(2.0**attempts, 60.0) * random.uniform(0.5, 1.0)
        if request.is_eager:
            logger.warning(
                "%s[%s] retries at once (eager mode runs a retry immediately; "
                "lock store error %d of %d): %s",
                self.name,
                request.id,
                attempts + 1,
                limit,
                exc,
            )
        else:
            logger.warning(
                "%s[%s] will retry in %.1fs (lock store error %d of %d): %s",
                self.name,
                request.id,
                countdown,
                attempts + 1,
                limit,
                exc,
            )
        values = [*_own_values(request, headers.get(UNSETTLED_HEADER)), unsettled]
        self._resend(
            countdown,
            exc,
            {BACKEND_RETRIES_HEADER: attempts + 1, UNSETTLED_HEADER: values[-_MAX_UNSETTLED:]},
        )

    def _resend(self, countdown: float, exc: Exception, headers: dict[str, Any]) -> NoReturn:
        """Re-send this execution to run in ``countdown`` seconds, then raise Retry.

        Unlike ``self.retry()``, ``retries`` is not incremented: a lock retry
        must not spend the task's own ``max_retries``. The counters travel in
        message headers instead. The re-send carries ``retries``, so
        ``apply_async`` publishes it even while the key is held.
        """
        request = self.request
        headers = {**(request.headers or {}), **headers}
        headers.pop("redelivered", None)  # set by kombu's Redis transport; not ours to copy
        if _redelivered(request):
            headers[REDELIVERED_HEADER] = True
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

    def wait_for_release(
        self,
        task_id: str,
        attempt: int,
        hostname: str,
        pid: int | None,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> bool:
        """Wait until the lock of that attempt in that process is released (worker parent side).

        Returns True once it is (or when locking is off); False after ``timeout``.
        """
        settings = self._lock_settings()
        if not settings.enabled:
            return True
        key = self._key(settings, args, kwargs)
        prefix = LockOwner(task_id, attempt, hostname, pid).prefix()
        return settings.backend.wait_released(key, prefix, timeout)

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
        """Release the lock of an execution whose process ended (worker parent side).

        Matches on the owner prefix, so it releases only the lock taken by
        exactly that attempt in exactly that process. ``args`` and ``kwargs``
        are the message's, as the worker received them.
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


class _Execution:
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
        self.value = LockValue.new(owner, task.name).encode()
        headers = request.headers or {}
        self.queued_token = _queued_token(request)
        self.adopt = [
            *([self.queued_token] if self.queued_token else []),
            *_own_values(request, headers.get(UNSETTLED_HEADER)),
        ]
        self.handle: LockHandle | None = None
        #: An acquire was sent and its reply not (yet) read.
        self.unsettled = False
        self.keep: tuple[str, float] | None = None

    # -- taking the lock --

    def _acquire(self, wait: float | None = None) -> AcquireResult:
        settings, backend = self.settings, self.settings.backend
        self.unsettled = True
        if wait is None:
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

    def take_lock(self) -> _Result | None:
        """Take the lock; None means "run the body", else the policy's result."""
        task, request, settings = self.task, self.request, self.settings
        started = clock()
        try:
            result = self._acquire()
        except LockBackendError as exc:
            self._on_backend_error(exc)
            return None  # lock_on_backend_error="run": run unprotected
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
            logger.info(
                "%s[%s] delivered again after it succeeded; dropped (lock %s kept its window)",
                task.name,
                request.id,
                self.key,
            )
            raise Ignore()
        granted: list[AcquireResult] = []

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

        headers = dict(request.headers or {})
        lock_retries = int(headers.get(LOCK_RETRIES_HEADER) or 0)
        contention = Contention(
            key=self.key,
            task_name=task.name,
            task_id=request.id,
            holder_task_id=result.holder_task_id,
            ttl_remaining=result.ttl_remaining,
            redelivered=_redelivered(request),
            lock_retries=lock_retries,
            wait_for_lock=wait_for_lock,
            retry_later=lambda countdown, exc: task._resend(
                countdown, exc, {LOCK_RETRIES_HEADER: lock_retries + 1}
            ),
        )
        from_beat = bool(
            headers.get("celery_beat_task") or getattr(request, "celery_beat_task", None)
        )
        policy = settings.beat_policy if from_beat else settings.policy
        if contention.holder_task_id == request.id:
            policy = RetryWhileOwnDeliveryHolds(policy)
        elif contention.redelivered:
            policy = RetryInsteadOfSkip(policy)
        logger.info(
            "%s[%s] not running: lock %s is held by %s (expires in %s s); policy %s",
            task.name,
            request.id,
            self.key,
            contention.holder_task_id or "an unknown holder",
            "?" if result.ttl_remaining is None else f"{result.ttl_remaining:.3f}",
            policy.name,
        )
        self._contended(result, policy.name)
        try:
            decision = policy.handle(contention)
        except LockBackendError as exc:  # the store failed while a policy waited
            self._on_backend_error(exc)
            return None  # lock_on_backend_error="run": run unprotected
        if decision is LOCK_ACQUIRED:
            self._grant(granted[-1], started)
            return None
        return _Result(decision)

    def _on_backend_error(self, exc: LockBackendError) -> None:
        """The store failed: re-send with backoff (taking this value over), or run unprotected.

        Returns (None: run the body) only with ``lock_on_backend_error="run"``.
        """
        self.unsettled = False
        # The acquire may land after all: after this execution ran without
        # its lock ("run"), or after the re-send ("fail") ran and released.
        # The re-send also carries the value, to take it over if it is there.
        _take_back(self.settings, self.key, self.value, now=False)
        self.task._on_backend_error(self.settings, self.key, exc, self.value)

    def _contended(self, result: AcquireResult, policy: str) -> None:
        task = self.task
        signals.lock_contended.send(
            sender=task,
            key=self.key,
            task_name=task.name,
            task_id=self.request.id,
            holder_task_id=result.holder_task_id,
            ttl_remaining=result.ttl_remaining,
            policy=policy,
        )
        task._send_contention_event(self.key, result.holder_task_id, policy)

    def _grant(self, result: AcquireResult, started: float) -> None:
        task, settings = self.task, self.settings
        handle = LockHandle(
            settings.backend,
            self.key,
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
            key=self.key,
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
        if not (self.settings.enqueue and self.queued_token) or sig is None:
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
                self.settings.enqueue_ttl + _seconds_until(retry.when),
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
            _take_back(self.settings, self.key, self.value)
            self.unsettled = False


def _redelivered(request: Any) -> bool:
    """This message was delivered before (or is the re-send of one that was)."""
    return bool(
        (request.delivery_info or {}).get("redelivered")
        or (request.headers or {}).get(REDELIVERED_HEADER)
    )


def _take_back(settings: TaskSettings, key: str, token: str, *, now: bool = True) -> None:
    """Take back a value an acquire may have stored although nobody will use it.

    The queued token of a task that was never published (or was published
    without it), or the value of an acquire whose reply never came. Such an
    acquire may still run once the lock store answers, and its value would
    block the key for its TTL: see :mod:`celery_redislock.takeback`.
    """
    take_back_value(settings.backend, key, token, now=now)


class SingletonTask(SingletonTaskMixin, _Task):
    """A Celery ``Task`` that runs at most once at a time per lock key."""


class SingletonRequest(Request):
    """Worker request that releases a pool child's lock from the parent, once the child exited.

    billiard calls the failure handler of a hard time limit *before* it
    kills the child, and Celery stores REVOKED right after sending
    ``terminate``'s signal: a release at those moments would let a
    duplicate start while the child still runs. So the parent ends the
    child (as billiard is about to) or waits for it to exit, and releases
    only then, before Celery stores the outcome: ``result.get()`` returning
    means the lock is free.
    """

    def on_timeout(self, soft: bool, timeout: float) -> None:
        """A hard time limit: end the child, then release its lock."""
        if not soft:
            self._release_after_exit("hard time limit", kill=True)
        super().on_timeout(soft, timeout)

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        """The child died (WorkerLostError, terminated) or hit its hard time limit."""
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # unwrap billiard's ExceptionWithTraceback
        if isinstance(exc, TimeLimitExceeded):
            self._release_after_exit("hard time limit", kill=True)
        elif isinstance(exc, (WorkerLostError, Terminated)):
            self._release_child_lock(type(exc).__name__, self._will_be_resent(exc))
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    #: Set when a terminated child has not released its lock in time: Celery's
    #: REVOKED is then announced when the child has exited (``Terminated``).
    _redislock_defer_revoked = False

    def terminate(self, pool: Any, signal: Any = None) -> None:
        """``revoke(terminate=True)``: REVOKED only once the child's lock is released."""
        super().terminate(self._releasing(pool), signal)

    def _announce_revoked(self, reason: Any, terminated: Any, signum: Any, expired: Any) -> None:
        # Celery announces REVOKED right after sending terminate's signal, and
        # again (unless already announced) when billiard reports the child
        # ``Terminated``, which it does once the child has exited. While the
        # child still holds its lock, the first announcement is held back.
        if self._redislock_defer_revoked:
            self._redislock_defer_revoked = False
            return
        super()._announce_revoked(reason, terminated, signum, expired)  # type: ignore[misc]

    def cancel(self, pool: Any, signal: Any = None, emit_retry: bool = True) -> None:
        """Cold shutdown: release once the signalled child has exited."""
        super().cancel(self._releasing(pool), signal, emit_retry=emit_retry)

    def _releasing(self, pool: Any) -> Any:
        if self.time_start and _is_running_child(self.worker_pid):
            return _ReleaseAfterExit(pool, self)
        return pool

    def _will_be_resent(self, exc: BaseException) -> bool:
        """Whether Celery puts this message back (so its key should wait for it).

        Mirrors ``celery.worker.request.Request.on_failure``: a lost worker is
        re-sent with ``retry_on_worker_lost`` while retries remain, or
        requeued with ``acks_late`` and ``reject_on_worker_lost``.
        """
        if not isinstance(exc, WorkerLostError):
            return False
        task = self.task
        if getattr(task, "retry_on_worker_lost", False):
            retries = int(self.request_dict.get("retries") or 0)
            max_retries = task.max_retries
            return max_retries is None or retries < max_retries
        return bool(task.acks_late and task.reject_on_worker_lost)

    def _release_after_exit(self, reason: str, kill: bool) -> None:
        pid = self.worker_pid
        if isinstance(pid, int) and _is_running_child(pid):
            if kill:
                # What billiard does right after this handler: SIGTERM, a
                # 0.1 s grace for the child's own finally, then SIGKILL.
                _signal(pid, signals_module.SIGTERM)
                if not _exited(pid, _HARD_LIMIT_GRACE):
                    _signal(pid, signals_module.SIGKILL)
            if not _exited(pid, _KILLED_EXIT_WAIT):
                logger.error(
                    "%s[%s]: pool process %s is still running after %s; its lock %s",
                    self.name,
                    self.id,
                    pid,
                    reason,
                    "is left to its own release or its TTL",
                )
                return
        self._release_child_lock(reason)

    def _wait_for_child_release(self, timeout: float) -> bool:
        """Wait for the signalled child's own ``finally`` to release its lock.

        Not for its exit: a billiard child exits only once this (the parent's)
        event loop runs again (measured: its key was free after 23 ms, its
        exit came when a 1 s wait for it ended).
        """
        task = self.task
        if not isinstance(task, SingletonTaskMixin):
            return True
        try:
            released = task.wait_for_release(
                self.id,
                int(self.request_dict.get("retries") or 0),
                self.hostname,
                int(self.worker_pid) if self.worker_pid else None,
                self.args,
                self.kwargs,
                timeout,
            )
        except Exception:
            logger.exception("could not watch the lock of %s[%s]", self.name, self.id)
            return False
        if not released:
            logger.warning(
                "%s[%s]: pool process %s still holds its lock %.1fs after the signal; "
                "REVOKED is stored once the process has exited",
                self.name,
                self.id,
                self.worker_pid,
                timeout,
            )
        return released

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


class _ReleaseAfterExit:
    """A pool whose ``terminate_job`` returns once the child's lock is released, or defers.

    After SIGKILL: once the child has exited, the parent releases it. After
    a signal the child turns into ``SystemExit``: its own ``finally``
    releases, and the parent waits for that (bounded). If the bound passes
    first, Celery's REVOKED waits for the child's exit.
    """

    def __init__(self, pool: Any, request: SingletonRequest) -> None:
        self._pool = pool
        self._request = request

    def terminate_job(self, pid: int, signal: Any = None) -> None:
        self._pool.terminate_job(pid, signal)
        request = self._request
        signum = signals_module.Signals(signal or signals_module.SIGTERM)
        if signum is signals_module.SIGKILL:
            released = _exited(pid, _KILLED_EXIT_WAIT)
            if released:
                request._release_child_lock("terminated")
        elif signum in _STOPPING_SIGNALS:
            released = request._wait_for_child_release(_STOPPING_RELEASE_WAIT)
        else:
            return  # a signal the child survives (SIGUSR1: a soft time limit)
        # Not yet: announce REVOKED when billiard reports the exit (Terminated).
        request._redislock_defer_revoked = not released

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def _is_running_child(pid: Any) -> bool:
    """True if ``pid`` is a child process of this one that has not exited.

    False for the threads, solo and gevent pools, whose "pid" is this
    process (or a greenlet's id).
    """
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except (ChildProcessError, OverflowError, OSError):
        return False


def _exited(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for child ``pid`` to exit (left for billiard to reap)."""
    deadline = clock() + timeout
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True  # already reaped by billiard
        if clock() >= deadline:
            return False
        time.sleep(0.001)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _queued_token(request: Any) -> str | None:
    """The enqueue-time value a message carries, if it is this task's own."""
    token = (request.headers or {}).get(QUEUED_TOKEN_HEADER) or getattr(
        request, QUEUED_TOKEN_HEADER, None
    )
    own = _own_values(request, [token])
    return own[0] if own else None


def _own_values(request: Any, values: Any) -> list[str]:
    """The values in a header that belong to this task id (a header cannot take another's lock)."""
    if not isinstance(values, (list, tuple)):
        return []
    own = []
    for value in values:
        if isinstance(value, str):
            decoded = LockValue.decode(value)
            if decoded is not None and decoded.owner.task_id == request.id:
                own.append(value)
    return own


def _seconds_until(when: Any) -> float:
    """Seconds from now until a countdown (number) or an ETA (datetime or ISO 8601).

    A naive ETA is UTC, as Celery reads it.
    """
    if when is None:
        return 0.0
    if isinstance(when, (int, float)):
        return max(float(when), 0.0)
    if isinstance(when, str):
        when = maybe_iso8601(when)
    if isinstance(when, datetime):
        eta = maybe_make_aware(when)
        return max((eta - datetime.now(timezone.utc)).total_seconds(), 0.0)
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
