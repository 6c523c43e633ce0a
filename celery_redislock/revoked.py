"""Worker's parent: a task revoked or expired before it started gives back its keys.

Celery discards a revoked message when it reaches it: at once for one still
in the queue, but a message the worker holds for its countdown (an ETA, a
debounced run's window) only when the countdown ends, maybe hours later. Until
then every call of its key would join a run that never comes (``lock_enqueue``,
coalescing, debounce). So the keys are given back twice, the second time
a no-op (each is a compare-and-delete of this task's own value):

* when the ``revoke`` (or ``terminate``) control command reaches the worker
  that holds the message, for a message it has not started
  (:func:`install_revoke_hook`, wrapping Celery's command: Celery has no
  signal for a revoke received); where no worker holds it (RabbitMQ's
  native delayed delivery keeps a countdown in the broker), from the record
  ``delay()`` kept of what to give back (:class:`~.pending.RevocableCall`);
* when Celery discards the message (``task_revoked``,
  :func:`release_revoked_queued_lock`).

Runs in the worker's main process, never in a pool child.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from celery.signals import task_revoked, worker_init
from celery.utils.functional import maybe_list
from celery.worker import state as worker_state
from celery.worker.control import Panel

from celery_redislock.brokers import delays_wait_in_the_broker
from celery_redislock.exceptions import LockBackendError
from celery_redislock.handoff import app_pending, marker_ttl_ms
from celery_redislock.headers import (
    DEBOUNCE_HEADER,
    HANDOFF_HEADER,
    own_values,
    queued_token,
    request_header,
)
from celery_redislock.key_family import family_of
from celery_redislock.settings import app_settings
from celery_redislock.startup import uses_redislock
from celery_redislock.task import SingletonTaskMixin

__all__ = ["install_revoke_hook", "release_queued_lock", "release_revoked_queued_lock"]

# The documented logger name: the parent side was part of task.py.
logger = logging.getLogger("celery_redislock.task")

#: Celery's control commands that revoke, wrapped by :func:`install_revoke_hook`.
_REVOKING_COMMANDS = ("revoke", "terminate")


def release_queued_lock(
    task: SingletonTaskMixin, args: Sequence[Any], kwargs: dict[str, Any], token: str
) -> None:
    """Free the key of a queued task that will never run (revoked, expired).

    ``args`` and ``kwargs`` are the message's, as the worker received them.
    """
    settings = task.lock_settings()
    if settings.enabled:
        key = task.lock_key_for_received(args, kwargs or {}, settings)
        settings.backend.release(family_of(key).queued if settings.coalesce else key, token)


def _forget_revoked_burst(task: SingletonTaskMixin, request: Any) -> None:
    """A debounced run revoked or expired before it started ends its burst.

    Otherwise later calls would join a run that never comes until the
    record expires.
    """
    try:
        settings = task.lock_settings()
        if settings.enabled and settings.debounce:
            key = task.lock_key_for_received(request.args or (), request.kwargs or {}, settings)
            settings.backend.debounce_due(key, request.id or "", forget=True)
    except Exception:
        logger.exception(
            "could not end the debounce burst of revoked %s[%s]", task.name, request.id
        )


def _release_revoked_handoff(task: SingletonTaskMixin, request: Any, handoff: str) -> None:
    """A parked call revoked or expired before it ran leaves the queue for good.

    Withdrawn: no copy of it runs later, a sweep never hands it a slot again
    (its message would otherwise stay, and be published every hand-off
    TTL), and a lock already handed to it passes to the next parked call.
    """
    try:
        settings = task.lock_settings()
        if settings.enabled:
            key = task.lock_key_for_received(request.args or (), request.kwargs or {}, settings)
            park_ttl_ms = marker_ttl_ms(task.app.conf, settings.enqueue_ttl, settings.ttl)
            settings.backend.withdraw(key, handoff, park_ttl_ms, settings.limit)
    except Exception:
        logger.exception("could not free the lock handed to revoked %s[%s]", task.name, request.id)


@task_revoked.connect
def release_revoked_queued_lock(
    sender: Any = None, request: Any = None, terminated: bool = False, **kwargs: Any
) -> None:
    """A task revoked or expired before it started frees its enqueue-time key.

    Runs in the worker's main process. A running execution has already
    replaced the queued value with its own, which this compare leaves alone.
    """
    if (
        not isinstance(sender, SingletonTaskMixin)
        or request is None
        or terminated
        or getattr(request, "redislock_given_back", False)  # by SingletonRequest, first
    ):
        return
    if request_header(request, DEBOUNCE_HEADER):
        _forget_revoked_burst(sender, request)
    handoff = own_values(request, [(request.headers or {}).get(HANDOFF_HEADER)])
    if handoff:
        _release_revoked_handoff(sender, request, handoff[0])
    token = queued_token(request)
    if token is None:
        return
    try:
        release_queued_lock(sender, request.args or (), request.kwargs or {}, token)
    except Exception:
        logger.exception(
            "could not free the queued lock of revoked %s[%s]", sender.name, request.id
        )


def _snapshot(requests: Iterable[Any]) -> list[Any]:
    """A copy of one of Celery's request sets (a timer thread may change it meanwhile)."""
    for _ in range(5):
        try:
            return list(requests)
        except RuntimeError:  # changed size during iteration: copy again
            continue
    return []


def _not_started(task_id: str) -> list[Any]:
    """This worker's requests for ``task_id`` that it holds and has not started.

    Held for a countdown, or prefetched and not yet handed to the pool (a
    request handed over may already run: its execution gives the keys back).
    Found in Celery's sets too, not only by id: a copy re-sent with the same
    id (``self.retry(countdown=...)``, a parked call's safety net) arrives
    while the attempt that sent it runs, whose end then forgets the id.
    """
    candidates = [worker_state.requests.get(task_id)]
    # scheduled_requests: Celery >= 5.7 keeps the countdown's requests apart.
    scheduled = getattr(worker_state, "scheduled_requests", ())
    for requests in (scheduled, worker_state.reserved_requests):
        candidates += [request for request in _snapshot(requests) if request.id == task_id]
    found: list[Any] = []
    for request in candidates:
        if (
            request is None
            or any(request is other for other in found)
            or request in worker_state.active_requests
            or getattr(request, "_apply_result", None) is not None
            or getattr(request, "time_start", None) is not None
        ):
            continue
        found.append(request)
    return found


def _give_back_revoked(app: Any, task_ids: Sequence[str]) -> None:
    in_the_broker = []
    for task_id in task_ids:
        held = _not_started(task_id)
        for request in held:
            if isinstance(request.task, SingletonTaskMixin):
                # The message's own context: what task_revoked passes when
                # Celery discards it later (args, kwargs, headers as received).
                release_revoked_queued_lock(sender=request.task, request=request._context)
        if not held:
            in_the_broker.append(task_id)
    if not in_the_broker or app is None or not uses_redislock(app):
        return
    recorded = delays_wait_in_the_broker(app)
    settings = app_settings(app)
    index = app_pending(app, settings.enqueue_backend or settings.backend, settings.key_prefix)
    mark_ms = _mark_ttl_ms(app)
    for task_id in in_the_broker:
        try:
            # No worker holds the message yet: a call that finds the key
            # held by this one takes it over (enqueue.py) instead of joining.
            index.mark_revoked(task_id, mark_ms)
            if recorded:
                _give_back_recorded(app, task_id)
        except LockBackendError as exc:
            # This runs in the consumer: one bounded failure, not one per id.
            logger.warning("could not free the keys of revoked %s: %s", in_the_broker, exc)
            return


def _mark_ttl_ms(app: Any) -> int:
    """How long a revoke's mark lives: as long as Celery remembers a revoke, or longer.

    A worker discards a revoked message for ``REVOKE_EXPIRES`` (3 h), and
    an enqueue-time key may outlive its enqueue TTL: a run revoked while it
    runs hands its key to its retry (for the enqueue TTL + the countdown)
    after Celery discarded that retry (review helper-33 F3).
    """
    longest = max(app_settings(app).enqueue_ttl, float(worker_state.REVOKE_EXPIRES))
    for task in list(app.tasks.values()):
        if isinstance(task, SingletonTaskMixin):
            with contextlib.suppress(Exception):  # a misconfigured task fails where it runs
                longest = max(longest, task.lock_settings().enqueue_ttl)
    return max(int(longest * 1000), 1)


def _give_back_recorded(app: Any, task_id: str) -> None:
    """Give back the keys of a call whose countdown waits in the broker (quorum queues).

    No worker holds its message, so the call's record (kept at ``delay()``,
    see ``enqueue.py``) says what to free. Every worker gets the revoke:
    one that does not know the task leaves the record to one that does, and
    the record goes only once its keys are given back. Two workers may both
    give back: each give-back is a compare-and-delete of the call's own
    value, a no-op the second time, and so for a message already delivered
    and running, which has replaced or freed those values.
    """
    settings = app_settings(app)
    # The enqueue store: its connections give up within redislock_enqueue_timeout.
    store = settings.enqueue_backend or settings.backend
    index = app_pending(app, store, settings.key_prefix)
    record = index.read_revocable(task_id)
    task = None if record is None else app.tasks.get(record.task_name)
    if record is None or not isinstance(task, SingletonTaskMixin):
        return
    task_settings = task.lock_settings()
    if record.debounced:
        (task_settings.enqueue_backend or store).debounce_due(record.key, task_id, forget=True)
    if record.token is not None:
        key = family_of(record.key).queued if task_settings.coalesce else record.key
        task_settings.backend.release(key, record.token)
    index.forget_revocable(task_id)
    logger.info("gave back the keys of revoked %s[%s] (held by the broker)", task.name, task_id)


def _revoking(command: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(command)
    def revoke_then_give_back(state: Any, **arguments: Any) -> Any:
        reply = command(state, **arguments)
        try:
            app = getattr(getattr(state, "consumer", None), "app", None)
            task_ids = [str(i) for i in maybe_list(arguments.get("task_id")) or []]
            _give_back_revoked(app, task_ids)
        except Exception:
            logger.exception("could not free the keys of revoked tasks")
        return reply

    revoke_then_give_back.redislock_wrapped = True  # type: ignore[attr-defined]
    return revoke_then_give_back


def install_revoke_hook() -> None:
    """Wrap Celery's ``revoke`` and ``terminate`` control commands (once per process)."""
    for name in _REVOKING_COMMANDS:
        command = Panel.data.get(name)
        if command is not None and not getattr(command, "redislock_wrapped", False):
            Panel.data[name] = _revoking(command)


@worker_init.connect(weak=False)
def _install_at_worker_start(sender: Any = None, **_: Any) -> None:
    install_revoke_hook()
