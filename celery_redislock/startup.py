"""Worker start: check the settings and the lock store once, in the worker's parent.

Celery's signal dispatcher logs and swallows what a handler raises, so the
``worker_init`` handler only adds a bootstep, :class:`StartupCheck`, to the
app's worker blueprint; the step is built before the worker starts its
consumer, and a :class:`ConfigurationError` raised there stops the worker
before it prints ``ready``. An unreachable lock store does not: Redis may
come up after the worker, and tasks retry (or run, per
``redislock_on_backend_error``) until it does.

When the store answers, the same step then releases the locks a previous
run of this worker node left behind (``recovery.py``,
``redislock_recover_on_start``), still before the consumer takes its first
message, so the worker is ``ready`` only once they are free.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import bootsteps
from celery.signals import worker_init

from celery_redislock.exceptions import ConfigurationError, LockBackendError, LockStoreRefused
from celery_redislock.recovery import recover_at_start, this_process_started_ms
from celery_redislock.settings import AppSettings, app_settings
from celery_redislock.task import SingletonTaskMixin

__all__ = ["StartupCheck", "check_lock_store", "uses_redislock"]

logger = logging.getLogger("celery_redislock.startup")


def uses_redislock(app: Any) -> bool:
    """True when ``app`` has a singleton task or sets any ``redislock_*`` setting."""
    if any(isinstance(key, str) and "redislock_" in key.lower() for key in app.conf):
        return True
    try:
        tasks = list(app.tasks.values())
    except RuntimeError:  # an app with autofinalize=False that nobody finalized
        tasks = []
    return any(isinstance(task, SingletonTaskMixin) for task in tasks)


def check_lock_store(settings: AppSettings) -> bool:
    """Load the lock scripts on the store and log one line saying how it went.

    Never raises for an unreachable store: the worker keeps starting.

    Returns:
        True when the store answered and loaded the scripts.

    Raises:
        ConfigurationError: the store refuses the package's commands (an ACL,
            a disabled command): no wait mends that.
    """
    store = settings.backend
    try:
        primaries = store.load_scripts(f"{settings.key_prefix}:{{startup-check}}")
    except LockStoreRefused as exc:
        raise ConfigurationError(f"the lock store refuses the package's commands: {exc}") from exc
    except LockBackendError as exc:
        then = (
            "tasks are retried with backoff and then fail (redislock_on_backend_error='fail')"
            if settings.on_backend_error == "fail"
            else "tasks run without the lock (redislock_on_backend_error='run')"
        )
        unrecovered = (
            " Locks left by a previous run of this worker are not recovered: they expire "
            "with their TTL."
            if settings.recover_on_start
            else ""
        )
        logger.warning(
            "celery-redislock: %s. The worker starts anyway (Redis may come up later); "
            "until it answers, %s.%s",
            exc,
            then,
            unrecovered,
        )
        return False
    logger.info(
        "celery-redislock: lock store %s answers; acquire, release and renew scripts loaded%s.",
        store.describe(),
        f" on {primaries} primaries" if primaries > 1 else "",
    )
    return True


class StartupCheck(bootsteps.Step):
    """Worker bootstep: validate the settings, check the lock store, recover a crashed run's locks.

    Runs in the worker's main process while the worker is built: before the
    pool starts its children and before the consumer takes a message.

    Raises (when the worker is built):
        ConfigurationError: a setting is unknown or has an unusable value
            (an embedded worker); ``celery worker`` logs it at CRITICAL and
            exits with status 1 instead, before ``ready``.
    """

    name = "celery_redislock.startup.StartupCheck"
    label = "celery-redislock start-up check"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        # Here, not in the worker_init handler: the worker has finalized its
        # app by now, so every task is registered.
        if not uses_redislock(parent.app):
            return
        try:
            settings = app_settings(parent.app)
            _check_tasks(parent.app)
            answers = check_lock_store(settings)
        except ConfigurationError as exc:
            logger.critical("celery-redislock: the worker cannot start: %s", exc)
            # Imported here: producers import this package too, and need none of it.
            from celery.apps.worker import Worker as WorkerProgram

            if isinstance(parent, WorkerProgram):
                # ``celery worker``: the line above says it all; exit 1 without a traceback.
                raise SystemExit(1) from None
            raise
        if answers and settings.recover_on_start:
            node = getattr(parent, "hostname", None)
            if node:
                recover_at_start(parent.app, node, _worker_started_ms(parent))


def _check_tasks(app: Any) -> None:
    """Merge each singleton task's options over the app's settings, as its first run would.

    Each setting may be fine alone and the merge refused (``redislock_limit=2``
    with ``lock_hold_after_success``): raise that here, before ``ready``.

    Raises:
        ConfigurationError: a task's merged settings are refused.
    """
    for task in list(app.tasks.values()):
        if isinstance(task, SingletonTaskMixin):
            task.lock_settings()


def _worker_started_ms(worker: Any) -> int:
    """When the worker's process started (Unix ms); else when the worker was made."""
    made = getattr(worker, "startup_time", None)  # WorkController: a UTC datetime
    fallback = int(made.timestamp() * 1000) if made is not None else int(time.time() * 1000)
    return this_process_started_ms(fallback)


@worker_init.connect(weak=False)
def _add_startup_check(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None:
        app.steps["worker"].add(StartupCheck)
