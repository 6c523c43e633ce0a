"""Enqueue-time dedup (``lock_enqueue``): take the key in ``apply_async``, before publishing.

Runs in the producer. The key is computed from the arguments as the worker
will receive them (a serializer round trip), and stores a *queued* value
naming the task id; the worker's acquire takes that value over. A duplicate
is not published: the caller gets the holder's ``AsyncResult`` or
:class:`~celery_redislock.exceptions.AlreadyQueued`. A task is never lost:
when the lock store fails, the task is published without its enqueue lock.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from celery.utils import uuid

from celery_redislock.brokers import whole_second_delays, whole_seconds
from celery_redislock.exceptions import AlreadyQueued, LockBackendError
from celery_redislock.handoff import app_pending, keep_revocable, stored_message
from celery_redislock.headers import (
    DEBOUNCE_HEADER,
    QUEUED_TOKEN_HEADER,
    UNSETTLED_HEADER,
    as_received,
    seconds_until,
)
from celery_redislock.key_family import family_of
from celery_redislock.pending import Member, RevocableCall
from celery_redislock.resend import moved_expiry, signal_contention
from celery_redislock.store import AcquireResult, LockStore
from celery_redislock.takeback import take_back_value
from celery_redislock.tokens import LockValue

if TYPE_CHECKING:
    from celery_redislock.settings import TaskSettings
    from celery_redislock.task_shape import LockedTask

__all__ = ["publish_once"]

# The documented logger name: enqueue-time dedup was part of task.py.
logger = logging.getLogger("celery_redislock.task")

# Canvas members and tasks carrying callbacks are always published: dropping
# one would break a chord's counter or lose the rest of a workflow.
_BYPASS_OPTIONS = ("chord", "group_id", "chain", "link", "link_error")


def _workflow_member(options: dict[str, Any]) -> bool:
    """``options`` are a workflow member's, or carry a callback.

    Celery's own sends count too, whose caller waits on the id Celery gave
    (joined to another run, it would stay PENDING for ever): a chain's last
    member (the tracer passes ``chain=[]``, present though empty), a callback
    or the next link (the tracer passes ``parent_id``; a ``delay()`` in a
    task body does not, Celery adds it later), and a ``Task.replace()``
    (``replaced_task_nesting``).
    """
    return (
        options.get("chain") is not None
        or options.get("parent_id") is not None
        or bool(options.get("replaced_task_nesting"))
        or any(options.get(name) for name in _BYPASS_OPTIONS)
    )


Publish = Callable[..., Any]

#: Seconds an enqueue lock outlives its message's ``expires`` (clock skew
#: between the producer and the worker that checks it).
_EXPIRY_MARGIN = 1.0


def _producer_store(settings: TaskSettings) -> LockStore:
    """The store of the calls ``delay()`` makes before publishing.

    Its connections give up within ``redislock_enqueue_timeout``; give-backs
    (:func:`take_back_value`) go through the task's own store, whose releases
    publish a hand-off.
    """
    return settings.enqueue_backend or settings.backend


def publish_once(
    task: LockedTask,
    publish: Publish,
    args: Sequence[Any] | None,
    kwargs: dict[str, Any] | None,
    options: dict[str, Any],
) -> Any:
    """Publish ``task`` with ``publish`` (Celery's ``apply_async``), with ``lock_enqueue`` once.

    With ``lock_enqueue`` on, it publishes only if the key is free (with
    ``"until_start"``, only if no run of the key is queued and not started).

    Re-sends of an existing task id (``self.retry()``, a lock retry,
    Celery's ``retry_on_worker_lost``: they carry ``retries``), canvas
    members and tasks carrying callbacks are always published; their run is
    still protected by the worker-side lock.
    """
    settings = task.lock_settings()
    if (
        not (settings.enabled and (settings.enqueue or settings.debounce))
        or task.app.conf.task_always_eager
        or options.get("retries") is not None
        or _workflow_member(options)
    ):
        return publish(None if args is None else tuple(args), kwargs, **options)
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    received = as_received(args, kwargs, options.get("serializer") or task.serializer, task.name)
    key = task.lock_key_for_received(*received, settings)
    if settings.debounce:
        return _publish_debounced(task, settings, publish, key, args, kwargs, options)
    # Celery applies the task's own ``expires`` after this (its apply_async).
    expires = options["expires"] if "expires" in options else getattr(task, "expires", None)
    if settings.coalesce and expires is not None:
        # The calls that join a queued run share its fate: one that may
        # expire before it starts would take them along (review helper-44
        # F2). It is published as a run of its own, which nobody joins; at
        # the worker it waits behind the holder as every coalesced run does.
        return publish(args, kwargs, **options)
    task_id = options.pop("task_id", None) or uuid()
    token = LockValue.queued(task_id, task.name).encode()
    delay = seconds_until(options.get("eta") or options.get("countdown"))
    ttl = settings.enqueue_ttl + delay
    if expires is not None:
        # Never past the message's own expiry: RabbitMQ drops an expired
        # message itself (Celery sets its expiration), so no worker sees it
        # to revoke it and free this key.
        ttl = min(ttl, seconds_until(expires) + _EXPIRY_MARGIN)
    headers = {**(options.pop("headers", None) or {}), QUEUED_TOKEN_HEADER: token}
    lock_key = key
    if settings.coalesce:
        # Held only until the run starts: the worker frees this key in the
        # round trip that grants it the lock, so a later call publishes the
        # next run instead of joining one that may have read stale data.
        key = family_of(lock_key).queued

    def take(adopt: str = "") -> AcquireResult:
        if settings.coalesce:
            queue_options = {**options, "headers": headers}
            run = (task, settings, lock_key, task_id, token, ttl, delay, args, kwargs)
            return _queue_run(*run, queue_options, adopt)
        adopting = (adopt,) if adopt else ()
        return _producer_store(settings).acquire(key, token, max(int(ttl * 1000), 1), adopting)

    try:
        result = take()
        revoked = "" if result.acquired else _revoked_holder(task, settings, result)
        if revoked:  # a run revoked while its message waits in a queue: its key is ours
            result = take(revoked)
    except LockBackendError as exc:
        # Never drop the task: publish it. The acquire may have run after
        # all (a late reply), so the message lists its token as one to
        # take over instead of contending with. And since the token may
        # equally land after the task has run, it is taken back in the
        # background. The message's own queued token is a fresh one: a
        # retry's hand-off keeps *that*, which the take-back can never
        # mistake for the late one.
        logger.warning("publishing %s[%s] without its enqueue lock: %s", task.name, task_id, exc)
        headers[QUEUED_TOKEN_HEADER] = LockValue.queued(task_id, task.name).encode()
        headers[UNSETTLED_HEADER] = [token]
        try:
            return publish(args, kwargs, task_id=task_id, headers=headers, **options)
        finally:
            take_back_value(settings.backend, key, token, now=False)  # the store just failed
    except BaseException:
        # Interrupted: the key may hold a token for a task never published.
        take_back_value(settings.backend, key, token)
        raise
    if not result.acquired:
        return _duplicate(task, settings, key, task_id, result)
    if delay > 0 and whole_second_delays(task.app, task, options, args, kwargs):
        call = RevocableCall(task.name, lock_key, token, False)
        keep_revocable(
            task.app, _producer_store(settings), settings.app.key_prefix, task_id, call, delay
        )
    try:
        return publish(args, kwargs, task_id=task_id, headers=headers, **options)
    except BaseException as exc:
        copy_runs = (
            _withdraw_run(task, settings, lock_key, token, task_id, exc)
            if settings.coalesce
            else None
        )
        if copy_runs and isinstance(exc, Exception):
            return task.AsyncResult(task_id)
        if copy_runs is None:  # not withdrawn (the store failed, or not coalescing)
            take_back_value(settings.backend, key, token)  # nothing was queued: free the key
        raise  # an interruption leaves the run's key to the copy that runs


def _withdraw_run(
    task: LockedTask,
    settings: TaskSettings,
    key: str,
    token: str,
    task_id: str,
    error: BaseException,
) -> bool | None:
    """After a coalesced run's publish failed: withdraw it, or learn that a copy of it runs.

    A publish slower than the grace (a broker down, kombu retrying) looks to
    the workers' sweep like a worker that died with the message: it
    publishes the stored copy. Once that copy reached a worker (granted or
    parked) it runs, so the call is reported published (its handle), not
    failed. Otherwise the call is withdrawn.

    Returns:
        True: a copy runs; False: withdrawn (its keys are free); None: the
        store failed (nothing known: the caller takes the value back).
    """
    pending = app_pending(task.app, _producer_store(settings), settings.app.key_prefix)
    handoff = LockValue.parked(task_id, 0, task.name).encode()  # as stored_message made it
    try:
        runs = pending.withdraw_run(key, token, task_id, handoff)
    except LockBackendError:
        return None
    if runs:
        logger.warning(
            "publishing %s[%s] failed (%r), but a copy a worker's sweep published "
            "already reached a worker: it runs under this id",
            task.name,
            task_id,
            error,
        )
    return runs


def _grace(settings: TaskSettings) -> float:
    """Seconds a sweep waits past a run's due time before it publishes a copy.

    The lock TTL (how long a holder's death goes unnoticed), at most half
    the enqueue TTL: the run's key and record must outlive the first copy.
    """
    return min(settings.ttl, settings.enqueue_ttl / 2)


def _queue_run(
    task: LockedTask,
    settings: TaskSettings,
    key: str,
    task_id: str,
    token: str,
    ttl: float,
    delay: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
    adopt: str = "",
) -> AcquireResult:
    """Take ``key``'s queued key for a coalesced run and keep its message (one round trip)."""
    handoff, message = stored_message(task, args, kwargs, task_id, options, options["headers"])
    pending = app_pending(task.app, _producer_store(settings), settings.app.key_prefix)
    grace = _grace(settings)
    queued, holder, remaining = pending.queue_run(
        key,
        token,
        max(int(ttl * 1000), 1),
        handoff,
        message,
        int((delay + grace) * 1000),
        task_id,
        int(grace * 1000),
        adopt,
    )
    return AcquireResult(queued, holder, remaining)


def _revoked_holder(task: LockedTask, settings: TaskSettings, result: AcquireResult) -> str:
    """The holder's value if it is a call revoked while its message waits in a queue, else ''.

    No worker holds that message to give its key back before it reaches
    one (maybe long after); the workers mark the call revoked instead
    (``revoked.py``), and this call takes the key over. Read only when the
    key is taken by a queued call: one ``GET`` more for a duplicate.
    """
    holder = result.holder_value
    if holder is None or not holder.is_queued or not holder.owner.task_id:
        return ""
    pending = app_pending(task.app, _producer_store(settings), settings.app.key_prefix)
    try:
        revoked = pending.was_revoked(holder.owner.task_id)
    except LockBackendError:
        return ""  # not known: join it, as before a revoke
    return (result.holder or "") if revoked else ""


def _publish_debounced(
    task: LockedTask,
    settings: TaskSettings,
    publish: Publish,
    key: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
) -> Any:
    """Trailing debounce: the first call of a burst publishes the run, later calls move it.

    The run is published with a countdown of one window; each later call of
    the burst pushes its due time to a window after itself (at most
    ``debounce_max_wait`` after the burst's first call) and gets the run's
    ``AsyncResult``. The worker re-sends the run while its due time is
    still ahead (see ``Execution``). A call after the run started begins a
    new burst, so the last call is always followed by a run.
    """
    task_id = options.pop("task_id", None) or uuid()
    window_ms = max(int(settings.debounce * 1000), 1)
    grace_ms = max(int(_grace(settings) * 1000), 1)
    delay_ms = int(seconds_until(options.get("eta") or options.get("countdown")) * 1000)
    # The window is the package's delay: the run expires that much later,
    # and a worker moves its expiry with its due time. The sweep's copy (for
    # a run whose worker died) keeps none: the burst may have moved its due
    # time since, and a late run beats none.
    expires = options.pop("expires", task.expires)
    handoff, message = stored_message(
        task,
        args,
        kwargs,
        task_id,
        options,
        {**(options.get("headers") or {}), DEBOUNCE_HEADER: True},
    )
    pending = app_pending(task.app, _producer_store(settings), settings.app.key_prefix)
    try:
        new, burst_id, due = _producer_store(settings).debounce(
            key,
            task_id,
            window_ms,
            max(int(settings.debounce_max_wait * 1000), 1),
            message,
            handoff,
            pending.touch_call(Member.debounced(key), max(window_ms, delay_ms) + grace_ms),
            grace_ms,
            delay_ms,
        )
    except LockBackendError as exc:
        # Never drop the call: publish it now, undebounced (the run-time
        # lock still keeps runs apart). It still says it is debounced: if
        # the record was written after all (a reply lost after the script
        # ran), the run ends that burst when it starts, instead of leaving
        # later calls to join a run that is over.
        logger.warning("publishing %s[%s] without its debounce: %s", task.name, task_id, exc)
        headers = {**(options.pop("headers", None) or {}), DEBOUNCE_HEADER: True}
        return publish(args, kwargs, task_id=task_id, headers=headers, expires=expires, **options)
    except BaseException:
        # Interrupted: the record may name a run never published.
        with contextlib.suppress(Exception):
            _producer_store(settings).debounce_due(key, task_id, forget=True)
        raise
    if not new:
        logger.debug("%s[%s] joins the debounced run %s of %s", task.name, task_id, burst_id, key)
        signal_contention(task, key, task_id, burst_id, due, "debounced")
        return task.AsyncResult(burst_id)
    headers = {**(options.pop("headers", None) or {}), DEBOUNCE_HEADER: True}
    countdown = max(due, seconds_until(options.pop("eta", None) or options.pop("countdown", None)))
    if whole_second_delays(task.app, task, options, args, kwargs):
        countdown = whole_seconds(countdown)  # native delayed delivery: never under 1 s
        # The burst may move the run (re-sent by a worker) up to its max wait.
        due = countdown + settings.debounce_max_wait
        call = RevocableCall(task.name, key, None, True)
        keep_revocable(
            task.app, _producer_store(settings), settings.app.key_prefix, task_id, call, due
        )
    # As far as the countdown really is (whole seconds on quorum queues).
    expires = moved_expiry(expires, countdown - delay_ms / 1000)
    try:
        return publish(
            args,
            kwargs,
            task_id=task_id,
            headers=headers,
            countdown=countdown,
            expires=expires,
            **options,
        )
    except BaseException:
        with contextlib.suppress(Exception):
            _producer_store(settings).debounce_due(key, task_id, forget=True)  # nothing was queued
        raise


def _duplicate(
    task: LockedTask,
    settings: TaskSettings,
    key: str,
    task_id: str,
    result: AcquireResult,
) -> Any:
    """Not published: the holder's result, or :class:`AlreadyQueued`."""
    holder = result.holder_task_id
    logger.info("%s[%s] not published: %s already holds lock %s", task.name, task_id, holder, key)
    signal_contention(task, key, task_id, holder, result.known_ttl, "deduplicated")
    if settings.enqueue_raise or holder is None:
        raise AlreadyQueued(key, holder, result.ttl_remaining)
    return task.AsyncResult(holder)
