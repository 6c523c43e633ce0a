"""Django: the singleton lock on Celery's ``DjangoTask`` (``delay_on_commit``).

Per task::

    from celery_redislock.contrib.django import DjangoSingletonTask

    @app.task(base=DjangoSingletonTask, lock_enqueue=True)
    def process_payment(webhook_id): ...

    process_payment.delay_on_commit(webhook_id)   # published after COMMIT, deduplicated

App-wide (every task gets the lock; turn it off per task with
``lock_enabled=False``)::

    app = Celery("proj", task_cls="celery_redislock.contrib.django:DjangoSingletonTask")

Needs ``celery>=5.4`` (where ``DjangoTask`` was added) and Django.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import celery
from django.db import transaction  # type: ignore[import-untyped]

try:
    from celery.contrib.django.task import DjangoTask
except ImportError as exc:  # Celery 5.3 has no DjangoTask
    raise ImportError(
        "celery_redislock.contrib.django needs Celery >= 5.4 (celery.contrib.django.task."
        f"DjangoTask); this is Celery {celery.__version__}: pip install "
        "'celery-redislock[django]'"
    ) from exc

from celery_redislock.exceptions import AlreadyQueued
from celery_redislock.task import SingletonTaskMixin

__all__ = ["DjangoSingletonTask"]

logger = logging.getLogger("celery_redislock.enqueue")

if TYPE_CHECKING:
    _DjangoTask = DjangoTask[Any, Any]
else:
    _DjangoTask = DjangoTask


class DjangoSingletonTask(SingletonTaskMixin, _DjangoTask):
    """``DjangoTask`` (with ``delay_on_commit``) that runs once at a time per key.

    ``delay_on_commit`` returns ``None`` (Django's ``on_commit`` gives no
    value back), so a duplicate is simply not published; use ``delay`` for
    the holder's ``AsyncResult``. With ``lock_enqueue_raise=True`` too: the
    transaction has committed when the duplicate is found, and an exception
    from an ``on_commit`` callback would reach the code after the ``with``
    block and stop the callbacks after it; it is logged at INFO instead.
    """

    # The stubs say these return an AsyncResult; Celery's return None.
    def delay_on_commit(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Call :meth:`delay` once the transaction commits; a duplicate is not raised."""
        transaction.on_commit(functools.partial(self._publish_committed, self.delay, args, kwargs))

    def apply_async_on_commit(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Call :meth:`apply_async` once the transaction commits; a duplicate is not raised."""
        publish = self.apply_async
        transaction.on_commit(functools.partial(self._publish_committed, publish, args, kwargs))

    def _publish_committed(
        self, publish: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        try:
            publish(*args, **kwargs)
        except AlreadyQueued as exc:
            logger.info("%s: committed call not published: %s", self.name, exc)
