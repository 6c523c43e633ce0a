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

from typing import TYPE_CHECKING, Any

import celery

try:
    from celery.contrib.django.task import DjangoTask
except ImportError as exc:  # Celery 5.3 has no DjangoTask
    raise ImportError(
        "celery_redislock.contrib.django needs Celery >= 5.4 (celery.contrib.django.task."
        f"DjangoTask); this is Celery {celery.__version__}: pip install "
        "'celery-redislock[django]'"
    ) from exc

from celery_redislock.task import SingletonTaskMixin

__all__ = ["DjangoSingletonTask"]

if TYPE_CHECKING:
    _DjangoTask = DjangoTask[Any, Any]
else:
    _DjangoTask = DjangoTask


class DjangoSingletonTask(SingletonTaskMixin, _DjangoTask):
    """``DjangoTask`` (with ``delay_on_commit``) that runs once at a time per key.

    ``delay_on_commit`` returns ``None`` (Django's ``on_commit`` gives no
    value back), so a duplicate is simply not published; use ``delay`` for
    the holder's ``AsyncResult``.
    """
