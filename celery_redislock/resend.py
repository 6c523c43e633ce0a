"""Re-sending an execution: lock retries, backoff after a store error, the outbox, the event.

A contended or failed execution in the worker is sent again (with
``retries`` unchanged: a lock retry never spends ``max_retries``) and ends
with Celery's ``Retry``. When the broker refuses the re-send, the lock
store keeps it for a worker's sweep (:func:`keep_in_outbox`). May import:
``brokers``, ``handoff``, ``headers``, ``pending``, ``policies``,
``task_shape``; never ``task`` nor ``execution``.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn, cast

from celery.exceptions import Reject
from celery.exceptions import Retry as CeleryRetry
from celery.utils.time import maybe_iso8601

from celery_redislock import signals
from celery_redislock.brokers import publisher_headers, routable_countdown
from celery_redislock.exceptions import LockBackendError
from celery_redislock.handoff import app_pending, pack_signature, received_serializer
from celery_redislock.headers import (
    BACKEND_RETRIES_HEADER,
    HANDOFF_COPY_HEADER,
    MAX_UNSETTLED,
    REDELIVERED_HEADER,
    UNSETTLED_HEADER,
    aware_eta,
    own_values,
    redelivered,
)
from celery_redislock.key_family import plain_key
from celery_redislock.pending import OUTBOX_TTL_MS
from celery_redislock.policies import backend_error_countdown
from celery_redislock.tokens import new_nonce

if TYPE_CHECKING:
    from celery_redislock.settings import TaskSettings
    from celery_redislock.task_shape import LockedTask

__all__ = [
    "CONTENTION_EVENT",
    "keep_in_outbox",
    "on_backend_error",
    "resend",
    "resend_headers",
    "send_contention_event",
    "signal_contention",
]

# The documented logger name: this was part of task.py.
logger = logging.getLogger("celery_redislock.task")

#: Task event sent on contention when task events are on (Flower shows it).
CONTENTION_EVENT = "task-redislock-contended"


def signal_contention(
    task: LockedTask, key: str, task_id: str | None, holder: str | None, ttl: Any, policy: str
) -> None:
    """Send the ``lock_contended`` signal for a call of ``task``."""
    signals.lock_contended.send(
        sender=task,
        key=key,
        task_name=task.name,
        task_id=task_id,
        holder_task_id=holder,
        ttl_remaining=ttl,
        policy=policy,
    )


def send_contention_event(task: LockedTask, key: str, holder: str | None, policy: str) -> None:
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
            redislock_key=plain_key(key),  # for any event serializer (yaml: exact str only)
            redislock_holder=holder,
            redislock_policy=policy,
        )
    except Exception:
        logger.warning("could not send the %s event", CONTENTION_EVENT, exc_info=True)


def on_backend_error(
    task: LockedTask,
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
    retry = (
        "retries at once (eager mode runs a retry immediately; "
        if request.is_eager
        else f"will retry in {countdown:.1f}s ("
    )
    logger.warning(
        "%s[%s] %slock store error %d of %d): %s",
        task.name,
        request.id,
        retry,
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


def moved_expiry(expires: Any, seconds: float) -> Any:
    """``expires`` as Celery takes it (seconds from now, a datetime, ISO 8601), ``seconds`` later.

    A debounced run's expiry moves with its due time: the window is the
    package's delay, not the caller's, and must not eat into ``expires``.
    """
    if expires is None or seconds <= 0:
        return expires
    if isinstance(expires, (int, float)):
        return expires + seconds
    # Parsed as Celery parses it (dateutil: "Z", "+0000", basic format, on 3.10 too).
    return cast(datetime, maybe_iso8601(expires)) + timedelta(seconds=seconds)


def resend(
    task: LockedTask,
    countdown: float,
    exc: Exception,
    headers: dict[str, Any],
    *,
    move_expiry: bool = False,
) -> NoReturn:
    """Re-send this execution to run in ``countdown`` seconds, then raise Retry.

    Unlike ``self.retry()``, ``retries`` is not incremented: a lock retry
    must not spend the task's own ``max_retries``. The counters travel in
    message headers instead. The re-send carries ``retries``, so
    ``apply_async`` publishes it even while the key is held. With
    ``move_expiry`` (a debounced run moved by a later call), its ``expires``
    moves as far as its due time: from its eta to the countdown as routed.
    """
    request = task.request
    headers = resend_headers(request, headers)
    signature = task.signature_from_request(
        request,
        countdown=countdown,
        retries=request.retries or 0,
        headers=headers,
        serializer=received_serializer(task),
    )
    if request.is_eager:
        # Eager apply() re-runs a Retry's signature at once (no countdown).
        raise CeleryRetry(exc=exc, when=cast(Any, countdown), is_eager=True, sig=signature)
    countdown = routable_countdown(task, signature, countdown)  # one Celery can route
    if move_expiry and request.expires:
        # From the due time it had (its eta; now if none) to the one it gets.
        eta = aware_eta(request.eta)
        moved = countdown + (time.time() - eta.timestamp() if eta is not None else 0.0)
        signature.set(expires=moved_expiry(request.expires, moved))
    try:
        # A copy of a parked call is not retried by kombu (see handoff.publish_copy):
        # refused, it goes to the outbox, which tags each publish afresh.
        signature.apply_async(retry=HANDOFF_COPY_HEADER not in headers)
    except Exception as publish_error:
        keep_in_outbox(task, signature, countdown, publish_error)
    raise CeleryRetry(exc=exc, when=cast(Any, countdown), sig=signature)


def keep_in_outbox(
    task: LockedTask, signature: Any, countdown: float, publish_error: Exception
) -> None:
    """The broker refused a re-send: keep it in the lock store for a worker's sweep.

    The sweep publishes it when due, and again until the broker takes it, so
    the call is not lost with this delivery (already acknowledged, unless
    ``acks_late``). If the store fails too, an ``acks_late`` message is
    rejected back to its queue; any other ends in FAILURE with both errors,
    never silently.
    """
    request = task.request
    settings = task.lock_settings()
    options = {
        name: value for name, value in signature.options.items() if name not in ("countdown", "eta")
    }
    message = pack_signature(
        task.signature(signature.args, signature.kwargs, **options), received_serializer(task)
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
